"""The memory planner's mixture-of-experts terms (megazero/config/memory_estimate.py counts the dense
model): per pipeline stage, what an MoE layer holds beyond a dense layer, split into the parameters
sharded as the dense ones (router, shared expert, norms, attention) and this rank's experts (1/ep of
them, split over TP), whose ZeRO states shard over the expert-data-parallel ranks (dp x cp / ep);
what it saves for the backward beyond a dense layer (the rows routed to the experts, their
intermediates, the placed outputs, the shared expert's; capacity padding through routed_rows); and
the dispatch buffers it holds while it runs (all-to-all send and receive rows, all-gather's
gathered rows and scatter buffer). Assumes balanced routing: a rank whose experts get more rows
holds more. bench/plan_memory_table.py measures three MoE layouts' peaks against the plan."""

from __future__ import annotations

import dataclasses
import math

import torch


def _layer(model_cfg, moe: bool):
    from megazero.models.gpt import TransformerLayer

    cfg = (
        dataclasses.replace(model_cfg, num_layers=1, moe_layer_freq=1)
        if moe
        else dataclasses.replace(model_cfg, num_layers=1, num_experts=0, moe_layer_freq=1)
    )
    with torch.device("meta"):  # shapes only
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
        _layer(model_cfg, False).mlp
    )


def stage_moe_layers(model_cfg, layers: range) -> int:
    return sum(model_cfg.is_moe_layer(i) for i in layers) if model_cfg.num_experts else 0


def routed_rows(model_cfg, tokens: int, micro: int) -> int:
    """Rows the experts compute per microbatch on a rank: a choice per token and top-k slot, assumed
    balanced over the expert-parallel ranks (each receives as many as it sends); with a capacity,
    at most every sequence's capacity per expert, exactly that when padded to it."""
    k, e = model_cfg.moe_router_topk, model_cfg.num_experts
    rows = tokens * k
    factor = model_cfg.moe_expert_capacity_factor
    if factor is not None:
        s = tokens // max(micro, 1)
        capacity = micro * e * min(math.ceil(s * k * factor / e), s * k)
        rows = capacity if model_cfg.moe_pad_expert_input_to_capacity else min(rows, capacity)
    return rows


def moe_layer_activation_extra(model_cfg, tokens: int, micro: int, tp: int, weight_bytes: int, ep: int) -> float:
    """What one MoE layer saves for its backward beyond the dense layer memory_estimate counts (whose
    MLP intermediates are Korthikanti's two of 4h per token; the MLP's input and dropout mask stay).
    Per routed row (routed_rows, whole on every TP rank: the experts split their width): the row
    gathered for the experts, the experts' intermediates (GELU: the first product and its activation;
    SwiGLU: the [gate | up] product, silu(gate) and their product) split over TP, the experts' output
    and its placed copy that the probabilities multiply; with expert parallelism one more row, the
    outputs come back from the other ranks into a buffer of their own. Per token: the fp32 router
    logits and full scores (E each), the shared expert's intermediates (and its gated output)."""
    m, h = model_cfg, model_cfg.hidden_size
    rows = routed_rows(m, tokens, micro)
    per_width = 4 if m.activation == "swiglu" else 2
    row_tensors = 3 + (1 if ep > 1 else 0)
    experts = rows * (row_tensors * h + per_width * m.moe_ffn_hidden_size / tp) * weight_bytes
    router = tokens * m.num_experts * 4 * 2 + rows * (4 + 3 * 8)  # fp32 scores; probs, int64 slots, indices
    shared = (
        tokens
        * (per_width * m.moe_shared_expert_intermediate_size / tp + (h if m.moe_shared_expert_gate else 0))
        * weight_bytes
    )
    dense_mlp = 2 * 4 * h * tokens * weight_bytes / tp
    return experts + router + shared - dense_mlp


def moe_dispatch_bytes(
    model_cfg, tokens: int, micro: int, tp: int, weight_bytes: int, ep: int, dispatcher: str, gloo: bool = False
) -> float:
    """The dispatch buffers a MoE layer holds while it runs, beyond what it saves (routed_rows'
    balance), less what the layer saves after its experts (the placed outputs the probabilities
    multiply, the shared expert's tensors: not yet held when the dispatch runs in the forward, freed
    before it runs in the backward). The buffers: the token copy the rows are gathered from and,
    with expert parallelism, the rows sent with those received (alltoall), or the rows padded to the
    longest rank's, every EP rank's rows gathered, the buffer their outputs are scattered back from
    and the rows scattered back (allgather; on gloo also its copy of the gathered or the scattered
    buffer, as memory_estimate counts for ZeRO's collectives). Whole on every TP rank, as the rows
    are. May be negative (then nothing beyond the saved tensors)."""
    m, h, rows = model_cfg, model_cfg.hidden_size, routed_rows(model_cfg, tokens, micro)
    if ep == 1:
        held = tokens
    elif dispatcher == "allgather":
        held = tokens + 3 * rows + (3 if gloo else 2) * ep * rows
    else:
        held = tokens + 2 * rows
    per_width = 4 if m.activation == "swiglu" else 2
    after = rows * h + tokens * (
        per_width * m.moe_shared_expert_intermediate_size / tp + (h if m.moe_shared_expert_gate else 0)
    )
    return (held * h - after) * weight_bytes


def moe_transient_bytes(cfg, weight_bytes: int, head_bytes: float) -> float:
    """The dispatch buffers' share of a rank's peak: they run inside a MoE layer, the output layer's
    buffers (`head_bytes`, counted in the activations) only while the head runs, so the larger of
    the two counts."""
    m, par = cfg.model, cfg.parallel
    if not m.num_experts:
        return 0.0
    tokens = m.seq_length * cfg.micro_batch_size // par.context_parallel
    dispatch = moe_dispatch_bytes(
        m,
        tokens,
        cfg.micro_batch_size,
        par.tensor_parallel,
        weight_bytes,
        par.expert_parallel,
        par.moe_dispatcher,
        par.distributed_backend == "gloo",
    )
    return max(0.0, dispatch - head_bytes)
