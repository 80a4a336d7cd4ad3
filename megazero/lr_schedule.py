"""Learning-rate schedule: linear warmup from 0, then constant / linear / cosine / inverse-square-root
decay to min_lr at decay_iters (Megatron-LM's rules).

Megatron's scheduler is a function of the optimizer steps already taken, n, and the step it sets
the rate for is the next one: step 1 runs at n = 0 (0 with a warmup), step warmup + 1 at the peak,
and only applied steps count (an fp16 step skipped on overflow does not advance it). Callers pass
the 1-based number of the step about to be applied; the rate is Megatron's at n = step - 1.
"""
from __future__ import annotations

import math

from megazero.config.train_config import OptimizerConfig


def learning_rate(config: OptimizerConfig, step: int, train_iters: int) -> float:
    max_lr, min_lr, warmup = config.lr, config.min_lr, config.warmup_iters
    decay_iters = config.decay_iters or train_iters
    done = step - 1
    if warmup > 0 and done <= warmup:
        return max_lr * done / warmup
    if config.decay_style == "constant":
        return max_lr
    if done > decay_iters:
        return min_lr
    if config.decay_style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(done, 1)))
    ratio = (done - warmup) / max(1, decay_iters - warmup)
    if config.decay_style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)
