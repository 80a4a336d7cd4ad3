"""The mixture-of-experts bookkeeping of a training step: the factor each MoE layer's balancing
losses enter the backward with, their values and the experts' loads gathered per step, summed over
the layout so that what is logged (and DeepSeek-V3's expert-bias update) does not depend on it.

Each MoE layer's `stats` dict collects, over the step's microbatches on this rank: "load" (tokens
routed to each expert, before drops), "aux" and "z" (each microbatch's loss value), "dropped"
(choices over capacity). Loads are sums over the tokens a rank routed: under sequence parallelism a
TP rank routes its sequence shard, under context parallelism a CP rank its chunks, so the sums run
over dp x cp (and tp under sequence parallelism). The loss values are the same on every rank that
shares the microbatch's tokens (their statistics were summed across those ranks), so they are
averaged over the microbatches of the global batch.
"""

from __future__ import annotations

import torch

from megazero.core import comm, host_read
from megazero.models.moe import MoELayer


def moe_layers(chunks) -> list[tuple[str, MoELayer]]:
    return [
        (name, layer.mlp) for chunk in chunks for name, layer in chunk.layers.items() if isinstance(layer.mlp, MoELayer)
    ]


def begin_moe_step(chunks, microbatches: int, dp: int, loss_scale: float) -> None:
    """Each layer's balancing losses enter the backward as the mean over the global batch's
    microbatches (times fp16's loss scale, which the backward's gradients carry)."""
    for _, layer in moe_layers(chunks):
        layer.aux_loss_weight = loss_scale / (microbatches * dp)
        layer.stats = {}


def end_moe_step(chunks, groups, config, microbatches: int, sequence_parallel: bool, device) -> dict:
    """The step's MoE record, the same on every rank: "aux" and "z" (summed over the MoE layers,
    each the mean over the global batch's microbatches), "dropped" (choices over capacity in the
    global batch) and "load": per MoE layer (by global index) the max and mean tokens per expert.
    Updates the expert biases from the global loads."""
    moe_indices = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    e = config.num_experts
    sp = sequence_parallel and groups.topology.tp > 1
    # loads (every MoE layer of the model, zeros for another stage's) then aux, z, dropped
    flat = torch.zeros(len(moe_indices) * e + 3, dtype=torch.float64, device=device)
    mine = moe_layers(chunks)
    for name, layer in mine:
        stats = layer.stats or {}
        at = moe_indices.index(int(name)) * e
        if isinstance(stats.get("load"), torch.Tensor):
            flat[at : at + e] = stats["load"].double()
        for i, key in enumerate(("aux", "z", "dropped"), start=len(flat) - 3):
            if isinstance(stats.get(key), torch.Tensor):
                flat[i] += stats[key].double()
        layer.stats = None
    comm.all_reduce(flat, groups.dp)
    if sp:
        comm.all_reduce(flat, groups.tp)
    comm.all_reduce(flat, groups.pp)
    # the cp ranks (and the tp ranks under sequence parallelism) summed the same loss values and
    # dropped counts; their loads were counts of different tokens
    sharers = groups.topology.cp * (groups.topology.tp if sp else 1)
    aux, z, dropped = host_read.read(flat[-3:] / sharers, "moe statistics")
    total_microbatches = microbatches * groups.topology.dp
    loads = flat[:-3].view(len(moe_indices), e)
    for name, layer in mine:
        if layer.router.use_bias:
            layer.router.update_expert_bias(loads[moe_indices.index(int(name))].float())
    return {
        "aux": aux / total_microbatches,
        "z": z / total_microbatches,
        "dropped": dropped,
        "load": {
            i: (max(row), sum(row) / len(row)) for i, row in zip(moe_indices, host_read.read(loads, "moe expert loads"))
        },
    }


def collapse_line(record: dict, config, iteration: int, said: set) -> str | None:
    """The line, once per layer and run, saying that MoE layers routed every token of the step to one
    expert while nothing balances them (no aux loss: Megatron's default coefficient 0, and no expert
    bias): the other experts then get no gradient and the router has no reason to change. From the
    step's loads (`end_moe_step`'s record): a layer's largest load equals its tokens (choices / top-k)."""
    balanced = (
        config.moe_aux_loss_coeff > 0
        and config.moe_router_load_balancing_type != "none"
        or config.moe_router_enable_expert_bias
    )
    e, k = config.num_experts, config.moe_router_topk
    if balanced or e <= k:  # every expert takes every token: nothing to balance
        return None
    collapsed = [i for i, (most, mean) in record["load"].items() if i not in said and mean > 0 and most >= mean * e / k]
    if not collapsed:
        return None
    said.update(collapsed)
    return (
        f"iteration {iteration}: MoE layer{'s' if len(collapsed) > 1 else ''} "
        f"{', '.join(map(str, collapsed))} routed every token to one expert, and no balancing acts "
        f"(--moe-aux-loss-coeff {config.moe_aux_loss_coeff:g}, no expert bias): the other experts get no "
        f"gradient; set --moe-aux-loss-coeff (e.g. 1e-2) with --moe-router-load-balancing-type aux_loss, "
        f"or --moe-router-enable-expert-bias with --moe-router-score-function sigmoid"
    )
