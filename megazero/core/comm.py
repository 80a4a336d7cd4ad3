"""The comm layer: every collective of the project goes through the functions here.

It owns the `Group` handle (a torch process group plus the facts the accounting needs: its global
ranks, this rank's index, whether it spans nodes) and the ops; each op counts its bytes in the
group's `CommLog` (megazero/core/comm_log.py, re-exported here: bytes per step by op, group and
intra/inter-node, and the trace the dry run compares). It must not know what the bytes are
(parameters, gradients, activations): callers decide that.

A group of one rank short-circuits every op (nothing moves, nothing is counted), so single-process
runs need no torch.distributed at all.

Streams: an op runs after the work queued on the current stream; an async op's `Handle.wait()` makes
the stream current at the wait wait for it (NCCL's work.wait() does that; under the CPU stream
checker the Handle holds the event that ends the op on its communicator's modelled stream). Under
the checker every collective declares the tensors it reads and writes (`_issue`).

Tensor lifetimes: torch's NCCL (>= 2.8) records no stream on a collective's tensors; it holds them
until the wait, which orders only the waiting stream after the op. A tensor allocated on another
stream (the copy stream's offloaded chunk, the prefetch stream's quantized send buffer) would go back
to that stream's pool when its last reference goes after the wait, and could be handed out there
while NCCL still reads it. So every async op's Handle holds its tensors until the wait and then
records them on the waiting stream (`Handle.wait`): the allocator reuses none of them before that
stream has passed its wait for the op. Sync ops run on the current stream and need nothing.

Devices: a `Group` knows the device its collectives run on (the rank's CUDA device under NCCL, the
CPU under gloo). Every op checks every tensor it is given against it before anything else, groups of
one included, so a tensor on the wrong device fails with a message naming the op, the group and both
devices instead of an opaque backend error (or, on one GPU, not at all until the cluster run).
Tensors this module creates itself are created on the group's device.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch
import torch.distributed as dist

from megazero.core import host_read, kernels, streams
from megazero.core.comm_log import CommEntry, CommLog, _call_site

ReduceOp = dist.ReduceOp

# torch >= 2.13 renamed the tensor collectives; older releases only have the old names.
# Declared seams: the dry run simulating gloo gives them gloo's flat copies.
all_gather_single = kernels.declare(
    "all-gather into one tensor", getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
reduce_scatter_single = kernels.declare(
    "reduce-scatter of one tensor", getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


@dataclasses.dataclass(eq=False)
class Group:
    """A process group as the rest of the code sees it: global ranks, my index, where it lives."""

    name: str
    ranks: tuple[int, ...]
    rank: int  # this process's index inside `ranks`
    pg: object | None  # torch ProcessGroup; None for a group of one
    intra_node: bool
    log: CommLog
    device: torch.device = torch.device("cpu")  # where every tensor of its collectives lives
    # The backend whose semantics the collectives follow, when `pg` stands in for it (the dry run's
    # fake backend for the flags' nccl); None: pg's own.
    stands_for: str | None = None

    def __post_init__(self):
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            # Tensors always report an index, so a bare "cuda" would never match one.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"Group({self.name}, ranks={list(self.ranks)}, rank={self.rank}, device={self.device})"


class Handle:
    """An async op's handle; waiting twice is harmless (the second wait returns at once).

    `wait()` makes the current stream wait for the op: `done` (an Event recorded after the op on the
    stream that did it, where the works cannot say so themselves), then each work's wait (gloo's may
    finish the op with copies on the waiting thread). The op's `tensors`, held until then, are
    recorded on the waiting stream and let go (see the module docstring). `then` runs once, after
    that, on the first wait, on the waiting stream (e.g. copying a result out of a temporary buffer)."""

    def __init__(
        self,
        works: Sequence[object] = (),
        then=None,
        done: streams.Event | None = None,
        tensors: Sequence[torch.Tensor] = (),
        log: CommLog | None = None,
    ):
        self._works = list(works)
        self._log = log
        self._then = then
        self._done = done
        self._tensors = list(tensors)

    def wait(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done.wait()
        works, self._works = self._works, []
        started = time.perf_counter()
        for work in works:
            work.wait()
        if self._log is not None and works:
            self._log.wait_s += time.perf_counter() - started
        held, self._tensors = self._tensors, []
        record_on_waiting_stream(held)
        del held
        then, self._then = self._then, None
        if then is not None:
            then()

    @property
    def done(self) -> bool:
        return not self._works and self._done is None


def record_on_waiting_stream(tensors: Sequence[torch.Tensor]) -> None:
    """An op's tensors, at its wait: recorded on the waiting (current) stream, which the wait has
    ordered after the op, so the allocator hands none of them out again, on whichever stream made
    it, before that stream has got past the wait."""
    for tensor in tensors:
        streams.record_on_current_stream(tensor)


def _check_device(op: str, group: Group, what: str, tensor: torch.Tensor) -> None:
    """Raises unless `tensor` is on the group's device (one device comparison: cheap, always on)."""
    if tensor.device != group.device:
        raise ValueError(
            f"{op}: {what} is on {tensor.device} but group {group.name} (ranks {list(group.ranks)}) "
            f"communicates on {group.device}; create the tensor on {group.device}"
        )


check_device = _check_device  # for collectives built on these ones (megazero.zero.quantized_comm)


def _ring_fraction(group: Group) -> float:
    return (group.size - 1) / group.size


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if a.device.type == "meta":  # meta storages have no data: every pointer is 0
        return sa._cdata == sb._cdata
    return sa.data_ptr() == sb.data_ptr()


def backend_of(group: Group) -> str:
    """The backend whose path the group's collectives take: the one it stands for, else its own."""
    return group.stands_for or str(dist.get_backend(group.pg))


def _issue(group: Group, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], call, async_op: bool):
    """Runs `call()` (the torch.distributed op); returns (its work, the event that ends it or None).
    Under the CPU stream checker the op reads `reads` and writes `writes` as NCCL would run it
    (megazero.core.nccl_semantics); elsewhere the backend's work orders the streams
    (NCCL) or the host (gloo)."""
    checker = streams.checker_for(group.device)
    started = time.perf_counter()
    try:
        if checker is None:
            return call(), None
        return checker.collective(group.pg, group.name, reads, writes, call, async_op=async_op)
    finally:
        if not async_op:  # a synchronous op blocks the host in the call (gloo) until its peers come
            group.log.wait_s += time.perf_counter() - started


def _finish(
    work, done, async_op: bool, tensors: Sequence[torch.Tensor], then=None, log: CommLog | None = None
) -> Handle | None:
    """An async op's Handle, holding `tensors` until its wait; a synchronous op is waited here (on
    the current stream)."""
    works = work if isinstance(work, list) else [work] if work is not None else []
    handle = Handle(works, then, done, tensors if async_op else (), log)
    if async_op:
        return handle
    handle.wait()
    return None


def local_handle(group: Group, async_op: bool = True) -> Handle | None:
    """What a group of one's op returns: it was a copy on the current stream, or nothing, and is
    still an op with an event. The stream that waits for the handle may be another one (a gather
    copied on the prefetch stream, read by the forward on the compute stream), so the handle
    carries an event recorded after the op on the current stream."""
    return Handle(done=streams.Event(group.device).record()) if async_op else None


def all_reduce(tensor: torch.Tensor, group: Group, op=ReduceOp.SUM, async_op: bool = False):
    _check_device("all_reduce", group, "tensor", tensor)
    if group.size == 1:
        return local_handle(group, async_op)
    group.log.record("all_reduce", group, 2 * _ring_fraction(group) * _nbytes(tensor), tensor, op)
    work, done = _issue(
        group, [tensor], [tensor], lambda: dist.all_reduce(tensor, op=op, group=group.pg, async_op=async_op), async_op
    )
    return _finish(work, done, async_op, [tensor], log=group.log)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group, op=ReduceOp.SUM, async_op: bool = False):
    """`input` holds `group.size` equal chunks; chunk i, summed over ranks, lands in rank i's `output`."""
    _check_device("reduce_scatter", group, "output", output)
    _check_device("reduce_scatter", group, "input", input)
    if input.numel() != output.numel() * group.size:
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected {output.numel()} x {group.size}"
        )
    if group.size == 1:
        output.copy_(input.view_as(output))
        return local_handle(group, async_op)
    group.log.record("reduce_scatter", group, _ring_fraction(group) * _nbytes(input), input, op)
    then = None
    if _shares_storage(output, input) and backend_of(group) != "nccl":
        # In place (output is this rank's chunk of input) is defined for NCCL only; gloo can
        # corrupt it, so go through a temporary and copy back once the op is done (on the waiting
        # stream, where the Handle recorded the temporary).
        target, output = output, torch.empty_like(output, device=group.device)

        def then():
            target.copy_(output)

    # Flat views: backends disagree on how they match multi-dimensional shapes.
    work, done = _issue(
        group,
        [input],
        [output],
        lambda: reduce_scatter_single(output.view(-1), input.view(-1), op=op, group=group.pg, async_op=async_op),
        async_op,
    )
    return _finish(work, done, async_op, [input, output], then, group.log)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False):
    """Rank i's `input` lands in chunk i of every rank's `output`."""
    _check_device("all_gather", group, "output", output)
    _check_device("all_gather", group, "input", input)
    if output.numel() != input.numel() * group.size:
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected {input.numel()} x {group.size}")
    if group.size == 1:
        output.view_as(input).copy_(input)
        return local_handle(group, async_op)
    group.log.record("all_gather", group, _ring_fraction(group) * _nbytes(output), output)
    work, done = _issue(
        group,
        [input],
        [output],
        lambda: all_gather_single(output.view(-1), input.view(-1), group=group.pg, async_op=async_op),
        async_op,
    )
    return _finish(work, done, async_op, [input, output], log=group.log)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False):
    _check_device("all_to_all", group, "output", output)
    _check_device("all_to_all", group, "input", input)
    if group.size == 1:
        output.copy_(input)
        return local_handle(group, async_op)
    group.log.record("all_to_all", group, _ring_fraction(group) * _nbytes(input), input)
    work, done = _issue(
        group,
        [input],
        [output],
        lambda: dist.all_to_all_single(output, input, group=group.pg, async_op=async_op),
        async_op,
    )
    return _finish(work, done, async_op, [input, output], log=group.log)


def broadcast(tensor: torch.Tensor, src_index: int, group: Group) -> None:
    """Broadcasts from the rank at index `src_index` of the group."""
    _check_device("broadcast", group, "tensor", tensor)
    if group.size == 1:
        return
    group.log.record("broadcast", group, _ring_fraction(group) * _nbytes(tensor), tensor, root=group.ranks[src_index])
    work, done = _issue(
        group, [tensor], [tensor], lambda: dist.broadcast(tensor, src=group.ranks[src_index], group=group.pg), False
    )
    _finish(work, done, False, (), log=group.log)


def all_reduce_object_max(value: float, group: Group) -> float:
    """Max of a Python number over the group (used for flags such as 'any rank overflowed')."""
    if group.size == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=group.device)
    all_reduce(t, group, op=ReduceOp.MAX)
    return host_read.read(t, "max over a group", healthy=[float(value)])[0]


def send_recv(sends: Sequence[tuple], recvs: Sequence[tuple], group: Group) -> Handle:
    """Batched point-to-point: `sends`/`recvs` are (tensor, index of the peer in `group`).

    No tags (NCCL ignores them): messages between two ranks match in the order each side lists
    them, so callers must list a pair's sends and the peer's receives in the same order."""
    ops = []
    for kind, items in (("send", sends), ("recv", recvs)):
        fn = dist.isend if kind == "send" else dist.irecv
        for tensor, peer in items:
            _check_device("send_recv", group, f"{kind} tensor (peer index {peer})", tensor)
            ops.append((kind, dist.P2POp(fn, tensor, group.ranks[peer], group.pg)))
    if not ops:
        return local_handle(group)
    for kind, op in ops:  # counted only once every tensor has passed the check
        group.log.record(kind, group, _nbytes(op.tensor), op.tensor, peer=op.peer)
    sent = [op.tensor for kind, op in ops if kind == "send"]
    received = [op.tensor for kind, op in ops if kind == "recv"]
    works, done = _issue(group, sent, received, lambda: dist.batch_isend_irecv([op for _, op in ops]), True)
    return Handle(works, done=done, tensors=sent + received, log=group.log)


def barrier(group: Group) -> None:
    if group.size > 1:
        if group.log.entries is not None:
            group.log.entries.append(
                CommEntry("barrier", group.name, tuple(group.ranks), "-", 0, (), site=_call_site())
            )
        dist.barrier(group=group.pg)


def all_to_all_uneven(
    output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Group
) -> None:
    """Rows `input_splits[j]` of `input` (in order) go to rank j; rank j's rows for this rank land
    in `output`, `output_splits[j]` of them, in rank order (dim 0; expert-parallel dispatch).
    Counted as the bytes this rank sends to the others; traced as "all_to_allv" (its input), whose
    members agree on the row's width and dtype, not on the rows each sends."""
    _check_device("all_to_all", group, "output", output)
    _check_device("all_to_all", group, "input", input)
    if group.size == 1:
        output.copy_(input)
        return
    row = _nbytes(input) // max(input.shape[0], 1)
    group.log.record("all_to_allv", group, row * (sum(input_splits) - input_splits[group.rank]), input)
    work, done = _issue(
        group,
        [input],
        [output],
        lambda: dist.all_to_all_single(output, input, list(output_splits), list(input_splits), group=group.pg),
        False,
    )
    _finish(work, done, False, [input, output])
