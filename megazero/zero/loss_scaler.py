"""Loss scaling for fp16 (DeepSpeed's `fp16` keys: loss_scale, initial_scale_power,
loss_scale_window, hysteresis, min_loss_scale). bf16 and fp32 use a constant scale of 1."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LossScaler:
    """Dynamic when `dynamic`: an overflow skips the step and, once `hysteresis` overflows have been
    tolerated, halves the scale (not below min_scale); `window` clean steps in a row double it."""
    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

    def __post_init__(self):
        self._tolerance = self.hysteresis
        self._clean_steps = 0

    @classmethod
    def for_fp16(cls, loss_scale: float = 0.0, initial_scale_power: int = 16, window: int = 1000,
                 hysteresis: int = 2, min_loss_scale: float = 1.0) -> "LossScaler":
        if loss_scale > 0:
            return cls(scale=loss_scale)
        return cls(scale=2.0 ** initial_scale_power, dynamic=True, window=window,
                   hysteresis=hysteresis, min_scale=min_loss_scale)

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            self._tolerance -= 1
            if self._tolerance <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self._tolerance = self.hysteresis
            return
        self._clean_steps += 1
        if self._clean_steps % self.window == 0:
            self.scale *= 2.0
            self._tolerance = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "tolerance": self._tolerance, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._tolerance, self._clean_steps = state["scale"], state["tolerance"], state["clean_steps"]
