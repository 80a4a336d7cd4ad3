"""Tensor-parallel layers (Megatron-LM's column/row split), each a drop-in for a pure-model module.

Every split parameter carries a `TPShard` (attribute `tp_shard`) saying how its local tensor is cut
from the full one, so initialisation and checkpoint tools can build or reassemble full tensors without
knowing the layer. Parameters without it are replicated across the TP group; `tensor_parallel` marks
the split ones (gradient-norm code counts replicated ones once).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megazero.models.param_info import set_param_info
from megazero.core.comm import Group
from megazero.models.gpt import token_positions
from megazero.models.split_backward import deferred_to, wanted
from megazero.models.weight_grad import add_bias, embedding, linear, linear_param_grads, norm, wants_fp32_grad
from .cross_entropy import vocab_parallel_linear_cross_entropy
from .mappings import (
    SEQ_DIM,
    _gather,
    _reduce_scatter,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    start_gather,
    start_reduce_scatter,
)


@dataclasses.dataclass(frozen=True)
class TPShard:
    """The local tensor is piece `rank` of `size` along `dim`; with chunks > 1 the full tensor is
    `chunks` equal blocks along dim (SwiGLU's [gate; up]) and each block is split, so every rank holds
    its share of every block, concatenated."""

    dim: int
    rank: int
    size: int
    chunks: int = 1

    def local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        blocks = full.chunk(self.chunks, dim=self.dim)
        return torch.cat([b.chunk(self.size, dim=self.dim)[self.rank] for b in blocks], dim=self.dim)

    def full_from_locals(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of local_from_full given every rank's local tensor (in rank order)."""
        per_rank = [t.chunk(self.chunks, dim=self.dim) for t in locals_]
        blocks = [torch.cat([pr[c] for pr in per_rank], dim=self.dim) for c in range(self.chunks)]
        return torch.cat(blocks, dim=self.dim)

    def full_shape(self, local_shape) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] *= self.size
        return tuple(shape)


def mark_split(param: nn.Parameter, shard: TPShard) -> nn.Parameter:
    set_param_info(param, tp_shard=shard, tensor_parallel=True)
    return param


def _param(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by output rows; the output stays split unless gather_output."""

    def __init__(
        self,
        in_features,
        out_features,
        bias,
        group: Group,
        sequence_parallel=False,
        chunks=1,
        gather_output=False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if out_features % (group.size * chunks):
            raise ValueError(f"output size {out_features} does not split into {chunks} x {group.size}")
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, gather_output
        shard = TPShard(0, group.rank, group.size, chunks)
        local_out = out_features // group.size
        self.weight = mark_split(_param((local_out, in_features), device, dtype), shard)
        self.bias = mark_split(_param((local_out,), device, dtype), shard) if bias else None

    def forward(self, x):
        if self.sequence_parallel and self.group.size > 1:
            y = _SequenceGatheredLinear.apply(
                x, self.weight, self.bias, self.group, wants_fp32_grad(self.weight), deferred_to(self.weight, self.bias)
            )
        else:
            y = linear(copy_to_tp_region(x, self.group), self.weight, self.bias)
        return gather_from_tp_region(y, self.group) if self.gather_output else y


class _SequenceGatheredLinear(torch.autograd.Function):
    """Sequence parallelism's column-parallel GEMM, y = gather(x) A^T + b, keeping for the backward
    only this rank's sequence shard of x: the weight gradient needs the whole sequence, which the
    backward all-gathers again (as Megatron-LM does) while it computes the input's gradient, and
    that gradient's reduce-scatter runs while it computes the weight's. Kept whole, the gathered
    inputs of a layer's two column-parallel GEMMs would cost 4 s b h bytes on every rank, not
    4 s b h / tp. `fp32`: the weight is marked for an fp32 gradient sum (models/weight_grad.py),
    decided by the caller, since grad mode is off in here.

    In a split backward (`work`, models/split_backward.py) B computes the input's gradient and its
    reduce-scatter only, and W gathers the shard again for the weight's: W starts that gather
    before the previous deferred GEMM runs, so it still moves during a GEMM. W holds the shard
    and the output's gradient, not the gathered input."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, fp32, work):
        ctx.group, ctx.params, ctx.fp32, ctx.work = group, (weight, bias), fp32, work
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x, SEQ_DIM, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        param, bias = ctx.params
        wants_weight, wants_bias = ctx.needs_input_grad[1:3]
        if ctx.work is not None:
            grad_x = _reduce_scatter(grad @ weight, SEQ_DIM, ctx.group) if ctx.needs_input_grad[0] else None
            group, fp32 = ctx.group, ctx.fp32
            ctx.work.add(
                lambda gathered: wanted(
                    zip(
                        (param, bias),
                        linear_param_grads(
                            grad, gathered() if wants_weight else None, param, bias, fp32, wants_weight, wants_bias
                        ),
                    )
                ),
                prepare=lambda: start_gather(x, SEQ_DIM, group) if wants_weight else None,
            )
            return grad_x, None, None, None, None, None
        gathered = start_gather(x, SEQ_DIM, ctx.group) if wants_weight else None
        reducing = grad_x = None
        if ctx.needs_input_grad[0]:
            reducing, grad_x = start_reduce_scatter(grad @ weight, SEQ_DIM, ctx.group)
        full = gathered() if wants_weight else None
        grad_w, grad_b = linear_param_grads(grad, full, param, bias, ctx.fp32, wants_weight, wants_bias)
        del full
        if reducing is not None:
            reducing.wait()
        return grad_x, grad_w, grad_b, None, None, None


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by input columns; x arrives split, partial outputs are summed."""

    def __init__(self, in_features, out_features, bias, group: Group, sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        if in_features % group.size:
            raise ValueError(f"input size {in_features} does not split over {group.size} ranks")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = mark_split(
            _param((out_features, in_features // group.size), device, dtype), TPShard(1, group.rank, group.size)
        )
        self.bias = _param((out_features,), device, dtype) if bias else None
        if self.bias is not None and sequence_parallel:
            # Each rank adds the bias to its own tokens only, so its gradient is partial; it is
            # summed over TP once per step (megazero.parallel.finalize).
            set_param_info(self.bias, sequence_parallel=True)

    def forward(self, x):
        y = linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.group)
        else:
            y = reduce_from_tp_region(y, self.group)
        return add_bias(y, self.bias) if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary) are split; returns this rank's partial sum (unreduced)."""

    def __init__(self, num_embeddings, embedding_dim, group: Group, device=None, dtype=None):
        super().__init__()
        if num_embeddings % group.size:
            raise ValueError(f"vocabulary {num_embeddings} does not split over {group.size} ranks")
        self.group = group
        self.local_rows = num_embeddings // group.size
        self.vocab_start = group.rank * self.local_rows
        self.weight = mark_split(
            _param((self.local_rows, embedding_dim), device, dtype), TPShard(0, group.rank, group.size)
        )

    def forward(self, tokens):
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_start + self.local_rows)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        return embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)


class ParallelEmbedding(nn.Module):
    """Word (vocab-parallel) + position embeddings and dropout; under sequence parallelism the
    output is this rank's sequence shard, and its dropout draws a per-rank mask."""

    def __init__(
        self,
        word: VocabParallelEmbedding,
        position: nn.Embedding | None,
        dropout: nn.Module,
        group: Group,
        sequence_parallel: bool,
    ):
        super().__init__()
        self.word, self.position, self.dropout = word, position, dropout
        self.group, self.sequence_parallel = group, sequence_parallel
        self.positions = None  # as models.gpt.Embedding.positions (context parallelism)

    def forward(self, tokens, documents=None):
        x = self.word(tokens)
        if self.sequence_parallel:
            x = reduce_scatter_to_sequence_region(x, self.group)
        else:
            x = reduce_from_tp_region(x, self.group)
        if self.position is not None:
            pos = self.position(token_positions(self.positions, tokens, documents))
            if self.sequence_parallel:  # (s, h), or (b, s, h) with packed documents' positions
                pos = scatter_to_sequence_region(pos, self.group, dim=pos.dim() - 2)
            x = x + pos
        return self.dropout(x)


class ParallelLMHead(nn.Module):
    """Output projection onto this rank's vocabulary range; with labels, the projection and the
    vocab-parallel cross entropy run fused (parallel.cross_entropy), never holding the full logits."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: Group, sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.vocab_size, self.group, self.sequence_parallel = vocab_size, group, sequence_parallel
        self.vocab_start = group.rank * weight.shape[0]

    def forward(self, x, labels=None):
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.group)
        else:
            x = copy_to_tp_region(x, self.group)
        if labels is None:
            return gather_from_tp_region(F.linear(x, self.weight), self.group)[..., : self.vocab_size]
        return vocab_parallel_linear_cross_entropy(
            x, self.weight, labels, self.group, self.vocab_start, self.vocab_size
        )


class SequenceParallelNorm(nn.Module):
    """LayerNorm/RMSNorm on a sequence shard: its weight (and bias) gradients are partial per rank,
    marked `sequence_parallel` and summed over TP once per step (megazero.parallel.finalize). A
    zero-centred norm (--apply-layernorm-1p) scales by weight + 1, as the module it replaces."""

    def __init__(self, norm: nn.Module, group: Group):
        super().__init__()
        self.kind = "rmsnorm" if isinstance(norm, nn.RMSNorm) else "layernorm"
        self.normalized_shape = tuple(norm.normalized_shape)
        self.eps = norm.eps
        self.zero_centered_gamma = getattr(norm, "zero_centered_gamma", False)
        self.weight = norm.weight
        self.bias = getattr(norm, "bias", None)
        self.group = group
        for p in (self.weight, self.bias):
            if p is not None:
                set_param_info(p, sequence_parallel=True)

    def forward(self, x):
        return norm(x, self.weight, self.bias, self.kind, self.normalized_shape, self.eps, self.zero_centered_gamma)
