"""Adam / AdamW on flat fp32 partitions: the optimizer math every ZeRO stage shares.

`adam_update` is the torch reference (and the test oracle for any fused kernel); it follows
torch.optim.AdamW's update order exactly, so a single-process run with it matches torch's AdamW
elementwise. It updates in place and never allocates more than one temporary the size of its input.
"""
from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass
class AdamConfig:
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    decoupled_weight_decay: bool = True      # AdamW; False: classic Adam with L2 in the gradient


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, config: AdamConfig,
                weight_decay: float, grad_scale: float = 1.0) -> None:
    """One Adam(W) step on fp32 `param` in place; `grad` (any float dtype) is multiplied by
    `grad_scale` first (loss-scale removal and clipping folded into one multiply)."""
    if grad.dtype != torch.float32 or grad_scale != 1.0:
        grad = grad.float().mul_(grad_scale) if grad.dtype != torch.float32 else grad * grad_scale
    if weight_decay != 0.0:
        if config.decoupled_weight_decay:
            param.mul_(1.0 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    beta1, beta2 = config.beta1, config.beta2
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1 ** step)
    denom = exp_avg_sq.sqrt().div_(math.sqrt(1.0 - beta2 ** step)).add_(config.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
