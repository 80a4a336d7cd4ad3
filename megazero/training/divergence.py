"""When a run has diverged, and the stop that says so.

- `--check-for-nan-in-loss-and-grad` (on by default, as in Megatron-LM; `--no-...` turns it off): a
  step whose loss is not finite, or whose gradient norm is not finite while no fp16 dynamic loss
  scale accounts for it (an overflow is that scale's signal to back off), ends the run.
- `--max-consecutive-skipped-steps N` (default 50; 0: never): N steps in a row skipped for a
  non-finite gradient end the run, whatever precision and check. 50 is above the most an fp16 run's
  dynamic scale can skip in a row on its way down (from Megatron-LM's --initial-loss-scale 2^32 to
  the floor 1: one overflow uses up the hysteresis of 2, then one per halving, 33 in all), and small
  enough that a diverged run stops within minutes rather than at its end.
- fp16 with a static loss scale under which every gradient is zero (it underflowed) trains nothing:
  one line at the job's first step.

Reads only what every rank holds on the host after a step already (the loss and gradient norm,
reduced over the whole layout, and whether the step was skipped), so every rank decides the same at
the same iteration with no collective and no host read of its own. The stop is `Diverged`, an
AgreedStop with exit code 3; the loop logs the step and commits a pending save first, and saves
nothing of the diverged state. Must not: save, or change the step.
"""

from __future__ import annotations

import dataclasses
import math

from megazero.core.errors import AgreedStop

EXIT_DIVERGED = 3


class Diverged(AgreedStop):
    """The run diverged (the message says how it showed); every rank stops at the same iteration."""

    def __init__(self, message: str):
        super().__init__(message, code=EXIT_DIVERGED)


@dataclasses.dataclass
class DivergenceWatch:
    check_for_nan: bool = True
    max_consecutive_skipped: int = 50
    dynamic_loss_scale: bool = False  # fp16's dynamic scale: gradient overflows are its business
    static_fp16_scale: float | None = None  # fp16's static scale (the zero-gradient line), else None
    lr: float = 0.0  # the peak rate, named in the fix
    skipped_in_a_row: int = 0
    steps_seen: int = 0

    @classmethod
    def for_config(cls, cfg, dynamic_loss_scale: bool) -> "DivergenceWatch":
        static = cfg.precision.loss_scale if cfg.precision.fp16 and not dynamic_loss_scale else None
        return cls(
            cfg.run.check_for_nan, cfg.run.max_consecutive_skipped_steps, dynamic_loss_scale, static, cfg.optimizer.lr
        )

    def after_step(
        self, iteration: int, loss: float, grad_norm: float, skipped: bool
    ) -> tuple[tuple[str, str] | None, str | None]:
        """After step `iteration`: ((what showed the divergence, the fix) when the run stops now, else
        None; a warning line, or None)."""
        self.steps_seen += 1
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        lower = f"lower --lr (now {self.lr:g}) or lengthen the warmup and resume from it"
        check = "(--check-for-nan-in-loss-and-grad, on by default as in Megatron-LM)"
        skip = "or pass --no-check-for-nan-in-loss-and-grad to skip such steps"
        if self.check_for_nan and not math.isfinite(loss):
            return (f"iteration {iteration}: the loss is {loss} {check}", f"{lower}, {skip}"), None
        if self.check_for_nan and not math.isfinite(grad_norm) and not self.dynamic_loss_scale:
            return (f"iteration {iteration}: the gradient norm is {grad_norm} {check}", f"{lower}, {skip}"), None
        if self.max_consecutive_skipped and self.skipped_in_a_row >= self.max_consecutive_skipped:
            return (
                f"iteration {iteration}: {self.skipped_in_a_row} steps in a row were skipped for a non-finite "
                f"gradient (--max-consecutive-skipped-steps {self.max_consecutive_skipped})",
                f"{lower}, or raise --max-consecutive-skipped-steps (0: never stop)",
            ), None
        if self.steps_seen == 1 and self.static_fp16_scale is not None and grad_norm == 0.0:
            return None, (
                f"iteration {iteration}: every gradient is 0 under the static loss scale "
                f"{self.static_fp16_scale:g} (--loss-scale): the fp16 gradients underflow and nothing "
                f"trains; raise --loss-scale, or leave it out for the dynamic scale"
            )
        return None, None
