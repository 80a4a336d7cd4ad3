"""Cross entropy over an output layer whose vocabulary rows are split across tensor-parallel ranks.

Never gathers the full logits, and never holds this rank's full fp32 logits either: the projection and
the loss run fused, a chunk of tokens at a time (megazero.models.loss, which owns the math and keeps the
single-device path). Each rank holds a contiguous vocabulary range; the per-token max, target logit and
softmax denominator are combined with all-reduces of chunk-sized tensors (every TP rank sees the same
tokens, so all run the same chunks). Rows at or beyond `vocab_size` are padding and never count.
"""

from __future__ import annotations

import torch

from megazero.core import comm
from megazero.core.comm import Group, ReduceOp
from megazero.models.loss import VocabShard, linear_cross_entropy


def vocab_shard(group: Group, vocab_start: int) -> VocabShard:
    """This rank's vocabulary rows from `vocab_start`, combined over `group` by all-reduces."""
    return VocabShard(
        start=vocab_start,
        reduce_max=lambda t: comm.all_reduce(t, group, op=ReduceOp.MAX),
        reduce_sum=lambda t: comm.all_reduce(t, group),
    )


def vocab_parallel_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    group: Group,
    vocab_start: int,
    vocab_size: int,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token loss (labels' shape) of x's logits against this rank's weight rows
    [vocab_start, +rows); x is the full (gathered) input every TP rank holds. The gradient it
    returns for x is this rank's partial sum (the caller's copy-to-TP mapping all-reduces it)."""
    return linear_cross_entropy(x, weight, labels, vocab_size, vocab_shard(group, vocab_start), chunk_tokens)
