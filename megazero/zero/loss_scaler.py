"""Loss scaling for fp16 (DeepSpeed's `fp16` keys: loss_scale, initial_scale_power,
loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale). bf16 and fp32 use a constant
scale of 1."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LossScaler:
    """Dynamic when `dynamic`, with DeepSpeed's rules: an overflow skips the step and uses up one unit
    of hysteresis; the overflow that finds one unit left halves the scale (not below min_scale), and so
    does every further overflow until the hysteresis is refilled. `window` clean steps in a row double
    the scale and refill the hysteresis; with `consecutive_hysteresis` every clean step refills it, so
    only `hysteresis` overflows in a row lower the scale."""

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False

    def __post_init__(self):
        self._tolerance = self.hysteresis
        self._clean_steps = 0

    @classmethod
    def from_config(cls, config) -> "LossScaler":
        """The scaler a run's PrecisionConfig asks for: fp16's static (loss_scale > 0) or dynamic one,
        else the constant scale 1 of bf16 and fp32."""
        if not config.fp16:
            return cls()
        if config.loss_scale > 0:
            return cls(scale=config.loss_scale)
        return cls(
            scale=2.0**config.initial_scale_power,
            dynamic=True,
            window=config.loss_scale_window,
            hysteresis=config.hysteresis,
            min_scale=config.min_loss_scale,
            consecutive_hysteresis=config.consecutive_hysteresis,
        )

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            if self._tolerance <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self._tolerance -= 1
            return
        self._clean_steps += 1
        if self.consecutive_hysteresis:
            self._tolerance = self.hysteresis
        if self._clean_steps % self.window == 0:
            self.scale *= 2.0
            self._tolerance = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "tolerance": self._tolerance, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._tolerance, self._clean_steps = state["scale"], state["tolerance"], state["clean_steps"]
