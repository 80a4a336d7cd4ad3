"""The user's module as megazero.initialize takes it: the checks before anything is built, and what
DeepSpeed lets a user say about their modules.

- `check_model`: an nn.Module, not wrapped already (by initialize, DDP or FSDP), every parameter
  on the CPU or this rank's device, or on meta only when megazero.zero.Init built it. One line each.
- `set_z3_leaf_modules(model, classes)` (DeepSpeed's, in deepspeed.utils): those modules are stage
  3 leaves, gathered whole when entered (a mixture-of-experts block whose experts see data-dependent
  tokens must be one); initialize hands them to the engine as zero_optimization.leaf_module names.
- the buffers (rotary tables and the like) move to the rank's device; the engine owns the parameters.

Owns no parameters: the engine replaces them.
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.core.errors import UsageError
from megazero.models.param_info import param_info
from megazero.zero.config import ZeroConfig
from megazero.zero.init import built_by_init

_LEAF = "_z3_leaf"  # DeepSpeed's module attribute for a leaf module


def check_model(model) -> None:
    """UsageError for a model initialize cannot take (see the module docstring)."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    wrapper = type(model).__name__
    if wrapper in ("DistributedDataParallel", "FullyShardedDataParallel") or hasattr(model, "_get_fsdp_state"):
        raise UsageError(f"model is wrapped in {wrapper}: pass the model itself; megazero's ZeRO replaces DDP and FSDP")
    by_init = built_by_init(model)
    for name, p in model.named_parameters():
        if param_info(p).zero_engine is not None:
            raise UsageError(
                f"model parameter {name!r} already belongs to a megazero engine: pass the "
                f"original model to megazero.initialize once (engine.module is that model)"
            )
        if p.is_meta and not by_init:
            raise UsageError(
                f"model parameter {name!r} is on the meta device (no values): build the model "
                f"inside `with megazero.zero.Init():` or load its weights before initialize"
            )
        if not p.is_meta and p.device.type not in ("cpu", _device_type()):
            raise UsageError(
                f"model parameter {name!r} is on {p.device}: keep the model on the CPU (or "
                f"this rank's device); megazero places the shards itself"
            )


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (not parameters) to the rank's device, where the engine puts the weights."""
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[key] = buffer.to(device)


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes) -> list[nn.Module]:
    """Marks every module of `model` whose class is in `leaf_module_classes` (classes or class
    names) as a stage-3 leaf; returns them. Call before megazero.initialize."""
    wanted = list(leaf_module_classes)
    marked = [
        m
        for m in model.modules()
        if any(type(m) is c or (isinstance(c, str) and type(m).__name__ == c) for c in wanted)
    ]
    if not marked:
        names = [c if isinstance(c, str) else c.__name__ for c in wanted]
        raise UsageError(
            f"set_z3_leaf_modules: no module of the model is a {' or '.join(names)}; name a class the model uses"
        )
    for module in marked:
        setattr(module, _LEAF, True)
    return marked


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes) -> list[nn.Module]:
    wanted = list(leaf_module_classes)
    found = [
        m
        for m in model.modules()
        if any(type(m) is c or (isinstance(c, str) and type(m).__name__ == c) for c in wanted)
    ]
    for module in found:
        if hasattr(module, _LEAF):
            delattr(module, _LEAF)
    return found


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, _LEAF, False)]


def z3_leaf_module(module: nn.Module) -> bool:
    return bool(getattr(module, _LEAF, False))


def leaf_config(model: nn.Module, zero: ZeroConfig) -> ZeroConfig:
    """`zero` with the modules set_z3_leaf_modules marked added to leaf_module.names."""
    marked = [name for name, m in model.named_modules() if getattr(m, _LEAF, False) and name]
    if not marked:
        return zero
    names = list(zero.leaf_module.names) + [n for n in marked if n not in zero.leaf_module.names]
    leaf = zero.leaf_module.replace(names=names)
    return zero.replace(leaf_module=leaf)
