"""The mixture-of-experts settings' checks (the fields live in GPTConfig, named as Megatron-LM's
--num-experts and --moe-* flags; models/moe.py is the layer). Each bad combination is one ValueError
naming the flags and the fix; the edge (megazero.config) turns it into the run's one line.
"""

from __future__ import annotations

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = (None, "fp32", "fp64")


def moe_layer_pattern(freq, num_layers: int) -> list[int]:
    """Which layers are MoE (1) or dense (0), from --moe-layer-freq: an int N makes every N-th layer
    MoE starting with layer 0 (Megatron-LM's rule), a list gives one 0/1 per layer."""
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(
                f"--moe-layer-freq {freq} must be >= 1 (every N-th layer is MoE) or a list of 0/1, one per layer"
            )
        return [int(i % freq == 0) for i in range(num_layers)]
    pattern = [int(v) for v in freq]
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ValueError(
            f"--moe-layer-freq {list(freq)} must list one 0 (dense) or 1 (MoE) per layer: {num_layers} entries"
        )
    return pattern


def validate_moe(cfg) -> None:
    """Checks the MoE fields of GPTConfig `cfg` (nothing to check for a dense model)."""
    if cfg.num_experts < 0:
        raise ValueError(f"--num-experts must be >= 1 (or 0 for a dense model), got {cfg.num_experts}")
    if cfg.num_experts == 0:
        return
    e, k = cfg.num_experts, cfg.moe_router_topk
    if not 1 <= k <= e:
        raise ValueError(f"--moe-router-topk {k} must be between 1 and --num-experts {e}")
    if cfg.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
        raise ValueError(
            f"--moe-router-load-balancing-type {cfg.moe_router_load_balancing_type!r}: "
            f"choose one of {', '.join(LOAD_BALANCING_TYPES)}"
        )
    if cfg.moe_router_score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"--moe-router-score-function {cfg.moe_router_score_function!r}: choose softmax or sigmoid")
    if cfg.moe_router_pre_softmax and cfg.moe_router_score_function != "softmax":
        raise ValueError(
            "--moe-router-pre-softmax applies the softmax before the top-k: it needs "
            "--moe-router-score-function softmax"
        )
    if cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function != "sigmoid":
        raise ValueError(
            "--moe-router-enable-expert-bias is DeepSeek-V3's aux-loss-free balancing of "
            "sigmoid scores: add --moe-router-score-function sigmoid"
        )
    if cfg.moe_router_dtype not in ROUTER_DTYPES:
        raise ValueError(f"--moe-router-dtype {cfg.moe_router_dtype!r}: choose fp32 or fp64")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    factor = cfg.moe_router_topk_scaling_factor
    if factor is not None and factor <= 0:
        raise ValueError(f"--moe-router-topk-scaling-factor must be > 0, got {factor}")
    capacity = cfg.moe_expert_capacity_factor
    if capacity is not None and capacity <= 0:
        raise ValueError(f"--moe-expert-capacity-factor must be > 0, got {capacity}")
    if cfg.moe_pad_expert_input_to_capacity and capacity is None:
        raise ValueError(
            "--moe-pad-expert-input-to-capacity pads to a capacity: it needs "
            "--moe-expert-capacity-factor (dropless routing has none)"
        )
    if cfg.moe_token_drop_policy not in DROP_POLICIES:
        raise ValueError(f"--moe-token-drop-policy {cfg.moe_token_drop_policy!r}: choose probs or position")
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.moe_shared_expert_gate and not cfg.moe_shared_expert_intermediate_size:
        raise ValueError(
            "--moe-shared-expert-gate scales the shared expert's output: it needs "
            "--moe-shared-expert-intermediate-size N"
        )
    moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)
