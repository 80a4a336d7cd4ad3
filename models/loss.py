"""The output layer and its cross entropy fused, a chunk of tokens at a time, so the full fp32 logits
(tokens x vocabulary: ~10 GB at 8 x 2048 tokens and 50k words) never exist.

Forward, per chunk: logits = x_c W^T, then each token's max, softmax denominator and target logit;
only those (two floats per token) are kept. Backward, per chunk: the logits are recomputed, turned into
softmax - onehot(label), scaled by the incoming gradient, and multiplied into dx_c and dW. The formulas
are those of the unchunked path (shifted = logits - max; loss = log(sum exp(shifted)) - shifted[label];
gradient = exp(shifted) / sum - onehot), so fp32 results agree with it to rounding noise.

The vocabulary may be split across ranks (Megatron's vocab-parallel cross entropy): `VocabShard` says
which rows of the vocabulary this weight holds and how the per-token max and sums are combined over
the ranks that hold the others. The single-device model uses `LOCAL` (no combining); the
tensor-parallel head (parallel/cross_entropy.py) passes its own, whose reductions are all-reduces.
Rows at or beyond the real vocabulary are padding and never enter the softmax.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from .weight_grad import deposit, marked, matmul_fp32, zero_grad_for


def _no_reduce(tensor: torch.Tensor) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This weight's rows are vocabulary ids [start, start + rows); `reduce_max` / `reduce_sum`
    combine a per-token tensor in place over the ranks holding the rest (no-ops on one device)."""
    start: int = 0
    reduce_max: Callable[[torch.Tensor], None] = _no_reduce
    reduce_sum: Callable[[torch.Tensor], None] = _no_reduce


LOCAL = VocabShard()


def default_chunk_tokens(tokens: int, vocab_rows: int, hidden: int) -> int:
    """Tokens per chunk such that a chunk's logits are about as large as the hidden states of all
    tokens (vocab_rows / hidden chunks; one chunk when the vocabulary is narrower than the model)."""
    chunks = max(1, -(-vocab_rows // max(1, hidden)))
    return max(1, -(-tokens // chunks))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, vocab_size: int, shard: VocabShard, chunk_tokens: int):
        real = max(0, min(weight.shape[0], vocab_size - shard.start))   # rows of real words held here
        w = weight[:real]
        x2, flat_labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
        n = x2.shape[0]
        maxes, sums, losses = (torch.empty(n, device=x.device, dtype=torch.float32) for _ in range(3))
        for lo in range(0, n, chunk_tokens):
            hi = min(n, lo + chunk_tokens)
            logits = F.linear(x2[lo:hi], w).float()
            local_labels, in_range = _local_labels(flat_labels[lo:hi], shard.start, real)
            if real:
                logits_max = logits.max(dim=-1).values
            else:          # this rank holds only padding rows: it adds nothing to the max or the sums
                logits_max = logits.new_full((hi - lo,), float("-inf"))
            shard.reduce_max(logits_max)
            shifted = logits - logits_max.unsqueeze(-1)
            target = (shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1) * in_range if real
                      else torch.zeros_like(logits_max))
            # One reduction carries both the target logit and the softmax denominator.
            combined = torch.stack([target, shifted.exp().sum(dim=-1)])
            shard.reduce_sum(combined)
            maxes[lo:hi], sums[lo:hi] = logits_max, combined[1]
            losses[lo:hi] = combined[1].log() - combined[0]
        ctx.save_for_backward(x, weight, labels, maxes, sums)
        ctx.real, ctx.start, ctx.chunk_tokens = real, shard.start, chunk_tokens
        return losses.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_losses):
        x, weight, labels, maxes, sums = ctx.saved_tensors
        real, chunk = ctx.real, ctx.chunk_tokens
        w = weight[:real]
        x2, flat_labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
        grad_flat = grad_losses.reshape(-1).float()
        grad_x = torch.zeros_like(x2)
        # fp32 accumulation across chunks; a 16-bit weight gets its gradient rounded once at the end
        grad_w = (torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
                  if ctx.needs_input_grad[1] else None)
        for lo in range(0, x2.shape[0] if real else 0, chunk):
            hi = min(x2.shape[0], lo + chunk)
            logits = F.linear(x2[lo:hi], w).float()
            softmax = (logits - maxes[lo:hi].unsqueeze(-1)).exp_().div_(sums[lo:hi].unsqueeze(-1))
            local_labels, in_range = _local_labels(flat_labels[lo:hi], ctx.start, real)
            softmax.scatter_add_(-1, local_labels.unsqueeze(-1), -in_range.unsqueeze(-1).to(softmax.dtype))
            grad_logits = softmax.mul_(grad_flat[lo:hi].unsqueeze(-1)).to(x.dtype)
            grad_x[lo:hi] = grad_logits @ w
            if grad_w is not None:
                grad_w[:real] += matmul_fp32(grad_logits.t(), x2[lo:hi])
        if grad_w is not None and marked(weight):
            deposit(weight, grad_w)
            grad_w = zero_grad_for(weight)
        elif grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_x.view(x.shape), grad_w, None, None, None, None


def _local_labels(labels: torch.Tensor, start: int, rows: int):
    in_range = (labels >= start) & (labels < start + rows)
    return torch.where(in_range, labels - start, torch.zeros_like(labels)), in_range


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                         shard: VocabShard = LOCAL, chunk_tokens: int | None = None) -> torch.Tensor:
    """Per-token loss (labels' shape) of logits x W^T over the real vocabulary, never holding more
    than `chunk_tokens` tokens' logits (default: default_chunk_tokens)."""
    tokens = labels.numel()
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(tokens, weight.shape[0], x.shape[-1])
    return _LinearCrossEntropy.apply(x, weight, labels, vocab_size, shard, max(1, chunk_tokens))
