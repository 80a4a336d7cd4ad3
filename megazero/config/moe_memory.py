"""The memory planner's mixture-of-experts terms (megazero/config/memory_estimate.py counts the dense
model): per pipeline stage, what an MoE layer holds beyond a dense layer, split into the parameters
sharded as the dense ones (router, shared expert, norms, attention) and this rank's experts (1/ep of
them, split over TP), whose ZeRO states shard over the expert-data-parallel ranks (dp x cp / ep)."""
from __future__ import annotations

import dataclasses

import torch


def _layer(model_cfg, moe: bool):
    from megazero.models.gpt import TransformerLayer
    cfg = dataclasses.replace(model_cfg, num_layers=1, moe_layer_freq=1) if moe else \
        dataclasses.replace(model_cfg, num_layers=1, num_experts=0, moe_layer_freq=1)
    with torch.device("meta"):      # shapes only
        return TransformerLayer(cfg, 0)


def dense_layer_config(model_cfg):
    """The config whose one-layer model is a dense layer of `model_cfg` (the planner's unit)."""
    return dataclasses.replace(model_cfg, num_experts=0, moe_layer_freq=1)


def moe_layer_extra(model_cfg) -> tuple[int, int]:
    """(dense-sharded parameters an MoE layer has beyond a dense layer (may be negative: it has no
    dense MLP), its experts' parameters), before any split."""
    if not model_cfg.num_experts:
        return 0, 0
    moe, dense = _layer(model_cfg, True), _layer(model_cfg, False)
    experts = sum(p.numel() for p in moe.mlp.experts.parameters())
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return count(moe) - experts - count(dense), experts


def moe_layer_persistent_extra(model_cfg, tp: int, threshold: int) -> int:
    """Of moe_layer_extra's dense-sharded parameters, those stage 3 keeps whole (at most `threshold`
    elements on a rank), less the dense MLP's such ones; counted before the TP split as
    memory_estimate.persistent_counts does. The router and the shared expert's gate are whole on
    every TP rank, the shared expert's 2-D weights split as a dense MLP's; experts never persist."""
    if not model_cfg.num_experts:
        return 0

    def count(mlp, whole=()) -> int:
        total = 0
        for name, p in mlp.named_parameters():
            if name.startswith("experts."):
                continue
            local = p.numel() // tp if p.dim() == 2 and not name.startswith(whole) else p.numel()
            total += p.numel() if local <= threshold else 0
        return total
    return count(_layer(model_cfg, True).mlp, ("router.", "shared_experts.gate_weight")) - count(
        _layer(model_cfg, False).mlp)


def stage_moe_layers(model_cfg, layers: range) -> int:
    return sum(model_cfg.is_moe_layer(i) for i in layers) if model_cfg.num_experts else 0
