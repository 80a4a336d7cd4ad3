"""Working with whole parameters outside training: `GatheredParameters` and external parameters.

    with GatheredParameters([model.fc.weight], modifier_rank=0):
        if dp_rank == 0:
            model.fc.weight.data.fill_(1.0)      # edits every rank sees after the block

Entering gathers the given parameters (a no-op for parameters that are never partitioned); leaving
releases what it gathered. With `modifier_rank` (an index in the data-parallel group), that rank's
values are broadcast on exit and written into every rank's fp32 master and 16-bit copies, so an edit
survives the next optimizer step. Collective over the data-parallel group: every rank enters.
Parameters built by zero.Init and not yet handed to an engine are gathered from their slices, and
re-sliced on exit from the modifier's values (without a modifier the edits are dropped, as DeepSpeed
drops them).

`register_external_parameter(module, param)` declares that `module` uses `param` although another
module owns it, so stage 3 gathers it around `module` too (shared registration, as with a tied output
head, is detected without it). Declared before the engine exists (in a module's __init__, as
DeepSpeed users do), it is kept on the parameter and applied when megazero.initialize builds it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megazero.core import comm
from .units import ParamStatus
from megazero.models.param_info import param_info, set_param_info


class GatheredParameters:
    def __init__(self, params, modifier_rank: int | None = None, enabled: bool = True):
        self.params = [params] if isinstance(params, nn.Parameter) else list(params)
        self.modifier_rank, self.enabled = modifier_rank, enabled
        self._gathered = []

    def __enter__(self):
        if not self.enabled:
            return self
        for p in self.params:
            info = param_info(p)
            if info.init_shard is not None:
                _swap(p, info.init_shard.full().to(p.dtype))
                continue
            if info.zero_unit is not None and info.zero_unit.status is ParamStatus.NOT_AVAILABLE:
                info.zero_storage.start_gather(info.zero_unit)
                self._gathered.append((info.zero_storage, info.zero_unit))
        for storage, unit in self._gathered:
            storage.wait_gather(unit)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        for p in self.params:
            shard = param_info(p).init_shard
            if shard is not None:  # built by zero.Init, no engine yet
                if self.modifier_rank is not None and exc[0] is None:
                    value = p.data.to(shard.group.device)
                    comm.broadcast(value, self.modifier_rank, shard.group)
                    shard.reslice(value)
                _swap(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        if self.modifier_rank is not None and exc[0] is None:
            for p in self.params:
                info = param_info(p)
                if info.init_shard is not None or info.zero_engine is None:
                    continue
                comm.broadcast(p.data, self.modifier_rank, info.zero_engine().groups.dp)
                info.zero_storage.write_full(p, "fp32", p.data.float())
        for storage, unit in self._gathered:
            storage.release(unit)
        self._gathered = []
        return False


def _swap(param: nn.Parameter, value: torch.Tensor) -> None:
    """Makes `param` (the same object the model holds) hold `value` on value's device: a meta
    parameter's data cannot be set to a real tensor, so the tensors are swapped whole, and the
    parameter's record (kept in its __dict__, which the swap moves) is put back."""
    info = param_info(param)
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    set_param_info(param, **{f.name: getattr(info, f.name) for f in dataclasses.fields(info)})


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Gather `param` around `module`'s forward and backward too (stage 3; a no-op otherwise)."""
    info = param_info(param)
    if info.zero_engine is None:
        if all(m is not module for m in info.external_users):
            set_param_info(param, external_users=info.external_users + (module,))
        return
    if info.zero_unit is not None:
        info.zero_engine().domain_of(info.zero_storage).gather.register_external(module, info.zero_unit)
