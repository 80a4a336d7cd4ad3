"""The Adam hyperparameters every Adam of megazero takes (the engine's, the CPU Adam's, ZenFlow's):
a plain record, apart from the kernels so that it imports without torch."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class AdamConfig:
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    decoupled_weight_decay: bool = True  # AdamW; False: classic Adam with L2 in the gradient
