"""Learning-rate schedule: linear warmup from 0, then constant / linear / cosine / inverse-square-root
decay to min_lr at decay_iters (Megatron-LM's rules).

Megatron's scheduler is a function of the optimizer steps already taken, n, and the step it sets
the rate for is the next one: step 1 runs at n = 0 (0 with a warmup), step warmup + 1 at the peak,
and only applied steps count (an fp16 step skipped on overflow does not advance it). Callers pass
the 1-based number of the step about to be applied; the rate is Megatron's at n = step - 1.

With `config.in_samples` (a --rampup-batch-size run) n counts the samples of the applied steps, as
Megatron's scheduler does (warmup_iters and decay_iters are then sample counts). With
`config.decoupled_lr` a step has two rates: every parameter's, and the embedding and output layer's,
which follow the same schedule between decoupled_lr and decoupled_min_lr (Megatron's param groups).
"""

from __future__ import annotations

import math

from megazero.config.train_config import OptimizerConfig


def step_learning_rate(config: OptimizerConfig, step: int, train_iters: int, done_samples: int = 0):
    """The rate(s) of the `step`-th applied optimizer step, after applied steps that consumed
    `done_samples` samples: a float, or (lr, decoupled lr) with `config.decoupled_lr` (what
    ZeroEngine.step takes, lr group 1 being the embedding and output layer)."""
    at, total = (done_samples + 1, 0) if config.in_samples else (step, train_iters)
    lr = learning_rate(config, at, total)
    if config.decoupled_lr is None:
        return lr
    low = config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr
    return lr, learning_rate(config, at, total, config.decoupled_lr, low)


def learning_rate(
    config: OptimizerConfig, step: int, train_iters: int, max_lr: float | None = None, min_lr: float | None = None
) -> float:
    """The rate of `step` between max_lr and min_lr (default: config.lr and config.min_lr)."""
    max_lr = config.lr if max_lr is None else max_lr
    min_lr = config.min_lr if min_lr is None else min_lr
    warmup = config.warmup_iters
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
