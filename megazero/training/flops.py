"""Model FLOPs of a GPT training step, counted as Megatron-LM counts them, the FLOPs activation
recomputation adds on top (for hardware-FLOP utilisation), and the device peaks MFU is measured against.

Per token and layer the forward pass does one multiply-add (2 FLOPs) per weight of the q, k, v and
output projections and the MLP, plus the two attention matmuls (QK^T and attention x V, each
seq x head_dim per head), counted at half: the attention is causal, so a causal kernel computes only
the scores at or below the diagonal (Megatron-LM's current count, `num_floating_point_operations` in
Megatron-LM's megatron/training/training.py, which halves the core attention term). Megatron-LM's
older count (and megazero's before) took them in full: `causal_at_half=False` gives that count, for
comparison with numbers published under it (and with what torch's math kernel executes, which masks
after the full matmul). The logit layer adds one per vocabulary row. Backward costs twice the
forward, so a step is 3x the forward: the model FLOPs MFU divides by. Recomputation runs parts of the
forward again: selective, each layer's two attention matmuls; full, the forward of every layer it
checkpoints (all of them with the uniform method, the first recompute_num_layers of each model chunk
with block). Model plus recomputed FLOPs are what the hardware executes (HFU). Embedding lookups,
norms, softmax and the optimizer are not counted (they are not matmuls).
tests/references/test_accounting_against_torch.py checks the 3x count (the full one) against torch's
FlopCounterMode over a real forward and backward; tests/training/test_flops.py the dense count against
Megatron-LM's formula. A mixture of experts differs from Megatron's: it counts the router and the
shared expert's gate, which Megatron leaves out.
"""

from __future__ import annotations

from megazero.models.config import GPTConfig

# Dense bf16 peaks (TFLOP/s) by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "V100": 125.0,
    "MI300X": 1307.0,
}


def attention_flops_per_token(cfg: GPTConfig, causal_at_half: bool = True) -> float:
    """One layer's QK^T and attention x V in the forward, per token (all heads); causal: half the
    (seq x seq) scores (False: all of them, the older count)."""
    full = 2.0 * 2 * cfg.seq_length * cfg.num_attention_heads * cfg.head_dim
    return full / 2 if causal_at_half else full


def layer_flops_per_token(cfg: GPTConfig, index: int | None = None, causal_at_half: bool = True) -> float:
    """Transformer layer `index`'s forward, per token (None: the mean over the layers). A mixture
    of experts counts its active weights: the router, the k experts a token goes to and the
    shared expert (with its gate)."""
    if index is None:
        return sum(layer_flops_per_token(cfg, i, causal_at_half) for i in range(cfg.num_layers)) / cfg.num_layers
    h, width = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.head_dim * cfg.num_query_groups
    projections = h * width + 2 * h * kv + width * h  # q, k and v, output
    per_width = (3 if cfg.activation == "swiglu" else 2) * h
    if cfg.is_moe_layer(index):
        mlp = (
            h * cfg.num_experts
            + per_width * cfg.moe_router_topk * cfg.moe_ffn_hidden_size
            + per_width * cfg.moe_shared_expert_intermediate_size
            + h * cfg.moe_shared_expert_gate
        )
    else:
        mlp = per_width * cfg.ffn_hidden_size
    return 2.0 * (projections + mlp) + attention_flops_per_token(cfg, causal_at_half)


def forward_flops_per_token(cfg: GPTConfig, causal_at_half: bool = True) -> float:
    return (
        sum(layer_flops_per_token(cfg, i, causal_at_half) for i in range(cfg.num_layers))
        + 2.0 * cfg.padded_vocab_size * cfg.hidden_size
    )


def step_flops(cfg: GPTConfig, tokens: int, causal_at_half: bool = True) -> float:
    """Model FLOPs of one training step over `tokens` tokens (the whole global batch): what MFU counts."""
    return 3 * forward_flops_per_token(cfg, causal_at_half) * tokens


def recompute_flops(cfg: GPTConfig, tokens: int, chunk_layers: list[int], causal_at_half: bool = True) -> float:
    """FLOPs recomputation adds to a step; `chunk_layers` are the layer counts of the model chunks
    (pipeline stages x virtual stages), which "block" counts its layers in."""
    if cfg.recompute_granularity == "selective":
        return cfg.num_layers * attention_flops_per_token(cfg, causal_at_half) * tokens
    if cfg.recompute_granularity != "full":
        return 0.0
    if cfg.recompute_method == "block":
        layers = sum(min(cfg.recompute_num_layers, n) for n in chunk_layers)
    else:
        layers = cfg.num_layers
    return layers * layer_flops_per_token(cfg, None, causal_at_half) * tokens  # the mean layer: MoE and dense may mix


def peak_tflops(device) -> float | None:
    """The device's dense bf16 peak, when it is a GPU we know; None otherwise (no MFU then)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)
