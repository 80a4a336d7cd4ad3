"""ZeRO's storage: this rank's partition of a flat layout, one interface under every stage.

A `FlatLayout` places parameters end to end in buckets (stages 0-2: gradient buckets cut by size;
stage 3: one bucket per module unit). Each bucket is padded to a multiple of the shard count and
rank r owns chunk r of every bucket, so a bucket is exactly one reduce-scatter or all-gather.

`PartitionedStorage` owns the per-rank optimizer state over that layout (fp32 master, Adam moments,
the gradient partition) and implements, once for every stage, what is done with it: materialize
from an init function, views of one parameter's piece by kind, a parameter's whole value, writes,
the gradient reduction of a filled bucket, the gradient norm (with the non-finite check folded
in), the Adam step and memory accounting. Subclasses say where a bucket's low-precision weights
and gradients live (`param_chunk`, `grad_chunk`) and when full weights exist (the gather policy):
FlatParamGroup keeps them full, UnitStorage gathers units on demand.

Kinds: "param" (the low-precision weights the model computes with), "fp32" (master), "grad",
"exp_avg", "exp_avg_sq" (fp32, or bf16 with the precision-aware optimizer's --exp-avg-dtype /
--exp-avg-sq-dtype). In fp32 runs without a separate master the "fp32" kind *is* "param".
With `offload_optimizer` the "fp32", "exp_avg" and "exp_avg_sq" kinds live off the device, in an
`OptimizerOffload` (offload.py: host memory or swap files), which also runs the step; the master is
then a separate host copy in fp32 runs too.

`ReductionQueue` is the single in-flight policy for gradient reductions.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import NamedTuple

import torch
from torch import nn

from megazero.core import comm
from megazero.core.streams import Streams, label
from megazero.ops.adam import AdamSegment, adam_step, lr_of
from megazero.ops.adam_config import AdamConfig
from .flat import FlatLayout
from .offload import OFFLOADED_KINDS, OptimizerOffload
from .precision import Precision, sum_of_squares_many

KINDS = ("param", "fp32", "grad", "exp_avg", "exp_avg_sq")


class Run(NamedTuple):
    """Elements [lo, hi) of bucket `bucket`'s chunk, stepped with one weight decay and one learning
    rate: the step's lr number `lr_group` (Megatron's --decoupled-lr gives some parameters a second)."""

    bucket: int
    lo: int
    hi: int
    weight_decay: float
    lr_group: int = 0


class NormRun(NamedTuple):
    """Elements [lo, hi) of bucket `bucket`'s gradient chunk, counted in the norm or not."""

    bucket: int
    lo: int
    hi: int
    counted: bool


class ReductionQueue:
    """Gradient reductions in flight, oldest first. Each holds its staging buffer until waited.

    With `overlap` (the default) the compute stream waits for a reduction only where its result
    or its staging memory is needed: `wait_all` before the step reads the gradients, and the
    oldest staged one when too many are staged. A communicator runs its collectives one at a time,
    so two staged reductions in flight keep backward and communication overlapped; more would only
    hold staging memory. The staged elements are also kept under `max_staged` (DeepSpeed's
    reduce_bucket_size), the newest always going out. Reductions without staging (stage 0/1 reduce
    in place) are not bounded. Without `overlap` every push is waited at once."""

    MAX_STAGED_IN_FLIGHT = 2

    def __init__(self, max_staged: int, overlap: bool = True):
        self.max_staged, self.overlap = max_staged, overlap
        self._items: list[tuple[comm.Handle, torch.Tensor | None]] = []

    def push(self, handle: comm.Handle, staging: torch.Tensor | None = None) -> None:
        self._items.append((handle, staging))
        if not self.overlap:
            self.wait_all()
            return
        while self._staged_count() > self.MAX_STAGED_IN_FLIGHT or (
            self._staged_count() > 1 and self.staged_numel() > self.max_staged
        ):
            self._wait_oldest_staged()

    def _staged_count(self) -> int:
        return sum(staging is not None for _, staging in self._items)

    def staged_numel(self) -> int:
        return sum(s.numel() for _, s in self._items if s is not None)

    def staged_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for _, s in self._items if s is not None)

    def _wait_oldest_staged(self) -> None:
        # Collectives on one communicator complete in order: waiting an older in-place reduction
        # first costs nothing extra.
        while self._items:
            handle, staging = self._items.pop(0)
            handle.wait()
            if staging is not None:
                return

    def wait_all(self) -> None:
        items, self._items = self._items, []
        for handle, _ in items:
            handle.wait()


class PartitionedStorage:
    """Per-rank state of a flat layout; see the module docstring for the split with subclasses."""

    weights_always_full: bool  # every rank holds every weight whole (stages 0-2)
    quantized_reduce = None  # qgZ: (output, input) -> Handle, in place of the reduce-scatter

    def __init__(
        self,
        layout: FlatLayout,
        shard: comm.Group | None,
        precision: Precision,
        device,
        queue: ReductionQueue,
        reduce_scatter: bool = True,
        streams: Streams | None = None,
        state_device=None,
    ):
        self.layout, self.shard, self.precision = layout, shard, precision
        self.device, self.queue, self.reduce_scatter = torch.device(device), queue, reduce_scatter
        self.streams = streams if streams is not None else Streams(self.device)
        n = layout.partition_size
        # Offloaded optimizer states are made on the host from the start: a model that needs
        # offload may not have room on the device for them even for a moment.
        where = torch.device(state_device or self.device)
        # fp32 runs: the weights are the master (None), 16-bit runs keep a separate fp32 copy.
        self.master = torch.zeros(n, dtype=torch.float32, device=where) if precision.mixed else None
        # The moments in fp32 or bf16 (--exp-avg-dtype, --exp-avg-sq-dtype): megazero.ops.adam
        # steps them in fp32 and stores them rounded.
        self.exp_avg = torch.zeros(n, dtype=precision.exp_avg_dtype, device=where)
        self.exp_avg_sq = torch.zeros(n, dtype=precision.exp_avg_sq_dtype, device=where)
        self.offload: OptimizerOffload | None = None  # offload_optimizer: states off the device
        self.params: list[nn.Parameter] = []
        self.index_of: dict[int, int] = {}
        self._fresh = [True] * len(layout.buckets)  # gradient chunk holds nothing this step
        self.runs: list[Run] = []
        self.norm_runs: list[NormRun] = []

    # --- where a bucket's chunk of each kind lives ------------------------------------------
    def param_chunk(self, b: int) -> torch.Tensor:
        raise NotImplementedError

    def grad_chunk(self, b: int) -> torch.Tensor:
        raise NotImplementedError

    # Whether a view from `param_chunk` stays valid while other buckets' are asked for. A stage-3
    # home in a few host buffers or swap files holds one bucket's (or a few) at a time: a view taken
    # earlier may by then be written back and its buffer reused for another bucket.
    param_chunks_stay = True

    def by_bucket(self, runs: list) -> list[list]:
        """`runs` (tuples starting with the bucket) in batches whose param_chunk views are valid
        together: all at once, or one bucket at a time where views do not stay."""
        if self.param_chunks_stay:
            return [runs] if runs else []
        return [list(batch) for _, batch in itertools.groupby(runs, key=lambda run: run[0])]

    def _part(self, tensor: torch.Tensor, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        return tensor[bucket.local_offset : bucket.local_offset + bucket.chunk]

    @property
    def separate_master(self) -> bool:
        """Whether the fp32 master is a tensor of its own (16-bit runs, or offloaded states)."""
        return self.master is not None or self.offload is not None

    def offload_optimizer_states(self, config, sub_group_size: int, folder, name: str, make=OptimizerOffload) -> None:
        """Moves the fp32 master and Adam moments off the device (`offload_optimizer`, after
        materialize): `folder` holds the swap files (named after `name`) for device "nvme".
        `make(storage, config, sub_group_size, folder, name)` builds the offload (ZenFlow's own)."""
        self.offload = make(self, config, sub_group_size, folder, name)
        self.master = self.exp_avg = self.exp_avg_sq = None

    def checkpoint_kinds(self) -> tuple[str, ...]:
        """The kinds a checkpoint holds of each parameter piece: the master and Adam moments, and
        whatever state the offload adds (ZenFlow: the weights in use, its accumulator, its selection)."""
        return getattr(self.offload, "checkpoint_kinds", OFFLOADED_KINDS)

    def chunk(self, kind: str, b: int) -> torch.Tensor:
        """This rank's chunk of bucket `b` in tensor `kind` (a host tensor for offloaded kinds)."""
        if self.offload is not None and kind in getattr(self.offload, "kinds", OFFLOADED_KINDS):
            bucket = self.layout.buckets[b]
            return self.offload.view(kind, bucket.local_offset, bucket.chunk)
        if kind == "param" or (kind == "fp32" and self.master is None):
            return self.param_chunk(b)
        if kind == "grad":
            return self.grad_chunk(b)
        if kind == "fp32":
            return self._part(self.master, b)
        if kind in ("exp_avg", "exp_avg_sq"):
            return self._part(getattr(self, kind), b)
        raise ValueError(f"unknown storage kind {kind!r}; use one of {KINDS}")

    # --- one parameter ------------------------------------------------------------------------
    def local_view(self, param: nn.Parameter, kind: str) -> torch.Tensor:
        """This rank's piece of `param` (1-D, possibly empty) in tensor `kind`."""
        i = self.index_of[id(param)]
        b = self.layout.slots[i].bucket
        chunk = self.chunk(kind, b)
        piece = self.layout.local_piece(i)
        if piece is None:
            return chunk[:0]
        rel = piece.partition_offset - self.layout.buckets[b].local_offset
        return chunk[rel : rel + piece.length]

    def local_pieces(self):
        """(parameter, offset inside its flat value, length) of every piece this rank holds: what a
        checkpoint shard of this storage contains (`local_view` gives each piece by kind)."""
        for i, param in enumerate(self.params):
            piece = self.layout.local_piece(i)
            if piece is not None:
                yield param, piece.param_offset, piece.length

    def gathered(self, param: nn.Parameter, kind: str) -> torch.Tensor:
        """The whole of `param` in tensor `kind` as fp32, assembled from every shard (collective
        over the shard group)."""
        i = self.index_of[id(param)]
        slot = self.layout.slots[i]
        bucket = self.layout.buckets[slot.bucket]
        # Offloaded kinds are host tensors: collectives take the device's copy.
        chunk = self.chunk(kind, slot.bucket).to(self.device).contiguous()
        if self.shard is None:
            whole = chunk
        else:
            whole = chunk.new_empty(bucket.size)
            comm.all_gather(whole, chunk, self.shard)
        start = slot.offset - bucket.start
        return whole[start : start + slot.numel].view(self.full_shape(i)).to(torch.float32, copy=True)

    def full_shape(self, i: int) -> torch.Size:
        return self.params[i].shape

    def write_full(self, param: nn.Parameter, kind: str, value: torch.Tensor) -> None:
        """Stores this rank's piece of a full value (every rank passes the same value); an fp32
        write also updates the low-precision weights."""
        i = self.index_of[id(param)]
        flat = value.detach().reshape(-1)
        piece = self.layout.local_piece(i)
        if piece is not None:
            self.local_view(param, kind).copy_(flat[piece.param_offset : piece.param_offset + piece.length])
        if kind == "fp32":
            self.write_full_weights(i, flat)
        elif kind == "param":
            self.wrote_weights(i, flat)

    def wrote_weights(self, i: int, flat: torch.Tensor) -> None:
        """After a write of parameter i's low-precision piece ("param", every rank passing the full
        value): stages that keep weights whole take the whole value; stage 3 publishes it."""

    def write_full_weights(self, i: int, flat: torch.Tensor) -> None:
        """After an fp32 write of parameter i's full value: the low-precision copy follows."""
        if self.separate_master:
            self.refresh_low_precision(self.params[i])

    def refresh_low_precision(self, param: nn.Parameter) -> None:
        """After a local fp32 write: this rank's piece of the low-precision weights follows (the
        other ranks see it after the next gather)."""
        if self.separate_master:
            self.local_view(param, "param").copy_(self.local_view(param, "fp32"))

    def _write_initial_piece(self, i: int, value: torch.Tensor) -> None:
        """Initial fp32 value of parameter i: this rank's piece goes to the master (if separate)."""
        piece = self.layout.local_piece(i)
        if piece is not None and self.master is not None:
            start, end = piece.partition_offset, piece.partition_offset + piece.length
            self.master[start:end].copy_(value[piece.param_offset : piece.param_offset + piece.length])

    # --- gradients ----------------------------------------------------------------------------
    def reduce_bucket(self, b: int, staging: torch.Tensor) -> None:
        """Reduces `staging` (bucket b's gradients of this backward, in the reduce dtype) over the
        shard group and adds this rank's chunk of the sum to its gradient chunk (copies it on the
        step's first reduction). Buffers are allocated on the compute stream, which also reads
        them when the handle is waited; only the collective is issued on the reduce stream.
        With qgZ (`quantized_reduce`) the whole reduction is queued on the reduce stream: its
        quantizations, both hops and the sums between them, chained by stream waits, in buffers
        allocated and freed there; the compute stream waits once, for the event after the last sum."""
        target = self.grad_chunk(b)
        fresh, self._fresh[b] = self._fresh[b], False
        rank, chunk = self.layout.rank, self.layout.buckets[b].chunk
        quantized = self.quantized_reduce is not None and self.shard is not None and self.shard.size > 1
        scatter = quantized or (self.shard is not None and self.shard.size > 1 and self.reduce_scatter)
        direct = scatter and fresh and staging.dtype == target.dtype
        if direct:
            out = target
        elif scatter:
            out = label(
                torch.empty(chunk, dtype=staging.dtype, device=staging.device), f"bucket {b}: this rank's reduced chunk"
            )
        else:  # all-reduce the whole bucket, then read this rank's chunk of it
            out = staging[rank * chunk : (rank + 1) * chunk]
        handle = self._issue_reduction(out, staging, scatter, quantized)
        then = None if direct else (lambda: target.copy_(out)) if fresh else (lambda: target.add_(out))
        self.queue.push(comm.Handle([handle], then), staging)

    def _issue_reduction(self, out: torch.Tensor, staging: torch.Tensor, scatter: bool, quantized: bool) -> comm.Handle:
        with self.reduce_stream():
            if quantized:
                handle = self.quantized_reduce(out, staging)
            elif scatter:
                handle = comm.reduce_scatter(out, staging, self.shard, async_op=True)
            elif self.shard is not None:
                handle = comm.all_reduce(staging, self.shard, async_op=True)
            else:
                handle = comm.Handle()
        return handle

    @contextlib.contextmanager
    def reduce_stream(self):
        """Context for issuing a gradient reduction: the reduce stream, after the work queued on
        the compute stream so far (the backward that produced the gradients). Completion is
        waited on the compute stream through the handle. A no-op on CPU."""
        with self.streams.reduce as side:
            side.wait_current()
            yield side

    def new_staging(self, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        return label(
            torch.zeros(bucket.size, dtype=self.precision.reduce_dtype, device=self.device),
            f"bucket {b}: gradient staging",
        )

    def ensure_grads(self) -> None:
        """Stage 2/3 gradient partitions hold memory only from the step's first reduction to the
        optimizer step; subclasses with such a partition give it its memory back here."""

    def zero_grad(self) -> None:
        self._fresh = [True] * len(self.layout.buckets)

    # --- optimizer ----------------------------------------------------------------------------
    def plan(self, weight_decay_of, counts_in_norm, lr_group_of=lambda param: 0, muon=lambda param: False) -> None:
        """Cuts each bucket's chunk into runs of equal weight decay and lr group (padding joins a
        neighbour) for the step, and into counted / not-counted runs for the gradient norm.
        The parameters `muon(param)` says Muon steps (megazero.zero.muon) are left out of the runs."""
        self.runs, self.norm_runs = [], []
        for b, bucket in enumerate(self.layout.buckets):
            cursor, runs, after_muon = 0, [], False
            for i in bucket.slots:
                piece = self.layout.local_piece(i)
                if piece is None:
                    continue
                lo = piece.partition_offset - bucket.local_offset
                hi = lo + piece.length
                wd = weight_decay_of(self.params[i], self.full_shape(i))
                group = lr_group_of(self.params[i])
                skipped = bool(muon(self.params[i]))
                if skipped:
                    pass
                elif runs and not after_muon and runs[-1].weight_decay == wd and runs[-1].lr_group == group:
                    runs[-1] = runs[-1]._replace(hi=hi)
                else:
                    runs.append(Run(b, cursor, hi, wd, group))
                cursor, after_muon = hi, skipped
                counted = bool(counts_in_norm(self.params[i]))
                last = self.norm_runs[-1] if self.norm_runs else None
                if last is not None and last.bucket == b and last.hi == lo and last.counted == counted:
                    self.norm_runs[-1] = last._replace(hi=hi)
                else:
                    self.norm_runs.append(NormRun(b, lo, hi, counted))
            if cursor < bucket.chunk:  # padding: zero gradients, updates stay zero
                if runs and not after_muon:
                    runs[-1] = runs[-1]._replace(hi=bucket.chunk)
                else:
                    runs.append(Run(b, cursor, bucket.chunk, 0.0))
            self.runs.extend(runs)

    def grad_sumsq(self) -> torch.Tensor:
        """float64 sum of squares of the counted gradients; a non-finite value anywhere in this
        rank's gradient chunks makes it non-finite (uncounted runs add 0 * their sum), so the
        norm's all-reduce doubles as the overflow check. One foreach norm over all the runs."""
        runs = [(self.grad_chunk(b)[lo:hi], counted) for b, lo, hi, counted in self.norm_runs]
        return sum_of_squares_many([g for g, c in runs if c], [g for g, c in runs if not c], device=self.device)

    def counted_stats(self, kind: str) -> torch.Tensor:
        """float64 [sum of squares, zeros] of this rank's `kind` ("fp32" or "grad") over the
        elements counted in the norm (Megatron's --log-params-norm, --log-num-zeros-in-grad)."""
        out = torch.zeros(2, dtype=torch.float64, device=self.device)
        for runs in self.by_bucket([run for run in self.norm_runs if run.counted]):
            pieces = [self.chunk(kind, b)[lo:hi] for b, lo, hi, _ in runs]
            pieces = [t.to(self.device, non_blocking=True) for t in pieces if t.numel()]
            if pieces:
                out[0] += sum_of_squares_many(pieces, device=self.device)
                out[1] += torch.stack([(t == 0).sum() for t in pieces]).sum().double()
        return out

    def step(self, step: int, lr, config: AdamConfig, grad_scale: float) -> None:
        """Adam on every run of this rank's chunks, in one `adam_step` (on a GPU: torch's fused
        kernel, one launch per weight decay and lr); `lr` as `lr_of` reads it. With a separate fp32 master the updated values are
        also written to the low-precision weights, in the same pass where the CPU kernel runs (the
        runs cover every chunk whole, padding included). Offloaded states step on the CPU
        (offload.py), then the device weights follow."""
        if self.offload is not None:
            self.offload.step(self, step, lr, config, grad_scale)
            self.after_step()
            return
        for runs in self.by_bucket(self.runs):
            segments = [
                AdamSegment(
                    self.chunk("fp32", b)[lo:hi],
                    self.grad_chunk(b)[lo:hi],
                    self.chunk("exp_avg", b)[lo:hi],
                    self.chunk("exp_avg_sq", b)[lo:hi],
                    wd,
                    self.param_chunk(b)[lo:hi] if self.master is not None else None,
                    lr_of(lr, group),
                )
                for b, lo, hi, wd, group in runs
            ]
            adam_step(segments, step=step, lr=lr_of(lr, 0), config=config, grad_scale=grad_scale)
        self.after_step()

    def after_step(self) -> None:
        """After the step (the low-precision weights are already updated): subclasses gather."""

    # --- accounting ---------------------------------------------------------------------------
    @staticmethod
    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes by category; offloaded states add their host_* / nvme_* bytes."""
        out = {
            "master": self.nbytes(self.master),
            "optimizer_states": self.nbytes(self.exp_avg) + self.nbytes(self.exp_avg_sq),
        }
        if self.offload is not None:
            out.update(self.offload.memory_bytes())
        return out
