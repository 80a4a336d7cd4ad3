"""Where a Megatron-LM run's parameters live across its pipeline stages and virtual-pipeline chunks
(megatron_files.py and megatron_optim.py ask): which global layers a model chunk holds, and which
full-model names make up a chunk's grad buffer. Must not read files nor know megazero's names.

Megatron-core's placement (transformer_layer.get_transformer_layer_offset, uniform split): with
pipeline degree P and V virtual chunks per stage (--num-layers-per-virtual-pipeline-stage), layers
are dealt in rounds: chunk v of stage p holds L = num_layers / (P V) layers starting at (v P + p) L;
the embedding sits in chunk 0 of stage 0, the final norm and the output layer in the last chunk of
the last stage. A legacy file numbers each chunk's layers from 0. The uneven splits
(--decoder-first/last-pipeline-num-layers, --pipeline-model-parallel-layout, the account-for flags)
are read where the files themselves say where each layer is (legacy files of a plain pipeline) and
refused elsewhere.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
UNEVEN = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)
_FIRST = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_LAST = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")


_COLUMN = re.compile(
    r"(word_embeddings\.weight|output_layer\.weight|linear_qkv\.(weight|bias)|linear_fc1\.(weight|bias))$"
)
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)\.")


class StagesError(ValueError):
    """A split of layers megazero cannot place; the message names the flag and the way out."""


def degrees(args: dict) -> tuple[int, int, int]:
    """(tensor, pipeline, virtual-pipeline) degrees of a Megatron-LM argument record."""
    tp = args.get("tensor_model_parallel_size") or 1
    pp = args.get("pipeline_model_parallel_size") or 1
    vp = args.get("virtual_pipeline_model_parallel_size") or 1
    if vp == 1 and args.get("num_layers_per_virtual_pipeline_stage") and pp > 1:
        vp = args["num_layers"] // (pp * args["num_layers_per_virtual_pipeline_stage"])
    return tp, pp, vp


def chunk_layers(args: dict, pp_rank: int, vp_stage: int) -> range:
    """The global layers of chunk `vp_stage` of pipeline stage `pp_rank` (uniform split only)."""
    _, pp, vp = degrees(args)
    uneven = [key for key in UNEVEN if args.get(key)]
    if uneven or args["num_layers"] % (pp * vp):
        flag = f"--{uneven[0].replace('_', '-')}" if uneven else f"{args['num_layers']} layers over {pp * vp} chunks"
        raise StagesError(
            f"{flag}: megazero places the optimizer's buffers of uniformly split pipelines only; "
            f"re-save with --dist-ckpt-optim-fully-reshardable, or pass --weights-only to import the "
            f"weights alone"
        )
    per = args["num_layers"] // (pp * vp)
    start = (vp_stage * pp + pp_rank) * per
    return range(start, start + per)


def chunk_names(names, args: dict, pp_rank: int, vp_stage: int) -> list[str]:
    """The full-model names (per-layer, global numbers) chunk (`pp_rank`, `vp_stage`) holds, in the
    order of `names`."""
    _, pp, vp = degrees(args)
    layers = chunk_layers(args, pp_rank, vp_stage)
    first, last = (pp_rank, vp_stage) == (0, 0), (pp_rank, vp_stage) == (pp - 1, vp - 1)
    out = []
    for name in names:
        match = _LAYER.match(name)
        if (match and int(match.group(1)) in layers) or (first and name in _FIRST) or (last and name in _LAST):
            out.append(name)
    return out


def shared_embedding(args: dict, pp_rank: int, vp_stage: int, pp: int, vp: int) -> set[str]:
    """The tied embedding's copy chunk (`pp_rank`, `vp_stage`) of `pp` stages of `vp` chunks keeps in a
    bucket of its own (a tied head split across stages: the first chunk's word embeddings, the last
    chunk's output layer)."""
    if args.get("untie_embeddings_and_output_weights", False) or pp == 1:
        return set()
    if (pp_rank, vp_stage) == (0, 0):
        return {"embedding.word_embeddings.weight"}
    return {"output_layer.weight"} if (pp_rank, vp_stage) == (pp - 1, vp - 1) else set()


def renumbered(model: dict, offset: int) -> dict:
    """A legacy chunk's tensors with its local layer numbers moved to global ones."""
    out = {}
    for name, tensor in model.items():
        match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
        out[f"decoder.layers.{offset + int(match.group(1))}.{match.group(2)}" if match else name] = tensor
    return out


def layer_count(model: dict) -> int:
    return len({int(m.group(1)) for m in map(_LAYER.match, model) if m})


def merge_tp(name: str, shards: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """One parameter's full tensor from its tensor-parallel shards (rank order)."""
    if _ROW.search(name):
        return torch.cat(shards, dim=1)
    if not _COLUMN.search(name):
        return shards[0]  # replicated: norms, row-parallel biases, positions
    if swiglu and "linear_fc1." in name:  # each rank holds [its gate rows; its up rows]
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)


def shard_shapes(name: str, full: torch.Tensor, tp: int) -> list[torch.Size]:
    """One parameter's tensor-parallel shard shapes (rank order), as merge_tp joins them."""
    if _ROW.search(name):
        return [t.shape for t in full.chunk(tp, dim=1)]
    if _COLUMN.search(name):
        return [t.shape for t in full.chunk(tp, dim=0)]
    return [full.shape] * tp


def is_expert(name: str) -> bool:
    """Whether `name` is an expert's parameter (kept by the expert-parallel optimizer, not the dense one)."""
    return _EXPERT.match(name) is not None


def global_experts(state: dict, ep_rank: int, local_experts: int) -> dict:
    """An expert-parallel rank's tensors with its local expert numbers moved to global ones (rank e
    holds experts e L .. e L + L - 1)."""
    out = {}
    for name, tensor in state.items():
        match = _EXPERT.match(name)
        if match:
            name = f"{match.group(1)}{ep_rank * local_experts + int(match.group(2))}.{name[match.end() :]}"
        out[name] = tensor
    return out


def expert_count(state: dict) -> int:
    """How many experts layer 0 of full megatron-core tensors `state` has (0 for a dense model)."""
    return len(
        {
            m.group(2)
            for m in map(_EXPERT.match, state)
            if m and m.group(1) == "decoder.layers.0.mlp.experts.local_experts."
        }
    )


def expert_index(name: str) -> int:
    """The global expert number of an expert's parameter name."""
    return int(_EXPERT.match(name).group(2))


def expert_key(name: str) -> tuple:
    """An expert parameter's place in megatron-core's registration order: layer, expert, then
    linear_fc1's weight and bias before linear_fc2's."""
    rest = name[_EXPERT.match(name).end() :]
    order = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
    return int(_LAYER.match(name).group(1)), expert_index(name), order.index(rest) if rest in order else len(order)
