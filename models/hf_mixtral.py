"""The mixture-of-experts part of the Hugging Face mapping (models/hf_adapter.py): MixtralForCausalLM.

Mixtral is Llama's attention and norms with a sparse MoE block in every layer: a router
(`mlp.gate.weight`, E x h) whose softmax over all experts, top-k, renormalised over the k, is
megazero's default softmax routing (top-k of the logits, softmax over the k: the same numbers), and
experts fused per projection (transformers 5: `mlp.experts.gate_up_proj` (E, 2f, h) computing
[gate | up], `mlp.experts.down_proj` (E, h, f)), which are megazero's weight1 (E, h, 2f) and weight2
(E, f, h) transposed per expert. Exported exactly only when megazero's model has nothing Mixtral
lacks: every layer MoE, no shared expert, plain softmax routing (no pre-softmax, scaling factor or
expert bias), dropless, no linear biases.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

import torch

from .config import GPTConfig


def mixtral_problems(config: GPTConfig) -> list[str]:
    """Why `config`'s MoE cannot be written as MixtralForCausalLM exactly (empty when it can)."""
    target = "MixtralForCausalLM"
    checks = [
        (config.num_experts > 0, f"a dense model (no --num-experts): {target}'s layers are mixtures of experts"),
        (
            all(config.is_moe_layer(i) for i in range(config.num_layers)) if config.num_experts else True,
            f"--moe-layer-freq {config.moe_layer_freq}: every {target} layer is a mixture of experts",
        ),
        (
            not config.moe_shared_expert_intermediate_size,
            f"--moe-shared-expert-intermediate-size: {target} has no shared expert",
        ),
        (
            config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax,
            f"--moe-router-score-function {config.moe_router_score_function}"
            + (" with --moe-router-pre-softmax" if config.moe_router_pre_softmax else "")
            + f": {target} renormalises the top-k of a softmax",
        ),
        (
            config.moe_router_topk_scaling_factor is None,
            f"--moe-router-topk-scaling-factor: {target} does not scale its top-k probabilities",
        ),
        (not config.moe_router_enable_expert_bias, f"--moe-router-enable-expert-bias: {target} has no expert bias"),
        (config.moe_expert_capacity_factor is None, f"--moe-expert-capacity-factor: {target} is dropless"),
        (not config.add_bias_linear, f"linear biases (no --disable-bias-linear): {target} has none"),
    ]
    return [message for ok, message in checks if not ok]


def mixtral_config_fields(config: GPTConfig) -> dict:
    """config.json's Mixtral keys beyond Llama's."""
    return {
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.moe_router_topk,
        "intermediate_size": config.moe_ffn_hidden_size,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def mixtral_hf_problems(hf: dict) -> list[str]:
    """What of a Mixtral config.json megazero cannot match exactly."""
    problems = []
    if hf.get("router_jitter_noise", 0.0):
        problems.append(
            f"config.json: router_jitter_noise={hf['router_jitter_noise']} is not supported; "
            f"megazero's router has no jitter"
        )
    if hf.get("sliding_window") is not None:
        problems.append(
            f"config.json: sliding_window={hf['sliding_window']} is not supported; megazero's attention is full causal"
        )
    return problems


def moe_fields_from_hf(hf: dict) -> dict:
    """GPTConfig's MoE fields from a Mixtral config.json (checked by mixtral_hf_problems)."""
    ffn = hf.get("intermediate_size", 14336)
    return {
        "num_experts": hf.get("num_local_experts", 8),
        "moe_router_topk": hf.get("num_experts_per_tok", 2),
        "moe_ffn_hidden_size": ffn,
        "moe_aux_loss_coeff": hf.get("router_aux_loss_coef", 0.0),
    }


def mixtral_mlp_entries(i: int) -> list[tuple]:
    """The MoE block's parameters of layer i: (ours, theirs, split, join) as hf_adapter's Entry."""
    ours, theirs = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
    per_expert_t = (lambda t: (t.transpose(1, 2).contiguous(),), lambda ts: ts[0].transpose(1, 2).contiguous())
    return [
        (f"{ours}router.weight", (f"{theirs}gate.weight",), lambda t: (t,), lambda ts: ts[0]),
        (f"{ours}experts.weight1", (f"{theirs}experts.gate_up_proj",), *per_expert_t),
        (f"{ours}experts.weight2", (f"{theirs}experts.down_proj",), *per_expert_t),
    ]


class MoEFormat(NamedTuple):
    """A mixture-of-experts format's part of the mapping, as models/hf_adapter.py calls it."""

    problems: Callable  # GPTConfig -> why the format cannot express it (messages)
    config_fields: Callable  # GPTConfig -> config.json's keys beyond Llama's
    fields_from_hf: Callable  # config.json -> GPTConfig's MoE fields
    hf_problems: Callable  # config.json -> what of it megazero cannot match (messages)
    mlp_entries: Callable  # layer index -> the sparse layer's (ours, theirs, split, join)


MIXTRAL = MoEFormat(
    mixtral_problems, mixtral_config_fields, moe_fields_from_hf, mixtral_hf_problems, mixtral_mlp_entries
)


# Experts saved one by one (the hub's Mixtral and Qwen2-MoE files, transformers 4): layer, expert,
# projection. Mixtral's w1 is the gate, w3 the up and w2 the down projection.
_PER_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
_PROJECTION = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with experts saved one by one fused as transformers 5 keeps them:
    mlp.experts.gate_up_proj (E, 2f, h), each expert's [gate; up] rows, and mlp.experts.down_proj
    (E, h, f); Mixtral's `block_sparse_moe.` prefix becomes `mlp.`. Fused files pass unchanged."""
    pieces: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, tensor in state.items():
        found = _PER_EXPERT.fullmatch(name)
        if found is None:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        layer, expert, kind = int(found[1]), int(found[2]), found[3]
        pieces.setdefault(layer, {}).setdefault(expert, {})[_PROJECTION.get(kind, kind)] = tensor
    for layer, experts in pieces.items():
        ordered = [experts[e] for e in sorted(experts)]
        lacking = [(e, k) for e in sorted(experts) for k in _PROJECTION.values() if k not in experts[e]]
        if lacking:
            raise ValueError(
                f"model.safetensors: layer {layer}'s expert {lacking[0][0]} has no {lacking[0][1]} "
                f"weight; the files are incomplete"
            )
        prefix = f"model.layers.{layer}.mlp.experts."
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"], p["up_proj"]]) for p in ordered])
        out[prefix + "down_proj"] = torch.stack([p["down_proj"] for p in ordered])
    return out
