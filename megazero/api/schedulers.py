"""DeepSpeed's learning-rate schedulers, by their documented formulas, for megazero.initialize.

The config's `scheduler` block (WarmupLR, WarmupDecayLR, WarmupCosineLR; checked by
megazero.config.deepspeed_blocks) becomes one of these, set on the engine's optimizer
(optimizer.ZeroOptimizer): each writes the rate of every param group, the engine steps it after
every applied optimizer step (not after one skipped on overflow), as DeepSpeed's engine does.
The rate of iteration t (t = -1 before the first step, so the first step runs at the warmup's start):

    warmup (t < W):  log: gamma = ln(t + 1) / ln(W)      linear: gamma = t / W     (W at least 2)
    WarmupLR         min_lr + (max_lr - min_lr) * gamma, max_lr after the warmup
    WarmupDecayLR    ... then (max_lr - min_lr) * max(0, (T - t) / max(1, T - W)) + min_lr
    WarmupCosineLR   lr * ratio: warmup_min_ratio + (1 - warmup_min_ratio) * gamma during the warmup,
                     then cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * min(1, (t - W + 1) /
                     max(1, T - W)))) / 2

Owns only the arithmetic and the scheduler state (state_dict: the iteration).
"""

from __future__ import annotations

import math

from megazero.core.errors import UsageError


class _Schedule:
    """A DeepSpeed-style scheduler: `step()` moves to the next iteration and writes each group's lr."""

    def __init__(
        self, optimizer, warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1
    ):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise UsageError(f"scheduler warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self._last_lr = self._write(self.get_lr())

    def warmup_gamma(self) -> float:
        t = self.last_batch_iteration
        if self.warmup_type == "linear":
            return t / self.warmup_num_steps
        return math.log(t + 1) / math.log(self.warmup_num_steps)

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._last_lr = self._write(self.get_lr())

    def _write(self, lrs: list[float]) -> list[float]:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        return list(lrs)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._last_lr = self._write(self.get_lr())


class WarmupLR(_Schedule):
    def __init__(
        self,
        optimizer,
        warmup_min_lr=0.0,
        warmup_max_lr=None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        groups = optimizer.param_groups
        self.min_lrs = _per_group(warmup_min_lr, groups)
        self.max_lrs = [g["lr"] for g in groups] if warmup_max_lr is None else _per_group(warmup_max_lr, groups)
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self) -> float:
        return self.warmup_gamma() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self.gamma()
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_lr=0.0,
        warmup_max_lr=0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_gamma()
        return max(
            0.0,
            (self.total_num_steps - self.last_batch_iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps),
        )


class WarmupCosineLR(_Schedule):
    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps, self.warmup_min_ratio, self.cos_min_ratio = (
            total_num_steps,
            warmup_min_ratio,
            cos_min_ratio,
        )
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def ratio(self) -> float:
        t, warmup = self.last_batch_iteration, self.warmup_num_steps
        if t < 0:
            return 0.0
        if t < warmup:
            return self.warmup_min_ratio + self.warmup_gamma() * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (t - warmup + 1) / max(1, self.total_num_steps - warmup))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.ratio()
        return [lr * ratio for lr in self.base_lrs]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def scheduler_from_config(block: dict | None, optimizer):
    """The config's scheduler block (already checked) on `optimizer`; None without a block."""
    if block is None:
        return None
    return SCHEDULERS[block["type"]](optimizer, **{k: v for k, v in block.get("params", {}).items() if v != "auto"})


def _per_group(value, groups) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise UsageError(f"scheduler: {len(value)} values for {len(groups)} param groups")
        return [float(v) for v in value]
    return [float(value)] * len(groups)
