"""Model FLOPs of a GPT training step, counted as Megatron-LM counts them, and the device peaks MFU
is measured against.

Per token and layer the forward pass does one multiply-add (2 FLOPs) per weight of the q, k, v and
output projections and the MLP, plus the two attention matmuls (QK^T and attention x V, each
seq x head_dim per head); the logit layer adds one per vocabulary row. Backward costs twice the
forward, so a step is 3x the forward; with full activation recomputation the forward runs twice
(4x, as Megatron's older throughput counter reports it: a convention, since the recomputation
stops once it has what backward needs and the head is not recomputed; torch's FlopCounterMode
measures 3.6x on a 2-layer test model). Embedding lookups, norms, softmax and the optimizer are
not counted (they are not matmuls). tests/test_references.py checks the 3x count against
FlopCounterMode over a real forward and backward.
"""
from __future__ import annotations

from megazero.models.config import GPTConfig

# Dense bf16 peaks (TFLOP/s) by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0,
                    "V100": 125.0, "MI300X": 1307.0}


def forward_flops_per_token(cfg: GPTConfig) -> float:
    h, layers = cfg.hidden_size, cfg.num_layers
    head_dim = h // cfg.num_attention_heads
    kv = head_dim * cfg.num_query_groups
    projections = h * h + 2 * h * kv + h * h                       # q, k and v, output
    mlp = (3 if cfg.activation == "swiglu" else 2) * h * cfg.ffn_hidden_size
    attention = 2 * cfg.seq_length * h                              # QK^T and AV, all heads
    logits = cfg.padded_vocab_size * h
    return 2.0 * (layers * (projections + mlp + attention) + logits)


def step_flops(cfg: GPTConfig, tokens: int) -> float:
    """FLOPs of one training step over `tokens` tokens (the whole global batch)."""
    passes = 4 if cfg.recompute_activations else 3
    return passes * forward_flops_per_token(cfg) * tokens


def peak_tflops(device) -> float | None:
    """The device's dense bf16 peak, when it is a GPU we know; None otherwise (no MFU then)."""
    import torch
    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)
