"""Cutting a (meta-device) GPT down to one pipeline stage's share.

Each stage keeps only its layers (the ModuleDict keeps global indices, so names do not change), the
first stage keeps the embedding, the last the final norm and output head. With tied embeddings and
more than one stage, the first and last stage each hold a copy of the word embedding: both copies are
marked `shared_embedding` (their gradients are summed over the embedding group, and the norm counts
the first stage's only), and the head's copy is initialised under the embedding's name so the two
start identical.
"""

from __future__ import annotations

from megazero.core.errors import UsageError
from megazero.models.param_info import set_param_info

EMBEDDING_WEIGHT = "embedding.word.weight"


def stage_layer_ranges(
    num_layers: int, pp: int, virtual_stages: int = 1, layer_split: list[int] | None = None
) -> list[range]:
    """Layer ranges of the pp x virtual_stages model chunks in pipeline order: chunk c = v * pp + p
    runs on stage p as its v-th virtual stage (Megatron's interleaved assignment)."""
    chunks = pp * virtual_stages
    if layer_split is None:
        if num_layers % chunks:
            raise UsageError(
                f"--num-layers {num_layers} is not divisible by pipeline-parallel size {pp} "
                f"x virtual stages {virtual_stages}; change the layer count or pass "
                f"--pipeline-layer-split with {chunks} counts"
            )
        layer_split = [num_layers // chunks] * chunks
    if len(layer_split) != chunks or sum(layer_split) != num_layers or min(layer_split) < 1:
        raise UsageError(
            f"--pipeline-layer-split {layer_split} must have {chunks} positive counts "
            f"summing to --num-layers {num_layers}"
        )
    ranges, start = [], 0
    for count in layer_split:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def split_for_stage(model, layers: range, first: bool, last: bool):
    """Deletes from `model` (in place) everything this stage does not run; returns it."""
    for key in list(model.layers.keys()):
        if int(key) not in layers:
            del model.layers[key]
    tied = model.config.tie_embeddings
    if not first:
        model.embedding = None
    if not last:
        model.final_norm = None
        model.output_head = None
    if tied and not (first and last):
        if first:
            set_param_info(model.embedding.word.weight, shared_embedding=True)
        if last:
            weight = model.output_head.weight
            set_param_info(weight, shared_embedding=True, init_name=EMBEDDING_WEIGHT)
    return model
