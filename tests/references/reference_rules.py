"""The other side of the reference tests (test_training_against_torch.py,
test_loss_scaler_against_grad_scaler.py, test_accounting_against_torch.py), written from Megatron-LM's and
torch's documented rules, not from megazero: Megatron's lr schedule and weight-decay rule, the
pure single-device GPT with its layout-independent initial weights, torch's AdamW grouped as
Megatron groups it, and the relative-gap assertions they use.
"""

from __future__ import annotations

import math

import torch

from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT, initial_value


RTOL = 1e-6


def megatron_lr(steps_done: int, *, lr: float, min_lr: float, warmup: int, decay: int, style: str) -> float:
    """Megatron-LM's OptimizerParamScheduler.get_lr (lr_warmup_init 0), in iterations: the rate of the
    step taken after `steps_done` optimizer steps. Linear warmup from 0 over `warmup` steps; then
    constant, or a decay that reaches min_lr after `decay` steps and stays there."""
    if warmup > 0 and steps_done <= warmup:
        return lr * steps_done / warmup
    if style == "constant":
        return lr
    if steps_done > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, lr * math.sqrt(max(warmup, 1) / max(steps_done, 1)))
    progress = (steps_done - warmup) / (decay - warmup)
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def megatron_decays(name: str, param: torch.Tensor) -> bool:
    """Megatron-LM's default weight-decay rule (megatron/core/optimizer `_get_param_groups`): every
    parameter but biases and 1-D ones (norm scales). The word and position embeddings are 2-D, so
    they ARE decayed (GPT-2's and nanoGPT's rule is the same by dimension)."""
    return not (name.endswith(".bias") or param.ndim == 1)


def muon_matrix_names(model: torch.nn.Module) -> set[str]:
    """The parameters Muon steps, by torch.optim.Muon's documentation and Megatron-LM's rule: the 2-D
    weights of the hidden layers, and a grouped-experts weight (one (in, out) matrix per expert); the
    embeddings and the output layer (2-D too) take AdamW, as do biases and norm scales (1-D), a MoE
    router and the shared expert's gate (a 1 x hidden vector)."""
    excluded = ("embedding.word.weight", "embedding.position.weight", "output_head.weight")
    return {
        name
        for name, p in model.named_parameters()
        if p.ndim in (2, 3) and name not in excluded and not name.endswith(("router.weight", "gate_weight"))
    }


def plain_gpt(cfg: GPTConfig, seed: int) -> GPT:
    """The pure single-device GPT of models/ with its layout-independent initial weights."""
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied embedding appears once
            p.copy_(initial_value(cfg, name, tuple(p.shape), seed))
    return model.train()


def adamw(model: torch.nn.Module, weight_decay: float, betas=(0.9, 0.999), eps=1e-8) -> torch.optim.AdamW:
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if megatron_decays(name, p) else rest).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=0.0,
        betas=betas,
        eps=eps,
    )


def relative_gap(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def without_key_bias(params: dict, cfg: GPTConfig) -> dict:
    """The parameters with the key part of each QKV bias left out. Softmax ignores a shift shared by
    a query's scores and q . (k_j + b) = q . k_j + q . b, so the key bias's exact gradient is 0: what
    it gets is rounding noise, which Adam normalises to steps of about lr whatever its size. Two
    correct implementations move it differently after their first differing bit; every other
    element follows a real gradient."""
    head = cfg.hidden_size // cfg.num_attention_heads
    per_group = cfg.num_attention_heads // cfg.num_query_groups  # query heads, then k, then v
    out = dict(params)
    for name, value in params.items():
        if name.endswith("attention.qkv.bias"):
            rows = value.reshape(cfg.num_query_groups, per_group + 2, head)
            out[name] = torch.cat([rows[:, :per_group], rows[:, per_group + 1 :]], dim=1).flatten()
    return out


def assert_same_params(actual: dict, expected: dict, what: str, rtol: float = RTOL) -> None:
    """Per tensor, ||actual - expected|| <= rtol ||expected|| (L2; pass them through without_key_bias)."""
    assert actual.keys() == expected.keys(), f"{what}: parameter names differ"
    worst = max(expected, key=lambda n: relative_gap(actual[n], expected[n]))
    gap = relative_gap(actual[worst], expected[worst])
    assert gap <= rtol, f"{what}: {worst} differs by {gap:.2e} (relative L2; bound {rtol:g})"


def assert_same_losses(actual: list, expected: list, what: str, rtol: float = RTOL) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} losses vs {len(expected)}"
    for step, (a, b) in enumerate(zip(actual, expected), 1):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {step}: {a!r} vs {b!r} ({abs(a - b) / abs(b):.2e})"
