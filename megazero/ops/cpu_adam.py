"""`CPUAdam`: Adam / AdamW as a torch.optim.Optimizer over CPU tensors, stepped by the fused kernel.

This module owns the optimizer wrapper only: hyperparameter checks, per-parameter state in torch's
layout, and the loop over parameter groups. The math is `megazero.ops.adam.adam_update` (the C++
kernel when built and the tensors suit it, else the torch reference), so CPUAdam agrees with
torch.optim.AdamW (`adamw_mode=True`) or torch.optim.Adam with L2 weight decay
(`adamw_mode=False`) elementwise, to the few ulps adam.py's docstring states.

State is kept exactly as torch keeps it: per parameter `step` (a float32 scalar tensor),
`exp_avg` and `exp_avg_sq`; each group carries torch's `decoupled_weight_decay` flag. So a
state_dict moves between CPUAdam and torch.optim.Adam / AdamW in either direction.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from megazero.core.errors import UsageError
from megazero.ops.adam import adam_update
from megazero.ops.adam_config import AdamConfig

# torch.optim.Adam options CPUAdam cannot honour; a state_dict that turns one on is refused.
_UNSUPPORTED_OPTIONS = ("amsgrad", "maximize", "capturable", "differentiable")


class CPUAdam(torch.optim.Optimizer):
    """Adam(W) on CPU fp32 parameters. Gradients may be fp32, bf16 or fp16 (read as fp32).

    Arguments follow DeepSpeedCPUAdam: `adamw_mode=True` decouples weight decay (AdamW), False
    adds it to the gradient (Adam with L2). The kernel uses torch.get_num_threads() threads."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
    ):
        if not lr >= 0.0:
            raise UsageError(f"CPUAdam: lr={lr} must be >= 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise UsageError(f"CPUAdam: betas={betas} must be two numbers in [0, 1)")
        if not eps >= 0.0:
            raise UsageError(f"CPUAdam: eps={eps} must be >= 0")
        if not weight_decay >= 0.0:
            raise UsageError(f"CPUAdam: weight_decay={weight_decay} must be >= 0")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decoupled_weight_decay=bool(adamw_mode)
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_group(group)
            beta1, beta2 = group["betas"]
            config = AdamConfig(
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
            )
            for param in group["params"]:
                if param.grad is not None:
                    self._step_param(param, config)
        return loss

    def _step_param(self, param: torch.Tensor, config: AdamConfig) -> None:
        _check_tensors(param, param.grad)
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        adam_update(
            param,
            param.grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            step=int(state["step"].item()),
            lr=config.lr,
            config=config,
            weight_decay=config.weight_decay,
        )

    def __setstate__(self, state: dict) -> None:
        """Groups loaded from another optimizer's state_dict get CPUAdam's default mode if they
        lack torch's `decoupled_weight_decay` key."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])


def _check_group(group: dict) -> None:
    for option in _UNSUPPORTED_OPTIONS:
        if group.get(option):
            raise UsageError(
                f"CPUAdam does not support {option}=True (from a loaded state_dict?); use torch.optim.Adam for it"
            )


def _check_tensors(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise UsageError(
            f"CPUAdam steps fp32 CPU parameters, got {param.dtype} on {param.device}; "
            f"keep an fp32 master copy on the CPU (or use torch.optim.AdamW there)"
        )
    if grad.is_sparse or grad.device.type != "cpu" or grad.shape != param.shape:
        raise UsageError(
            f"CPUAdam needs dense CPU gradients shaped like their parameter, got "
            f"{grad.layout} {tuple(grad.shape)} on {grad.device} for {tuple(param.shape)}"
        )
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UsageError(f"CPUAdam reads fp32, bf16 or fp16 gradients, got {grad.dtype}")
