"""Builds this rank's model chunks: the pure GPT on the meta device, then parallelism applied from
outside in a fixed order (tensor parallel swap, then the pipeline split, then torch.compile of each
layer when asked), plus the init function the ZeRO engine materialises parameters with. No parameter
memory is allocated here.
"""

from __future__ import annotations

import torch

from megazero.models.config import GPTConfig
from megazero.core import kernels
from megazero.models import gpt
from megazero.models.gpt import GPT
from megazero.parallel.context_parallel import apply_context_parallel
from megazero.parallel.moe import apply_expert_parallel
from megazero.parallel.parallelize import parallelize
from megazero.parallel.pipeline.actions import PipelineLayout
from megazero.parallel.pipeline.split import split_for_stage, stage_layer_ranges
from megazero.parallel.process_groups import ProcessGroups
from megazero.parallel.random import RNGTracker
from megazero.models.param_info import param_info

# Declared seam: the dry run takes each initial value's shape without drawing it (megazero.core.kernels).
initial_value = kernels.declare("initial value", gpt.initial_value)


def build_model_chunks(
    config: GPTConfig,
    groups: ProcessGroups,
    tracker: RNGTracker,
    *,
    sequence_parallel: bool = False,
    virtual_stages: int = 1,
    layer_split: list[int] | None = None,
    compile_backend: str | None = None,
    cp_comm_type: str = "p2p",
    moe_dispatcher: str = "alltoall",
    v_shape: bool = False,
) -> list[GPT]:
    """One GPT chunk per virtual pipeline stage owned by this rank, on the meta device; with
    `compile_backend`, each transformer layer compiled (compile_layers). Context parallelism (over
    groups.cp, `cp_comm_type`) swaps the attention cores after the tensor-parallel swap. `v_shape`:
    the two chunks of a stage sit in a V (zbv, dualpipev: parallel/pipeline/actions.py)."""
    topo = groups.topology
    ranges = stage_layer_ranges(config.num_layers, topo.pp, virtual_stages, layer_split)
    layout = PipelineLayout(topo.pp, virtual_stages, v_shape)
    chunks = []
    for v in range(virtual_stages):
        with torch.device("meta"):
            model = GPT(config)
        parallelize(model, groups.tp, tracker, sequence_parallel)
        if config.num_experts:
            apply_expert_parallel(
                model,
                tp=groups.tp,
                ep=groups.ep,
                cp=groups.cp,
                sequence_parallel=sequence_parallel,
                dispatcher=moe_dispatcher,
                whole_experts=topo.experts_fold_tp,
            )
        apply_context_parallel(model, groups.cp, cp_comm_type)
        layers = ranges[layout.virtual_stage(groups.coords.pp, v)]
        first, last = layout.is_first(groups.coords.pp, v), layout.is_last(groups.coords.pp, v)
        chunks.append(split_for_stage(model, layers, first, last))
        if compile_backend is not None:
            compile_layers(chunks[-1], compile_backend)
    return chunks


def compile_layers(model: GPT, backend: str = "inductor") -> GPT:
    """torch.compile each transformer layer in place (nn.Module.compile): the layer keeps its name,
    parameters and hooks, so ZeRO-3's gather hooks (torch.compiler.disable'd, graph breaks at the
    layer's edges) and recomputation (the checkpoint wraps the compiled layer) work unchanged. Layers
    of one shape share their compiled code: parameters are graph inputs, not constants."""
    for layer in model.layers.values():
        layer.compile(backend=backend)
    return model


def make_init_fn(config: GPTConfig, seed: int):
    """init_fn(name, param) -> this rank's (TP-local) fp32 value, generated one full tensor at a time
    from (seed, name) so every layout starts from the same weights."""

    def init(name: str, param) -> torch.Tensor:
        info = param_info(param)
        tile = info.tile_shard  # a tile of parallel.tiling: cut from its source
        if tile is not None:
            return tile.local_from_full(initial_value(config, tile.source, tile.full, seed))
        init_name = info.init_name or name
        shard = info.tp_shard
        full_shape = shard.full_shape(param.shape) if shard is not None else tuple(param.shape)
        full = initial_value(config, init_name, full_shape, seed)
        return shard.local_from_full(full) if shard is not None else full

    return init
