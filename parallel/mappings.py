"""Autograd mappings between the tensor-parallel region and the replicated world around it.

Each name says which way data moves in the forward pass; the backward pass does the conjugate
(Megatron-LM, Shoeybi et al. 2019, the f/g operators; sequence parallelism from Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models"):

    copy_to_tp_region            fwd identity          bwd all-reduce        (f)
    reduce_from_tp_region        fwd all-reduce        bwd identity          (g)
    scatter_to_tp_region         fwd split last dim    bwd all-gather last dim
    gather_from_tp_region        fwd all-gather last   bwd split last dim   (or another dim)
    scatter_to_sequence_region   fwd split seq dim     bwd all-gather seq dim
    gather_from_sequence_region  fwd all-gather seq    bwd reduce-scatter seq
    reduce_scatter_to_sequence_region  fwd reduce-scatter seq   bwd all-gather seq

Tensors are batch-first, so the sequence dimension is 1. All communication goes through megazero.core.comm.
"""

from __future__ import annotations

import torch

from megazero.core import comm
from megazero.core.comm import Group

SEQ_DIM = 1


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    comm.all_reduce(x, group)
    return x


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along `dim`; gathers into a (world, *x.shape) buffer, then moves that axis in place."""
    if group.size == 1:
        return x
    return start_gather(x, dim, group, async_op=False)()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sums over ranks and keeps this rank's chunk of `dim`."""
    if group.size == 1:
        return x
    return start_reduce_scatter(x, dim, group, async_op=False)[1]


def start_gather(x: torch.Tensor, dim: int, group: Group, async_op: bool = True):
    """`_gather`'s collective issued (asynchronously by default); returns `finish()`, which waits
    for it and returns the gathered tensor (moving the ranks' axis into `dim` copies, so only after
    the wait)."""
    x = x.contiguous()
    out = x.new_empty((group.size, *x.shape))
    handle = comm.all_gather(out, x, group, async_op=async_op)

    def finish() -> torch.Tensor:
        if handle is not None:
            handle.wait()
        return out.movedim(0, dim).flatten(dim, dim + 1) if dim != 0 else out.flatten(0, 1)

    return finish


def start_reduce_scatter(x: torch.Tensor, dim: int, group: Group, async_op: bool = True):
    """`_reduce_scatter`'s collective issued (asynchronously by default): (handle or None, result),
    the result read after handle.wait()."""
    shape = list(x.shape)
    if shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {shape[dim]} does not split over {group.size} ranks")
    chunks = x.unflatten(dim, (group.size, shape[dim] // group.size)).movedim(dim, 0).contiguous()
    shape[dim] //= group.size
    out = x.new_empty(shape)
    return comm.reduce_scatter(out, chunks, group, async_op=async_op), out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, grad.dim() - 1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, SEQ_DIM, ctx.group), None


def copy_to_tp_region(x, group: Group):
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x, group: Group):
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x, group: Group):
    return x if group.size == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp_region(x, group: Group, dim: int = -1):
    """All-gather along `dim` (the last by default) of a tensor every rank holds a slice of, whose
    gradient is the same on every rank (so the backward keeps its slice, no reduction)."""
    return x if group.size == 1 else _GatherFromTP.apply(x, group, dim % x.dim())


def scatter_to_sequence_region(x, group: Group, dim: int = SEQ_DIM):
    return x if group.size == 1 else _ScatterToSequence.apply(x, group, dim)


def gather_from_sequence_region(x, group: Group):
    return x if group.size == 1 else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence_region(x, group: Group):
    return x if group.size == 1 else _ReduceScatterToSequence.apply(x, group)
