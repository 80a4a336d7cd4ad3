"""Point-to-point exchange of activations and gradients between neighbouring pipeline stages.

Stages form a ring (the interleaved schedule sends the last stage's output back to the first stage's
next chunk). Every exchange is one batch of isend/irecv ops that is waited in full, so each pair of
stages meets in lockstep (the pattern NCCL needs; gloo is happy with it too). Activations travel with
tag 0 and gradients with tag 1, so two stages that are each other's previous and next (pp=2) never
confuse them. Shapes are fixed per run, so receivers allocate before the data arrives.
"""
from __future__ import annotations

import torch

from megazero import comm
from megazero.comm import Group

ACTIVATION, GRADIENT = 0, 1


class PipelineP2P:
    def __init__(self, group: Group, shape: tuple[int, ...], dtype: torch.dtype, device):
        self.group, self.shape, self.dtype, self.device = group, tuple(shape), dtype, device
        self.next = (group.rank + 1) % group.size
        self.prev = (group.rank - 1) % group.size

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def exchange(self, send_forward: torch.Tensor | None = None, send_backward: torch.Tensor | None = None,
                 recv_forward: bool = False, recv_backward: bool = False):
        """Sends an output to the next stage and/or a gradient to the previous one, and receives an
        input from the previous and/or an output gradient from the next, all in one batch.
        Returns (input or None, output gradient or None)."""
        sends, recvs = [], []
        got_input = self._empty() if recv_forward else None
        got_grad = self._empty() if recv_backward else None
        ops = []
        if send_forward is not None:
            ops.append(("send", send_forward.detach().contiguous(), self.next, ACTIVATION))
        if got_input is not None:
            ops.append(("recv", got_input, self.prev, ACTIVATION))
        if send_backward is not None:
            ops.append(("send", send_backward.detach().contiguous(), self.prev, GRADIENT))
        if got_grad is not None:
            ops.append(("recv", got_grad, self.next, GRADIENT))
        for kind, tensor, peer, tag in ops:
            (sends if kind == "send" else recvs).append((tensor, peer, tag))
        if ops:
            comm.send_recv(sends, recvs, self.group).wait()
        if got_input is not None:
            got_input.requires_grad_()
        return got_input, got_grad


def free_output(tensor: torch.Tensor) -> None:
    """Drops an output activation's memory once it has been sent; its autograd node stays, so the
    backward from it still works (see `backward_from_freed`). Views are left alone (their memory
    belongs to their base)."""
    if tensor is not None and tensor._base is None and tensor.requires_grad:
        tensor.data = torch.empty((1,), dtype=tensor.dtype, device=tensor.device)


def backward_from_freed(outputs, grads) -> None:
    """Runs backward from tensors whose data may have been freed: torch.autograd.backward would check
    their (now 1-element) shapes against the gradients, the engine itself only needs the graph."""
    torch.autograd.Variable._execution_engine.run_backward(
        tuple(outputs), tuple(grads), False, False, (), True, True)
