"""Learning-rate schedule: linear warmup from 0, then constant / linear / cosine / inverse-square-root
decay to min_lr at decay_iters (Megatron-LM's rules; iterations count from 1)."""
from __future__ import annotations

import math

from megazero.config.train_config import OptimizerConfig


def learning_rate(config: OptimizerConfig, iteration: int, train_iters: int) -> float:
    max_lr, min_lr, warmup = config.lr, config.min_lr, config.warmup_iters
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
