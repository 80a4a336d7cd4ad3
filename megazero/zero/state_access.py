"""Reading and editing ZeRO-partitioned state by parameter, in DeepSpeed's API shape.

    safe_get_full_fp32_param / safe_get_full_grad / safe_get_full_optimizer_state(param, key)
    safe_set_full_fp32_param / safe_set_full_grad / safe_set_full_optimizer_state(param, value, key)
    safe_get_local_* / safe_set_local_*: this rank's piece only (1-D), no communication

The full variants are collective over the parameter's shard group: every rank of it must call them
in the same order. "Full" means whole across data parallelism: a tensor-parallel parameter stays
this rank's TP shard. Optimizer state keys are "exp_avg" and "exp_avg_sq".

Lifetimes: fp32 params and optimizer states are valid at any time outside a step; gradients only
between the backward of a step's last microbatch and the optimizer step (afterwards they are zeroed).
Setters write the fp32 master (and the 16-bit copy the model computes with) or the named state.
"""

from __future__ import annotations

import torch
from torch import nn
from megazero.models.param_info import param_info

OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")


def _storage(param: nn.Parameter):
    storage = param_info(param).zero_storage
    if storage is None:
        raise ValueError("this parameter is not managed by a ZeroEngine")
    return storage


def _check_key(key: str) -> str:
    if key not in OPTIMIZER_KEYS:
        raise ValueError(f"unknown optimizer state {key!r}; use one of {OPTIMIZER_KEYS}")
    return key


def _grads_ready(param: nn.Parameter) -> None:
    engine = param_info(param).zero_engine()
    if not engine.has_grads:
        raise RuntimeError("gradients are only available between backward and the optimizer step")
    engine.finish_gradients()


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor:
    return _storage(param).gathered(param, "fp32")


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor:
    _grads_ready(param)
    return _storage(param).gathered(param, "grad")


def safe_get_full_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor:
    return _storage(param).gathered(param, _check_key(key))


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    _storage(param).write_full(param, "fp32", value)


def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    _grads_ready(param)
    _storage(param).write_full(param, "grad", value)


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, key: str) -> None:
    _storage(param).write_full(param, _check_key(key), value)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor:
    return _storage(param).local_view(param, "fp32").float().clone()


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor:
    _grads_ready(param)
    return _storage(param).local_view(param, "grad").float().clone()


def safe_get_local_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor:
    return _storage(param).local_view(param, _check_key(key)).clone()


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    _set_local(param, "fp32", value)


def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    _grads_ready(param)
    _set_local(param, "grad", value)


def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, key: str) -> None:
    _set_local(param, _check_key(key), value)


def _set_local(param: nn.Parameter, kind: str, value: torch.Tensor) -> None:
    view = _storage(param).local_view(param, kind)
    if value.numel() != view.numel():
        raise ValueError(f"local {kind} piece has {view.numel()} elements, got {value.numel()}")
    view.copy_(value.reshape(-1))
    if kind == "fp32":
        _storage(param).refresh_low_precision(param)
