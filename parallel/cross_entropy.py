"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

Never gathers the full logits: each rank holds a contiguous vocabulary range; the max, the target logit
and the softmax denominator are combined with all-reduces of (b, s)-sized tensors. Vocabulary rows at
or beyond `vocab_size` are padding and are masked out, so padding never changes the loss.
"""
from __future__ import annotations

import torch

from megazero.core import comm
from megazero.core.comm import Group, ReduceOp


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group: Group, vocab_start: int, vocab_size: int):
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        local = logits.shape[-1]
        real_local = max(0, min(local, vocab_size - vocab_start))
        if real_local < local:
            logits = logits.clone()
            logits[..., real_local:] = float("-inf")

        logits_max = logits.max(dim=-1).values
        comm.all_reduce(logits_max, group, op=ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        in_range = (labels >= vocab_start) & (labels < vocab_start + real_local)
        local_labels = torch.where(in_range, labels - vocab_start, torch.zeros_like(labels))
        target = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1) * in_range
        exp = shifted.exp()
        # One all-reduce carries both the target logit and the softmax denominator.
        combined = torch.stack([target, exp.sum(dim=-1)])
        comm.all_reduce(combined, group)
        target, sum_exp = combined[0], combined[1]

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, in_range)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_labels, in_range = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -in_range.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: Group,
                                 vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Per-token loss (same shape as labels) from this rank's logits over [vocab_start, +local)."""
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, vocab_size)
