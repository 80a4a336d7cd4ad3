"""The Qwen2-MoE part of the Hugging Face mapping (models/hf_adapter.py): Qwen2MoeForCausalLM.

Qwen2-MoE is Llama's norms and rotary attention with biases on q, k and v alone (megazero's
--add-qkv-bias; `qkv_bias` in config.json) and, in its sparse layers, Mixtral's router and fused
experts (the same tensor names, models/hf_mixtral.py) plus a shared expert, a SwiGLU MLP of
`shared_expert_intermediate_size` whose output every token adds after scaling it by
sigmoid(x . shared_expert_gate) (megazero's --moe-shared-expert-gate: gate_weight (1, h), the same
tensor). Facts the mapping honours:
- Routing: a softmax over all experts, the top-k of it, renormalised over the k when
  `norm_topk_prob` (the same numbers as megazero's default, a softmax over the k largest logits),
  kept as they are when not (megazero's --moe-router-pre-softmax).
- Which layers are sparse: layer i is unless i is in `mlp_only_layers` or (i + 1) is not a multiple
  of `decoder_sparse_step` (layer 0 is dense for a step of 2), where Megatron's --moe-layer-freq N
  makes layer 0 MoE. Exported as step 1 with the dense layers listed; imported as the list.
- Dense layers are Llama MLPs of `intermediate_size`, the experts `moe_intermediate_size` wide.
Exported exactly only when megazero's model has nothing Qwen2-MoE lacks: a gated shared expert,
softmax routing without scaling factor or expert bias, dropless, no biases beyond q, k and v.
"""

from __future__ import annotations

import torch

from .config import GPTConfig
from .hf_mixtral import MoEFormat, mixtral_mlp_entries


def qwen2_moe_problems(config: GPTConfig) -> list[str]:
    """Why `config`'s MoE cannot be written as Qwen2MoeForCausalLM exactly (empty when it can)."""
    target = "Qwen2MoeForCausalLM"
    checks = [
        (config.num_experts > 0, f"a dense model (no --num-experts): {target}'s sparse layers are mixtures of experts"),
        (
            bool(config.moe_shared_expert_intermediate_size) and config.moe_shared_expert_gate,
            f"{'--moe-shared-expert-gate missing' if config.moe_shared_expert_intermediate_size else 'no shared expert'}"
            f": every {target} MoE layer has a shared expert scaled by its sigmoid gate (add "
            f"--moe-shared-expert-intermediate-size N --moe-shared-expert-gate)",
        ),
        (
            config.moe_router_score_function == "softmax",
            f"--moe-router-score-function {config.moe_router_score_function}: {target} routes by a softmax",
        ),
        (
            config.moe_router_topk_scaling_factor is None,
            f"--moe-router-topk-scaling-factor: {target} does not scale its top-k probabilities",
        ),
        (not config.moe_router_enable_expert_bias, f"--moe-router-enable-expert-bias: {target} has no expert bias"),
        (config.moe_expert_capacity_factor is None, f"--moe-expert-capacity-factor: {target} is dropless"),
        (
            not config.add_bias_linear,
            f"linear biases (no --disable-bias-linear): {target}'s only biases are q, k and v's (--add-qkv-bias)",
        ),
    ]
    return [message for ok, message in checks if not ok]


def qwen2_moe_config_fields(config: GPTConfig) -> dict:
    """config.json's Qwen2-MoE keys beyond Llama's."""
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    return {
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.moe_router_topk,
        "moe_intermediate_size": config.moe_ffn_hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
        "norm_topk_prob": not config.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "qkv_bias": config.add_qkv_bias,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
        "output_router_logits": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_layers,
    }


def qwen2_moe_hf_problems(hf: dict) -> list[str]:
    """What of a Qwen2-MoE config.json megazero cannot match exactly."""
    problems = []
    if hf.get("use_sliding_window", False):
        problems.append("config.json: use_sliding_window=true is not supported; megazero's attention is full causal")
    if not hf.get("num_experts", 60):
        problems.append(
            "config.json: num_experts=0 (a dense Qwen2-MoE) is not supported; import-hf takes its mixtures of experts"
        )
    if not hf.get("shared_expert_intermediate_size", 5632):
        problems.append(
            "config.json: shared_expert_intermediate_size=0 is not supported; megazero's gated "
            "shared expert needs a width"
        )
    if hf.get("decoder_sparse_step", 1) < 1:
        problems.append(f"config.json: decoder_sparse_step={hf['decoder_sparse_step']} must be >= 1")
    return problems


def qwen2_moe_fields_from_hf(hf: dict) -> dict:
    """GPTConfig's MoE (and qkv bias) fields from a Qwen2-MoE config.json (checked by
    qwen2_moe_hf_problems); its defaults are transformers' Qwen2MoeConfig's."""
    layers, step = hf.get("num_hidden_layers", 24), hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    return {
        "num_experts": hf.get("num_experts", 60),
        "moe_router_topk": hf.get("num_experts_per_tok", 4),
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", 1408),
        "moe_shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 5632),
        "moe_shared_expert_gate": True,
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
        "moe_layer_freq": 1 if all(pattern) else pattern,
        "moe_aux_loss_coeff": hf.get("router_aux_loss_coef", 0.001),
        "add_qkv_bias": hf.get("qkv_bias", True),
    }


def qwen2_moe_mlp_entries(i: int) -> list[tuple]:
    """Sparse layer i's parameters as hf_adapter's Entry: Mixtral's router and experts, the shared
    expert (our fc1 emits [gate; up]) and its gate."""
    ours, theirs = f"layers.{i}.mlp.shared_experts.", f"model.layers.{i}.mlp."
    shared = f"{theirs}shared_expert."
    return mixtral_mlp_entries(i) + [
        (
            f"{ours}fc1.weight",
            (f"{shared}gate_proj.weight", f"{shared}up_proj.weight"),
            lambda t: tuple(c.contiguous() for c in t.chunk(2, dim=0)),
            lambda ts: torch.cat(ts),
        ),
        (f"{ours}fc2.weight", (f"{shared}down_proj.weight",), lambda t: (t,), lambda ts: ts[0]),
        (f"{ours}gate_weight", (f"{theirs}shared_expert_gate.weight",), lambda t: (t,), lambda ts: ts[0]),
    ]


QWEN2_MOE = MoEFormat(
    qwen2_moe_problems, qwen2_moe_config_fields, qwen2_moe_fields_from_hf, qwen2_moe_hf_problems, qwen2_moe_mlp_entries
)
