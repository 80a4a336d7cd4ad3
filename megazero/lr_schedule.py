"""Learning-rate schedule: linear warmup from 0, then constant / linear / cosine / inverse-square-root
decay to min_lr at decay_iters (Megatron-LM's rules; iterations count from 1). With
`config.in_samples` the same rules count samples: the step that brings the consumed samples to N
takes the rate at N (constant batches give the iteration schedule scaled by the batch). With
`config.decoupled_lr` a step has two rates: every parameter's, and the embedding and output layer's,
which follow the same schedule between decoupled_lr and decoupled_min_lr (Megatron's param groups)."""
from __future__ import annotations

import math

from megazero.config.train_config import OptimizerConfig


def step_learning_rate(config: OptimizerConfig, iteration: int, train_iters: int, consumed_samples: int = 0):
    """The rate(s) of the step numbered `iteration` (from 1), after which `consumed_samples` samples
    are consumed: a float, or (lr, decoupled lr) with `config.decoupled_lr` (what ZeroEngine.step
    takes, lr group 1 being the embedding and output layer)."""
    at, total = (consumed_samples, 0) if config.in_samples else (iteration, train_iters)
    lr = learning_rate(config, at, total)
    if config.decoupled_lr is None:
        return lr
    low = config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr
    return lr, learning_rate(config, at, total, config.decoupled_lr, low)


def learning_rate(config: OptimizerConfig, iteration: int, train_iters: int, max_lr: float | None = None,
                  min_lr: float | None = None) -> float:
    """The rate at `iteration` (a sample count with config.in_samples) between max_lr and min_lr
    (default: config.lr and config.min_lr)."""
    max_lr = config.lr if max_lr is None else max_lr
    min_lr = config.min_lr if min_lr is None else min_lr
    warmup = config.warmup_iters
    decay_iters = config.decay_iters or train_iters
    if warmup > 0 and iteration <= warmup:
        return max_lr * iteration / warmup
    if config.decay_style == "constant":
        return max_lr
    if config.decay_style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(iteration))
    if iteration > decay_iters:
        return min_lr
    ratio = (iteration - warmup) / max(1, decay_iters - warmup)
    if config.decay_style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)
