"""Point-to-point exchange of activations and gradients between neighbouring pipeline stages.

Stages form a ring (the interleaved schedule sends the last stage's output back to the first stage's
next chunk). Shapes are fixed per run, so receivers allocate before the data arrives.

Matching by order, never by tag. NCCL ignores point-to-point tags: between two ranks, the n-th
message one of them sends in a direction is the n-th the other receives from it. Every message here
goes with tag 0, and correctness rests on this rule:

1. Every `exchange` is one batch of isend/irecv ops. Without overlap each is waited in full before
   the next one, so each pair of stages meets in lockstep. With overlap (`start_exchange`, Megatron's
   overlap_p2p_comm) batches stay in flight while the stage computes and are waited only when their
   tensors are needed; the schedules then issue the same ops as without, in the same order per
   peer and direction, only batched differently, so the matching is unchanged. A stage's batches
   still run one after another on its communicator (NCCL: one stream), so a receive issued early
   delays the sends issued after it: the overlapped schedules are checked for that too.
2. Inside a batch, sends are listed activation (to the next stage) before gradient (to the previous
   one), and receives activation (from the previous stage) before gradient (from the next one). For
   a pair (A, B), A sends B [its activation if B is A's next, its gradient if B is A's previous] and
   B receives from A [an activation if A is B's previous, a gradient if A is B's next]. B is A's next
   exactly when A is B's previous, so both lists name the same messages in the same order; this
   holds at pp=2 too, where the previous and next stage are one rank and an activation and a
   gradient can cross the same way in one batch.
3. Across batches, every schedule posts each stage's receives from a neighbour in the order that
   neighbour sends. tests/parallel/pipeline/test_p2p_order.py runs every schedule for pp 2-4, with
   and without overlap, over a transport with no tags that delivers strictly first-in first-out per direction
   and runs each stage's batches one after another (as one NCCL communicator's stream does), and
   checks each message's kind, microbatch and model chunk on arrival.

NCCL also requires every rank of a communicator to take part when its first operation is a batched
isend/irecv, so the constructor runs one small all-reduce over the group: build `PipelineP2P` once
per run, on every rank of the pipeline group.
"""

from __future__ import annotations

import torch

from megazero.core import comm
from megazero.core.comm import Group
from megazero.core.streams import label


class PipelineP2P:
    def __init__(self, group: Group, shape: tuple[int, ...], dtype: torch.dtype, device):
        self.group, self.shape, self.dtype = group, tuple(shape), dtype
        self.device = torch.device(device)
        self.next = (group.rank + 1) % group.size
        self.prev = (group.rank - 1) % group.size
        self._warm_up()

    def _warm_up(self) -> None:
        """A collective every rank of the group joins, before any batched point-to-point."""
        comm.all_reduce(torch.zeros(1, dtype=torch.float32, device=self.device), self.group)

    def _start(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]):
        """Issues one batch of (tensor, peer index) sends and receives; returns its handle."""
        return comm.send_recv(sends, recvs, self.group)

    def _empty(self, what: str) -> torch.Tensor:
        return label(torch.empty(self.shape, dtype=self.dtype, device=self.device), what)

    def start_exchange(
        self,
        send_forward: torch.Tensor | None = None,
        send_backward: torch.Tensor | None = None,
        recv_forward: bool = False,
        recv_backward: bool = False,
    ) -> "PendingExchange":
        """Issues one batch: an output to the next stage and/or a gradient to the previous one, an
        input from the previous and/or an output gradient from the next. Returns at once; the
        tensors are the pending exchange's `wait()`."""
        got_input = self._empty("pipeline input received") if recv_forward else None
        got_grad = self._empty("pipeline output gradient received") if recv_backward else None
        # Activations first, then gradients, on both lists: the order is the matching (see above).
        sends = [
            (t.detach().contiguous(), peer)
            for t, peer in ((send_forward, self.next), (send_backward, self.prev))
            if t is not None
        ]
        recvs = [(t, peer) for t, peer in ((got_input, self.prev), (got_grad, self.next)) if t is not None]
        handle = self._start(sends, recvs) if sends or recvs else None
        return PendingExchange(handle, got_input, got_grad, sends)

    def exchange(
        self,
        send_forward: torch.Tensor | None = None,
        send_backward: torch.Tensor | None = None,
        recv_forward: bool = False,
        recv_backward: bool = False,
    ):
        """`start_exchange`, waited in full. Returns (input or None, output gradient or None)."""
        return self.start_exchange(send_forward, send_backward, recv_forward, recv_backward).wait()

    def exchange_with(self, sends: list[tuple[torch.Tensor, int]], recv_from: list[tuple[int, str]]):
        """One batch with any stages (the list schedules, action_runner.py): `sends` are (tensor,
        stage), `recv_from` (stage, what); waited in full, returns the received tensors in that
        order (requiring grad). The caller lists each pair's messages in the order both sides agree
        on (rule 2 above, generalised: by kind, virtual stage and microbatch)."""
        got = [self._empty(what) for _, what in recv_from]
        ops_out = [(t.detach().contiguous(), peer) for t, peer in sends]
        ops_in = [(t, peer) for t, (peer, _) in zip(got, recv_from)]
        if ops_out or ops_in:
            self._start(ops_out, ops_in).wait()
        for t in got:
            t.requires_grad_()
        return got


class PendingExchange:
    """One batch in flight. Keeps the sent tensors alive (their memory must not be reused before the
    backend has read them, though the schedule frees the outputs they came from) until `wait()`,
    which returns (input or None, output gradient or None); waiting again returns the same."""

    def __init__(self, handle, got_input: torch.Tensor | None, got_grad: torch.Tensor | None, sends):
        self.handle, self.got_input, self.got_grad, self.sends = handle, got_input, got_grad, sends

    def wait(self):
        if self.handle is not None:
            self.handle.wait()
            self.handle = self.sends = None
            if self.got_input is not None:
                self.got_input.requires_grad_()
        return self.got_input, self.got_grad


def free_output(tensor: torch.Tensor) -> None:
    """Drops an output activation's memory once it has been sent; its autograd node stays, so the
    backward from it still works (see `backward_from_freed`). Views are left alone (their memory
    belongs to their base)."""
    if tensor is not None and tensor._base is None and tensor.requires_grad:
        tensor.data = torch.empty((1,), dtype=tensor.dtype, device=tensor.device)


def backward_from_freed(outputs, grads) -> None:
    """Runs backward from tensors whose data may have been freed: torch.autograd.backward would check
    their (now 1-element) shapes against the gradients, the engine itself only needs the graph."""
    torch.autograd.Variable._execution_engine.run_backward(tuple(outputs), tuple(grads), False, False, (), True, True)
