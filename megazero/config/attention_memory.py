"""What the attention kernel a device really runs allocates beyond the layer's usual activations
(megazero/config/memory_estimate.py counts those), for the start-up memory check.

torch's SDPA picks its kernel by device, dtype, dropout and head size (models.attention.attention_kernel
asks torch itself). The flash, memory-efficient and cuDNN kernels keep O(s) per head (one log-sum-exp
per query). The math kernel, which CPU training takes whenever the attention has dropout, is written in
torch's own ops: measured with the profiler's allocator events (tests/config/test_attention_memory.py)
it keeps three (b, heads, s, s) tensors per layer for the backward (the softmax's output, the dropout
mask and the dropped probabilities, 12 bytes an element in fp32 and in 16 bits alike), and its backward
holds a fourth (their gradient) while it runs: 16 bytes an element at one layer's peak. Its forward
also builds a causal mask of s x s, once per layer (a bool and a float copy). Selective recomputation
keeps none of them between layers; the one layer being recomputed still holds them.

Asking torch's pick takes three tensors of 1 x heads x 8 x head size on the device (freed at once):
the one thing the config edge makes on a device, since the pick is torch's and lives nowhere else.
"""

from __future__ import annotations

import torch

KEPT_BYTES, PEAK_BYTES = 12, 16  # per (b, heads, s, s) element, math kernel


def kernel_for(cfg, device_type: str | None) -> str:
    """The attention kernel a training forward of `cfg`'s model runs on `device_type`."""
    from megazero.models.attention import attention_kernel

    if device_type is None or (device_type == "cuda" and not torch.cuda.is_available()):
        return "unknown"
    m, prec = cfg.model, cfg.precision
    dtype = torch.bfloat16 if prec.bf16 else torch.float16 if prec.fp16 else torch.float32
    tp = cfg.parallel.tensor_parallel
    return attention_kernel(
        device_type,
        dtype,
        max(1, m.num_attention_heads // tp),
        max(1, m.num_query_groups // tp),
        m.head_dim,
        m.attention_dropout,
        m.attention_backend,
    )


def math_kernel_bytes(micro: int, heads: float, seq: int, weight_bytes: int) -> tuple[float, float]:
    """(kept per layer for the backward, one layer's peak while it runs) of SDPA's math kernel."""
    elements = micro * heads * seq * seq
    return KEPT_BYTES * elements, max(PEAK_BYTES * elements, KEPT_BYTES * elements + (1 + weight_bytes) * seq * seq)
