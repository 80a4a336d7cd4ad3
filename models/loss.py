"""The output layer and its cross entropy fused, so that the fp32 logits (tokens x vocabulary: ~13 GB
at 16k tokens and a 200k vocabulary) exist at most one memory budget's worth at a time.

The chunking policy (`chunk_tokens_for`): when every token's fp32 logits fit `LOGITS_BUDGET_BYTES`,
the head runs as one chunk and the forward keeps exp(logits - max) for the backward, which then is
one pass over it and two GEMMs (what F.linear + F.cross_entropy's autograd does, with one fp32 tensor
saved where they save the logits and their log-softmax). Otherwise the tokens are cut into the fewest equal chunks
whose logits fit the budget, but no chunk under `MIN_CHUNK_TOKENS` tokens: the weight gradient's
GEMM reduces over a chunk's tokens and its fp32 sum is rewritten once per chunk, so chunks of a few
dozen tokens (the rule before this one, vocab / hidden chunks, cut 512 tokens at vocab 8k into 22)
ran its CPU GEMM at 16 GFLOP/s against 56 at 1024 tokens (one thread, vocab 8k, hidden 384). The
forward then keeps two floats per token (the max and the softmax denominator) and the backward
recomputes each chunk's logits.
megazero.config.memory_estimate counts the same policy.

Per chunk: logits = x_c W^T in fp32; shifted = logits - max; loss = log(sum exp(shifted)) -
shifted[label]; gradient = (exp(shifted) / sum - onehot) x the incoming gradient g (computed as
exp(shifted) x (g / sum) - g onehot), multiplied into dx_c and dW. These are the unchunked path's formulas, so fp32 results agree with it to rounding.

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

from .split_backward import deferred_to
from .weight_grad import deposit, marked, matmul_fp32, zero_grad_for

# One chunk's fp32 logits may take this much memory (and its gradient, in the weights' dtype, beside
# it in backward): the whole head in one chunk up to 512 MiB (1024 tokens at a 128k vocabulary).
LOGITS_BUDGET_BYTES = 512 * 2**20
# The fewest tokens a chunk holds, whatever the budget (it wins over the budget): the weight
# gradient's GEMM reduces over a chunk's tokens and needs about a thousand of them to run at speed.
MIN_CHUNK_TOKENS = 1024


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


def chunk_tokens_for(tokens: int, vocab_rows: int, budget_bytes: int = LOGITS_BUDGET_BYTES) -> int:
    """Tokens per chunk: all of them when their fp32 logits fit `budget_bytes`; else the fewest equal
    chunks that fit it, but never chunks under MIN_CHUNK_TOKENS (the floor wins over the budget)."""
    tokens = max(1, tokens)
    fits = max(1, budget_bytes // (4 * max(1, vocab_rows)))
    chunks = max(1, min(-(-tokens // fits), tokens // MIN_CHUNK_TOKENS))
    return -(-tokens // chunks)


def keeps_softmax(tokens: int, chunk_tokens: int) -> bool:
    """Whether the forward keeps its exp(logits - max) for the backward (one chunk) rather than
    the backward recomputing the logits."""
    return chunk_tokens >= tokens


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, vocab_size: int, shard: VocabShard, chunk_tokens: int, work):
        real = max(0, min(weight.shape[0], vocab_size - shard.start))  # rows of real words held here
        w = weight[:real]
        x2, flat_labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
        n = x2.shape[0]
        keep = keeps_softmax(n, chunk_tokens)
        maxes, sums, losses = (torch.empty(n, device=x.device, dtype=torch.float32) for _ in range(3))
        local_labels, in_range = _local_labels(flat_labels, shard.start, real)
        kept = None
        for lo in range(0, n, chunk_tokens):
            hi = min(n, lo + chunk_tokens)
            exp = _chunk_statistics(
                x2[lo:hi],
                w,
                local_labels[lo:hi],
                in_range[lo:hi],
                shard,
                real,
                maxes[lo:hi],
                sums[lo:hi],
                losses[lo:hi],
            )
            if keep and real:
                kept = exp
        ctx.save_for_backward(x, weight, local_labels, in_range, maxes, sums, kept)
        ctx.real, ctx.chunk_tokens, ctx.work, ctx.param = real, chunk_tokens, work, weight
        return losses.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_losses):
        x, weight, local_labels, in_range, maxes, sums, kept = ctx.saved_tensors
        real, chunk = ctx.real, ctx.chunk_tokens
        w = weight[:real]
        x2 = x.reshape(-1, x.shape[-1])
        n = x2.shape[0]
        grad_flat = grad_losses.reshape(-1, 1).float()
        want_w = ctx.needs_input_grad[1] and ctx.work is None
        grad_x = x2.new_zeros(x2.shape) if not real else x2.new_empty(x2.shape)  # contiguous
        grad_w = None  # fp32 sum over the chunks; a 16-bit weight's is rounded once at the end
        for lo in range(0, n if real else 0, chunk):
            hi = min(n, lo + chunk)
            # the kept exp is used once, scaled in place (a second backward through it raises)
            grad_logits = _chunk_logits_gradient(x2, w, kept, maxes, sums, grad_flat, local_labels, in_range, lo, hi)
            torch.matmul(grad_logits, w, out=grad_x[lo:hi])
            if want_w:
                part = matmul_fp32(grad_logits.t(), x2[lo:hi])
                grad_w = part if grad_w is None else grad_w.add_(part)
            del grad_logits
        if ctx.needs_input_grad[1] and ctx.work is not None:
            param = ctx.param
            ctx.work.add(
                lambda _: [
                    (
                        param,
                        _deferred_weight_grad(param, x2, real, chunk, maxes, sums, grad_flat, local_labels, in_range),
                    )
                ]
            )
        elif want_w:
            grad_w = _weight_grad_for_autograd(weight, _pad_rows(grad_w, weight))
        return grad_x.view(x.shape), grad_w, None, None, None, None, None


def _chunk_logits_gradient(x2, w, kept, maxes, sums, grad_flat, local_labels, in_range, lo: int, hi: int):
    """Tokens [lo, hi)'s logits gradient in x's dtype: from the kept exp(logits - max), or the logits
    recomputed from x and w (the same ops as the forward's, so the same values)."""
    exp = kept if kept is not None else F.linear(x2[lo:hi], w).float().sub_(maxes[lo:hi, None]).exp_()
    return _logits_gradient(exp, sums[lo:hi], grad_flat[lo:hi], local_labels[lo:hi], in_range[lo:hi]).to(x2.dtype)


def _deferred_weight_grad(weight, x2, real: int, chunk: int, maxes, sums, grad_flat, local_labels, in_range):
    """The output weight's gradient at a split backward's W: each chunk's logits recomputed (one more
    GEMM than the plain backward) instead of holding a vocabulary-wide tensor from B to W."""
    grad_w, w = None, weight[:real]
    for lo in range(0, x2.shape[0] if real else 0, chunk):
        hi = min(x2.shape[0], lo + chunk)
        grad_logits = _chunk_logits_gradient(x2, w, None, maxes, sums, grad_flat, local_labels, in_range, lo, hi)
        part = matmul_fp32(grad_logits.t(), x2[lo:hi])
        grad_w = part if grad_w is None else grad_w.add_(part)
    return _weight_grad_for_autograd(weight, _pad_rows(grad_w, weight))


def _weight_grad_for_autograd(weight, grad_w):
    """An fp32 gradient as autograd gets it: deposited for a marked weight (zeros returned), else cast."""
    if marked(weight):
        deposit(weight, grad_w)
        return zero_grad_for(weight)
    return grad_w.to(weight.dtype)


def _chunk_statistics(x, w, local_labels, in_range, shard: VocabShard, real: int, maxes, sums, losses):
    """One chunk's forward: fills its tokens' max, softmax denominator and loss; returns the fp32
    exp(logits - max) (the chunk's logits, overwritten in place)."""
    logits = F.linear(x, w).float()
    if real:
        logits_max = logits.amax(dim=-1)
    else:  # this rank holds only padding rows: it adds nothing to the max or the sums
        logits_max = logits.new_full((x.shape[0],), float("-inf"))
    shard.reduce_max(logits_max)
    shifted = logits.sub_(logits_max.unsqueeze(-1))
    target = (
        shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1) * in_range if real else torch.zeros_like(logits_max)
    )
    exp = shifted.exp_()
    # One reduction carries both the target logit and the softmax denominator.
    combined = torch.stack([target, exp.sum(dim=-1)])
    shard.reduce_sum(combined)
    maxes.copy_(logits_max)
    sums.copy_(combined[1])
    torch.sub(combined[1].log(), combined[0], out=losses)
    return exp


def _logits_gradient(exp, sums, grad, local_labels, in_range):
    """(exp / sum - onehot(label)) x grad, in place in `exp`, as exp x (grad / sum) less grad at
    the label (one pass over the logits; labels outside this shard's rows: no onehot)."""
    exp.mul_(grad / sums.unsqueeze(-1))
    return exp.scatter_add_(-1, local_labels.unsqueeze(-1), -grad * in_range.unsqueeze(-1).to(grad.dtype))


def _pad_rows(grad_w, weight):
    """The weight's full-shape fp32 gradient: the real rows' sum, zeros for the padding rows (all
    zeros when this rank holds padding only)."""
    if grad_w is None:
        return torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
    if grad_w.shape[0] == weight.shape[0]:
        return grad_w
    padding = grad_w.new_zeros(weight.shape[0] - grad_w.shape[0], weight.shape[1])
    return torch.cat([grad_w, padding])


def _local_labels(labels: torch.Tensor, start: int, rows: int):
    in_range = (labels >= start) & (labels < start + rows)
    return torch.where(in_range, labels - start, torch.zeros_like(labels)), in_range


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    shard: VocabShard = LOCAL,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token loss (labels' shape) of logits x W^T over the real vocabulary, never holding more
    than `chunk_tokens` tokens' logits (default: chunk_tokens_for's memory budget)."""
    tokens = labels.numel()
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(tokens, weight.shape[0])
    return _LinearCrossEntropy.apply(x, weight, labels, vocab_size, shard, max(1, chunk_tokens), deferred_to(weight))
