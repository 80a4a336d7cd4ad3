"""Applies tensor (and sequence) parallelism to a pure GPT by swapping its modules in place.

The swaps keep every module at its attribute path, so parameter names are unchanged and the
layout-independent init (seed, name) still applies. Run it on a model built on the meta device: the
new layers allocate only their local shards (still on meta) and nothing is initialised here.

Order matters and is fixed: TP swaps first, then the RNG-tracked dropout, then the recompute hook.
"""

from __future__ import annotations

from torch import nn

from megazero.core.comm import Group
from megazero.models.gpt import GPT, Attention, Embedding, LMHead, MLP, TransformerLayer
from megazero.models.moe import MoELayer
from megazero.models.param_info import set_param_info
from .layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    ParallelLMHead,
    RowParallelLinear,
    SequenceParallelNorm,
    TPShard,
    VocabParallelEmbedding,
    mark_split,
)
from .random import RNGTracker, TrackedDropout, TrackedModule, make_checkpoint_fn


def _column(linear: nn.Linear, group, sp, chunks=1) -> ColumnParallelLinear:
    w = linear.weight
    return ColumnParallelLinear(
        linear.in_features,
        linear.out_features,
        linear.bias is not None,
        group,
        sp,
        chunks=chunks,
        device=w.device,
        dtype=w.dtype,
    )


def _row(linear: nn.Linear, group, sp) -> RowParallelLinear:
    w = linear.weight
    return RowParallelLinear(
        linear.in_features, linear.out_features, linear.bias is not None, group, sp, device=w.device, dtype=w.dtype
    )


def _parallelize_layer(layer: TransformerLayer, group: Group, sp: bool, tracker: RNGTracker) -> None:
    attention: Attention = layer.attention
    attention.qkv = _column(attention.qkv, group, sp)
    attention.proj = _row(attention.proj, group, sp)
    # Different heads live on different TP ranks: their attention-dropout masks must differ.
    attention.core = TrackedModule(attention.core, tracker)
    # A MoE layer's experts split in parallel.moe; its shared expert is a dense MLP, split here.
    mlp: MLP | None = layer.mlp.shared_experts if isinstance(layer.mlp, MoELayer) else layer.mlp
    if mlp is not None:
        mlp.fc1 = _column(mlp.fc1, group, sp, chunks=2 if mlp.swiglu else 1)
        mlp.fc2 = _row(mlp.fc2, group, sp)
    gate = getattr(mlp, "gate_weight", None)  # the shared expert's gate: whole on every TP rank
    if gate is not None and sp:  # sees this rank's sequence shard: a partial gradient
        set_param_info(gate, sequence_parallel=True)
    _parallelize_norms(layer, group, sp, tracker)


def _parallelize_norms(layer: TransformerLayer, group: Group, sp: bool, tracker: RNGTracker) -> None:
    if sp:
        layer.input_norm = SequenceParallelNorm(layer.input_norm, group)
        layer.mlp_norm = SequenceParallelNorm(layer.mlp_norm, group)
        # Each TP rank holds different tokens: residual dropout must differ too.
        layer.attention_dropout = TrackedDropout(layer.attention_dropout.p, tracker)
        layer.mlp_dropout = TrackedDropout(layer.mlp_dropout.p, tracker)


def _parallel_embedding(embedding: Embedding, group: Group, sp: bool, tracker) -> ParallelEmbedding:
    word = embedding.word
    parallel_word = VocabParallelEmbedding(
        word.num_embeddings, word.embedding_dim, group, device=word.weight.device, dtype=word.weight.dtype
    )
    dropout = TrackedDropout(embedding.dropout.p, tracker) if sp else embedding.dropout
    return ParallelEmbedding(parallel_word, embedding.position, dropout, group, sp)


def _parallel_head(head: LMHead, tied_weight, group: Group, sp: bool) -> ParallelLMHead:
    if tied_weight is None:
        rows, cols = head.weight.shape
        weight = nn.Parameter(head.weight.new_empty(rows // group.size, cols))
        mark_split(weight, TPShard(0, group.rank, group.size))
        for attr in ("init_name", "shared_embedding"):  # set by the pipeline split, if any
            if hasattr(head.weight, attr):
                setattr(weight, attr, getattr(head.weight, attr))
    else:
        weight = tied_weight
    return ParallelLMHead(weight, head.vocab_size, group, sp)


def parallelize(model: GPT, tp_group: Group, tracker: RNGTracker, sequence_parallel: bool = False) -> GPT:
    """Swaps `model`'s layers for tensor-parallel ones over `tp_group` (in place; returns it)."""
    model.set_checkpoint_fn(make_checkpoint_fn(tracker))
    if tp_group.size == 1:
        return model  # a TP group of one is the pure model; sequence parallel is a no-op
    sp = sequence_parallel
    tied = (
        model.embedding is not None
        and model.output_head is not None
        and model.output_head.weight is model.embedding.word.weight
    )
    if model.embedding is not None:
        model.embedding = _parallel_embedding(model.embedding, tp_group, sp, tracker)
    for layer in model.layers.values():
        _parallelize_layer(layer, tp_group, sp, tracker)
    if model.final_norm is not None and sp:
        model.final_norm = SequenceParallelNorm(model.final_norm, tp_group)
    if model.output_head is not None:
        tied_weight = model.embedding.word.weight if tied else None
        model.output_head = _parallel_head(model.output_head, tied_weight, tp_group, sp)
    return model
