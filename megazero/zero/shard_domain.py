"""A shard domain: one family of the engine's parameters, and what ZeRO keeps for that family.

The engine (engine.py) holds a list of domains and runs every phase over all of them alike; no
method of it asks which family a storage or a parameter belongs to. A domain owns, for its family:
- its groups (`ZeroGroups`): where its gradients are reduced and its states partitioned;
- its storages: flat groups (stages 0-2, and stage 3's persistent parameters) and, at stage 3, a
  `UnitStorage` with the `GatherCoordinator` that gathers its units;
- its unit policy: when a stage-3 unit's gradients are reduced (`ReduceWhenComplete`,
  `ReduceAtBackwardEnd`), and through it which leaf modules it has;
- its norm chain: the groups its part of a gradient norm (any counted statistic) is summed over
  before it joins the other domains' (`summed_over_domains`);
- its offload state between steps: releasing gathered units, the partition-ready mark after a
  reload, stage 3's host cache of offloaded parameters.
It must not decide when a step runs, scale losses or own the reduction queue and streams (the
engine's, shared by every domain: `Shared`).

The first domain is the catch-all (`claims` None): the engine's own groups, every parameter no
other domain claims. Today's two instances:

    dense  = ShardDomain("dense", groups, ReduceWhenComplete(), units_label="units")
    expert = ShardDomain("expert", expert_groups, ReduceAtBackwardEnd(), claims=is_expert,
                         across=(expert_parallel,))                      # zero/experts.py

A third family is a third instance and no new branch anywhere: e.g. LoRA adapters sharded over a
group of their own, reduced as dense units are, their norm part summed over the adapters' group
and then joining the dense one on the shared model-parallel group:

    lora = ShardDomain("lora", lora_groups, ReduceWhenComplete(), claims=is_lora_adapter)

(a frozen family is the same with a claims rule for it; its parameters get no gradients, so its
units reduce nothing.)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megazero.core import comm
from megazero.core.streams import Streams
from megazero.models.param_info import param_info
from .config import ZeroConfig
from .flat_group import FlatParamGroup
from .precision import Precision, uses_weight_decay
from .stage3.coordinator import GatherCoordinator
from .stage3.leaves import on_leaf_backward
from .stage3.units import Unit, UnitStorage
from .storage import ReductionQueue
from .zero_groups import ZeroGroups


@dataclasses.dataclass
class Shared:
    """What every domain's storages share: the engine's settings, device, queue and streams."""

    zero: ZeroConfig
    precision: Precision
    device: torch.device
    queue: ReductionQueue
    streams: Streams


class ReduceWhenComplete:
    """A unit's gradients are reduced once they are all in. A leaf module's units (zero.leaf_module,
    stage3_granularity) wait for the leaf's backward to end, then reduce with zeros for what did not
    come, in unit order on every rank: which of a leaf's parameters get gradients may differ between
    ranks, the order of the reductions must not. At the end of the backward, a unit that got some
    but not all of its gradients (unused parameters) reduces what came."""

    def leaves(self, found: list[nn.Module]) -> list[nn.Module]:
        return found

    def holds(self, unit: Unit, domain: "ShardDomain") -> bool:
        return unit.index in domain.leaf_unit_indices

    def due_at_end(self, unit: Unit) -> bool:
        return unit.grad_staging is not None


class ReduceAtBackwardEnd:
    """Every unit waits for the end of the microbatch's backward; then all reduce, in unit order,
    with zeros for what did not come, so every rank issues the same reductions whatever reached it
    (expert units: see zero/experts.py). It has no leaves: a leaf only delays a unit's reduction to
    the leaf's end, and these wait for the end of the whole backward anyway."""

    def leaves(self, found: list[nn.Module]) -> list[nn.Module]:
        return []

    def holds(self, unit: Unit, domain: "ShardDomain") -> bool:
        return True

    def due_at_end(self, unit: Unit) -> bool:
        return unit.grad_pending != -1  # not reduced in this backward yet


class ShardDomain:
    def __init__(
        self, name: str, groups: ZeroGroups, policy, *, claims=None, across=(), units_label: str | None = None
    ):
        """`claims(param)`: whether a parameter is this family's (None: the catch-all, the engine's
        first domain). `across`: the groups, after the shard group, whose ranks hold the family's
        other parameters (experts: the expert-parallel group); the norm chain sums over them too.
        `units_label`: the name the optimizer placement (offload folders, the checkpoint index) gives
        the unit storage (default: "group{i}", its place among the engine's storages)."""
        self.name, self.groups, self.policy = name, groups, policy
        self.claims, self.across, self.units_label = claims, tuple(across), units_label
        self.flat_groups: list[FlatParamGroup] = []
        self.units: UnitStorage | None = None
        self.gather: GatherCoordinator | None = None
        self.leaf_units: dict[nn.Module, list[Unit]] = {}
        self.leaf_unit_indices: set[int] = set()

    def __repr__(self) -> str:
        return f"ShardDomain({self.name!r})"

    def label(self, storage, index: int) -> str:
        return self.units_label if storage is self.units and self.units_label else f"group{index}"

    # --- construction -----------------------------------------------------------------------
    def build_flat_groups(
        self, params: list[nn.Parameter], init_fn, isolated, shared: Shared
    ) -> dict[int, nn.Parameter]:
        """Flat groups of `params` (one per weight-decay and isolation kind, in that order), filled
        from init_fn; returns id(old parameter) -> its replacement."""
        zero, precision = shared.zero, shared.precision
        buckets: dict[tuple[bool, bool], list] = {}
        for p in params:
            buckets.setdefault((uses_weight_decay(p.shape), bool(isolated(p))), []).append(p)
        stage = 2 if zero.stage == 3 else zero.stage
        # parameter_alignment (stages 1-2): each parameter's view starts 16-byte aligned.
        align = 16 // precision.param_dtype.itemsize if zero.parameter_alignment and zero.stage in (1, 2) else 1
        g, replaced = self.groups, {}
        for _, olds in sorted(buckets.items()):
            group = FlatParamGroup(
                olds,
                stage=stage,
                dp=g.dp,
                shard=g.shard if stage > 0 else None,
                replica=g.replica,
                precision=precision,
                bucket_size=zero.reduce_bucket_size,
                device=shared.device,
                queue=shared.queue,
                allgather_bucket_size=zero.allgather_bucket_size,
                reduce_scatter=zero.reduce_scatter,
                streams=shared.streams,
                state_device="cpu" if zero.offloads_optimizer else None,
                param_align=align,
            )
            group.materialize(init_fn)
            replaced.update({id(old): new for old, new in zip(olds, group.params)})
            self.flat_groups.append(group)
        return replaced

    def build_units(
        self, modules, params: list[nn.Parameter], init_fn, isolated, shared: Shared, leaf_done, leaves: list[nn.Module]
    ) -> dict[int, nn.Parameter]:
        """Stage 3: a UnitStorage of `params` and its gather coordinator, hooked on `modules`. A
        claimed family builds them only when it has such parameters; the catch-all always does, so a
        run whose every parameter is persistent keeps the (empty) unit storage, its place among the
        storages and its coordinator's hooks, as it always had. `leaf_done(module)` is called when a
        leaf module's backward is over (the engine then calls `leaf_backward_done`); `leaves`: the
        model's leaf modules (stage3/leaves.py find_leaf_modules, found once by the engine: it is
        collective), which the policy keeps or drops."""
        if not params and self.claims is not None:
            return {}
        leaves = self.policy.leaves(leaves)
        units_params, leaf_of_unit = _units_of(modules, params, leaves, isolated)
        self.units = UnitStorage(
            units_params,
            self.groups,
            shared.precision,
            shared.device,
            shared.queue,
            reduce_scatter=shared.zero.reduce_scatter,
            streams=shared.streams,
            zero=shared.zero,
        )
        replaced = self.units.materialize(init_fn)
        self.gather = GatherCoordinator(self.units, shared.zero)
        self.gather.attach(
            modules,
            {old_id: param_info(new).zero_unit for old_id, new in replaced.items()},
            blocks=[m for m in leaves if not any(m is root for root in modules)],
        )
        for index, leaf in leaf_of_unit.items():
            self.leaf_units.setdefault(leaf, []).append(self.units.units[index])
        self.leaf_unit_indices = set(leaf_of_unit)
        on_leaf_backward(self.leaf_units, leaf_done)
        return replaced

    # --- stage 3's unit gradients -------------------------------------------------------------
    def start_backward(self) -> None:
        if self.units is not None:
            self.units.start_backward()

    def on_unit_grad(self, param: nn.Parameter) -> None:
        unit = param_info(param).zero_unit
        if self.units.add_grad(param) and not self.policy.holds(unit, self):
            self._reduce(unit)

    def leaf_backward_done(self, module: nn.Module) -> None:
        """Reduces the leaf's units with the gradients that came (zeros for parameters this rank's
        data did not use), in unit order on every rank, as DeepSpeed does for its leaf modules."""
        for unit in self.leaf_units[module]:
            if unit.grad_pending != -1 or unit.grad_staging is not None:
                self._reduce(unit)

    def end_backward(self) -> None:
        for unit in self.units.units if self.units is not None else ():
            if self.policy.due_at_end(unit):
                self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        self.units.reduce_grads(unit)
        self.gather.grads_done(unit)

    # --- norm chain ---------------------------------------------------------------------------
    def norm_chain(self, stage: int, shared_model_parallel: comm.Group) -> list[comm.Group]:
        """The groups this domain's sum is all-reduced over, in order, before it joins the others:
        its shard group (stage 0 ranks hold identical all-reduced gradients; MiCS replicas hold the
        same sums), then `across`, then its own model-parallel group where that is not the shared
        one (whole experts: their groups spanned the tensor-parallel ranks already)."""
        own = self.groups.model_parallel
        return (
            ([self.groups.shard] if stage > 0 else [])
            + list(self.across)
            + ([own] if own is not shared_model_parallel else [])
        )

    # --- offload state between steps ------------------------------------------------------------
    def in_pass(self) -> bool:
        """Whether stage 3 is inside a forward/backward pass (its units may be in use)."""
        return self.gather is not None and self.gather.pass_key is not None

    def release_gathered(self) -> None:
        for unit in self.units.units if self.units is not None else ():
            self.units.release(unit)

    def states_reloaded(self) -> None:
        if self.units is not None:
            # Stage-3 gathers run on the prefetch stream after this event: after the copies back.
            self.units.partition_ready.record()

    def drop_param_cache(self) -> None:
        if self.units is not None and self.units.home is not None:
            self.units.home.drop_cache()  # offload_param nvme: host buffers written back


def owner(domains: list[ShardDomain], param) -> ShardDomain:
    """The domain of a parameter: the first that claims it, else the catch-all (domains[0])."""
    return next((d for d in domains[1:] if d.claims(param)), domains[0])


def summed_over_domains(domains: list[ShardDomain], sums: dict, stage: int) -> torch.Tensor:
    """Each domain's partial sum (`sums[domain]`, float64) reduced over its norm chain; those that
    share the first domain's model-parallel group are then added (in domain order) and summed over
    it, and the others added after."""
    shared = domains[0].groups.model_parallel
    joining, closed = [], []
    for domain in domains:
        for group in domain.norm_chain(stage, shared):
            comm.all_reduce(sums[domain], group)
        (joining if domain.groups.model_parallel is shared else closed).append(sums[domain])
    total = joining[0]
    for part in joining[1:]:
        total += part
    comm.all_reduce(total, shared)
    for part in closed:
        total = total + part
    return total


def _units_of(modules, params, leaves, isolated) -> tuple[list[tuple[str, list]], dict[int, nn.Module]]:
    """(name, parameters) of each unit over `params`, in module order, and unit index -> its leaf.
    A module's unit is its own parameters; a parameter registered in two modules (a tied head)
    belongs to the first and is external to the second. A leaf module's unit takes the parameters
    of all its submodules too, so one gather serves the whole leaf and nothing inside it is hooked.
    An isolated parameter stays a unit of its own, so its partition matches its copy on other
    ranks."""
    wanted, taken = {id(p) for p in params}, set()
    units_params: list[tuple[str, list]] = []
    inside, leaf_of_unit = set(), {}
    for root in modules:
        for mod_name, module in root.named_modules():
            if module in inside:
                continue
            is_leaf = module is not root and module in leaves
            if is_leaf:
                inside.update(m for m in module.modules() if m is not module)
            mine = [p for p in module.parameters(recurse=is_leaf) if id(p) in wanted and id(p) not in taken]
            taken.update(id(p) for p in mine)
            alone = [p for p in mine if is_leaf and isolated(p)]
            rest = [p for p in mine if not any(p is q for q in alone)]
            for group in [[p] for p in alone] + ([rest] if rest else []):
                if is_leaf:
                    leaf_of_unit[len(units_params)] = module
                units_params.append((mod_name or type(module).__name__, group))
    return units_params, leaf_of_unit
