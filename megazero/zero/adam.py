"""Adam / AdamW on flat fp32 partitions: the optimizer math every ZeRO stage shares.

Two implementations of one update, both in place:

- `adam_update_reference`: torch ops in torch.optim.AdamW's exact order, so a single-process run
  matches torch's AdamW elementwise. It is the oracle for the fused kernel and the fallback.
- the fused C++ kernel in the optional extension `megazero._C` (csrc/cpu_adam.cpp): one pass over
  memory, OpenMP threads. Against the reference on torch's AVX2/AVX-512 CPU kernels, exp_avg and
  exp_avg_sq are bitwise equal and param is within a few ulps, because torch's MKL sqrt is not
  correctly rounded and the kernel's is (tests/test_cpu_adam.py states the bound).

`adam_update` (what flat_group.py and stage3_units.py call) picks the kernel when it is built,
not disabled by `MEGAZERO_DISABLE_CPP_ADAM=1`, and every tensor is a contiguous CPU tensor of a
supported dtype; otherwise the reference. This module does not decide which segments get weight
decay or how the grad scale is formed; the callers do.
"""
from __future__ import annotations

import dataclasses
import os

import torch

try:
    # Import after torch: the extension's OpenMP runtime then resolves to the libgomp torch already
    # loaded, so the process keeps one thread pool instead of two competing ones.
    from megazero import _C as _cpp
except ImportError:  # not built (no compiler at install time): the torch reference serves alone
    _cpp = None

# Must match the GradDtype enum in csrc/cpu_adam.cpp.
_GRAD_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclasses.dataclass
class AdamConfig:
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    decoupled_weight_decay: bool = True      # AdamW; False: classic Adam with L2 in the gradient


def kernel_available() -> bool:
    """True when the C++ kernel is built and not switched off with MEGAZERO_DISABLE_CPP_ADAM=1."""
    return _cpp is not None and os.environ.get("MEGAZERO_DISABLE_CPP_ADAM", "0") != "1"


def kernel_info() -> dict:
    """What the installed kernel is, for logs and benchmarks: built / enabled / ISA / OpenMP."""
    if _cpp is None:
        return {"built": False, "enabled": False}
    return {"built": True, "enabled": kernel_available(), "isa": _cpp.kernel_isa(),
            "openmp": _cpp.built_with_openmp()}


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, config: AdamConfig,
                weight_decay: float, grad_scale: float = 1.0) -> None:
    """One Adam(W) step on fp32 `param` in place; `grad` (fp32, bf16 or fp16) is multiplied by
    `grad_scale` first (loss-scale removal and clipping folded into one multiply). Uses the C++
    kernel when it can (see module docstring); results agree to a few ulps either way."""
    if kernel_available() and _kernel_accepts(param, grad, exp_avg, exp_avg_sq):
        _cpp.adam_update(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                         param.numel(), _GRAD_DTYPE_CODES[grad.dtype], int(step), float(lr),
                         float(config.beta1), float(config.beta2), float(config.eps),
                         float(weight_decay), bool(config.decoupled_weight_decay),
                         float(grad_scale), torch.get_num_threads())
        # The kernel writes through raw pointers, which autograd cannot see; bump the version
        # counters as torch's in-place ops would, so a stale saved tensor is still caught.
        torch.autograd.graph.increment_version((param, exp_avg, exp_avg_sq))
        return
    adam_update_reference(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, config=config,
                          weight_decay=weight_decay, grad_scale=grad_scale)


def _kernel_accepts(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor) -> bool:
    """The kernel sees four flat buffers of one length; anything else goes to the reference.
    So do updates autograd would record (grad mode on, a state requiring grad): its checks and
    graph then behave exactly as with torch's in-place ops."""
    states = (param, exp_avg, exp_avg_sq)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in states):
        return False
    if grad.device.type != "cpu" or grad.dtype not in _GRAD_DTYPE_CODES or not grad.is_contiguous():
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in states):
        return False
    return grad.numel() == param.numel() == exp_avg.numel() == exp_avg_sq.numel()


def adam_update_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                          exp_avg_sq: torch.Tensor, *, step: int, lr: float, config: AdamConfig,
                          weight_decay: float, grad_scale: float = 1.0, sqrt=torch.sqrt) -> None:
    """The torch reference for `adam_update`, op for op torch.optim.AdamW (or Adam with L2 when
    `config.decoupled_weight_decay` is False). It allocates temporaries the size of its input
    (the fp32 grad, the denominator); the kernel allocates none. `sqrt` is replaceable so a test
    can swap in a correctly rounded one and show it is the only difference from the kernel."""
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
    # `** 0.5` rather than math.sqrt: torch's AdamW calls pow, and the two may round differently.
    denom = sqrt(exp_avg_sq).div_((1.0 - beta2 ** step) ** 0.5).add_(config.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
