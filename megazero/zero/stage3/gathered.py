"""Working with whole parameters outside training: `GatheredParameters` and external parameters.

    with GatheredParameters([model.fc.weight], modifier_rank=0):
        if dp_rank == 0:
            model.fc.weight.data.fill_(1.0)      # edits every rank sees after the block

Entering gathers the given parameters (a no-op for parameters that are never partitioned); leaving
releases what it gathered. With `modifier_rank` (an index in the data-parallel group), that rank's
values are broadcast on exit and written into every rank's fp32 master and 16-bit copies, so an edit
survives the next optimizer step. Collective over the data-parallel group: every rank enters.

`register_external_parameter(module, param)` declares that `module` uses `param` although another
module owns it, so stage 3 gathers it around `module` too (shared registration, as with a tied output
head, is detected without it).
"""
from __future__ import annotations

from torch import nn

from megazero.core import comm
from .units import ParamStatus
from megazero.models.param_info import param_info


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
            if info.zero_unit is not None and info.zero_unit.status is ParamStatus.NOT_AVAILABLE:
                info.zero_storage.start_gather(info.zero_unit)
                self._gathered.append((info.zero_storage, info.zero_unit))
        for storage, unit in self._gathered:
            storage.wait_gather(unit)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        if self.modifier_rank is not None and exc[0] is None:
            for p in self.params:
                info = param_info(p)
                comm.broadcast(p.data, self.modifier_rank, info.zero_engine().groups.dp)
                info.zero_storage.write_full(p, "fp32", p.data.float())
        for storage, unit in self._gathered:
            storage.release(unit)
        self._gathered = []
        return False


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Gather `param` around `module`'s forward and backward too (stage 3; a no-op otherwise)."""
    info = param_info(param)
    if info.zero_unit is not None:
        info.zero_engine().gather.register_external(module, info.zero_unit)
