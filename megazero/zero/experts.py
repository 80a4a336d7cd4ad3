"""ZeRO over mixture-of-experts weights: their own groups, and stage 3's expert units.

Expert weights (marked `expert_parallel` by parallel.moe) are reduced, and their states sharded,
over the expert-data-parallel group (the ranks holding the same experts), not the data-parallel
group of the dense weights: the engine keeps them in storages of their own, built with
`ZeroGroups` of that group. Their squared gradient norm is summed over that group's shards, then
over the expert-parallel group (which holds the other experts), before it joins the dense one.

Stage 3: each module owning expert weights (a layer's GroupedExperts) is one unit, gathered before
its forward and its backward by a coordinator of its own over the expert-data-parallel group. Which
rows reach a rank's experts depends on the routing, which differs between ranks; the collectives
must not. The dispatchers call every rank's experts every microbatch (with no rows if none came),
so every rank gathers every expert unit in the same order; and the units' gradients are reduced
only once the microbatch's backward is over, all units in unit order, with zeros for what did not
come, so that every rank issues the same reductions in the same order whatever the routing (the
hang DeepSpeed users meet when ranks route differently).
"""
from __future__ import annotations

from torch import nn

from megazero.models.param_info import param_info
from .stage3.coordinator import GatherCoordinator
from .stage3.units import UnitStorage


def is_expert(param) -> bool:
    return param_info(param).expert_parallel


class ExpertUnits:
    """Stage 3's expert units: a UnitStorage over the expert groups and its gather coordinator."""

    def __init__(self, modules: list[nn.Module], params: list[nn.Parameter], groups, precision, device,
                 queue, zero, streams, init_fn):
        wanted = {id(p) for p in params}
        units_params, taken = [], set()
        for root in modules:
            for name, module in root.named_modules():
                mine = [p for p in module.parameters(recurse=False) if id(p) in wanted and id(p) not in taken]
                taken.update(id(p) for p in mine)
                if mine:
                    units_params.append((name, mine))
        self.storage = UnitStorage(units_params, groups, precision, device, queue,
                                   reduce_scatter=zero.reduce_scatter, streams=streams, zero=zero)
        self.replaced = self.storage.materialize(init_fn)
        self.gather = GatherCoordinator(self.storage, zero)
        self.gather.attach(modules, {old: param_info(new).zero_unit for old, new in self.replaced.items()})

    def start_backward(self) -> None:
        self.storage.start_backward()

    def add_grad(self, param: nn.Parameter) -> None:
        """Stages the gradient; the reduction waits for end_backward (see the module docstring)."""
        self.storage.add_grad(param)

    def end_backward(self) -> None:
        for unit in self.storage.units:
            if unit.grad_pending != -1:
                self.storage.reduce_grads(unit)
                self.gather.grads_done(unit)
