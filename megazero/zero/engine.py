"""The ZeRO engine: the data-parallel axis of every run, stage 0 (plain DP) to stage 3.

Owns the model's parameters once built: it replaces every (meta) parameter of the given modules with
one it allocated, and from then on drives backward hooks, gradient reduction, the global gradient
norm and clipping, loss scaling and the Adam step. It knows nothing of tensor- or pipeline-parallel
layers: it gets modules, an `init_fn(name, param) -> full fp32 tensor`, process groups and
per-parameter flags.

Built from its records, keyword by keyword:
    engine = ZeroEngine(modules, init_fn, groups=zero_groups, zero=zero_config, adam=adam_config,
                        precision=precision_config, clip_grad=1.0, device=device)
It makes its own Precision (dtypes) and LossScaler from the PrecisionConfig, holds the optimizer's
placement (megazero.zero.placement: on the device, offloaded, ZenFlow) and its memory API
(`engine.memory`: the report, where each state lives, DeepSpeed's offload_states / reload_states).

A training step, as the loop drives it:
    engine.begin_step()
    for each microbatch: forward, then engine.backward(loss | tensors+grads, last_microbatch=...)
    stats = engine.step(lr)           # reduces what is left, clips, updates, regathers

A zero-bubble pipeline schedule runs each microbatch's backward in two passes instead,
`backward_input` (B) and `backward_weight` (W): split_backward.py.
"""
from __future__ import annotations

import dataclasses
import math
import weakref

import torch
from torch import nn

from megazero.core import comm, host_read
from megazero.core.streams import Streams
from megazero.ops.adam_config import AdamConfig
from megazero.ops.muon_config import MuonConfig
from .config import ZeroConfig
from .flat_group import FlatParamGroup
from .in_order import InOrderReductions
from .zero_groups import ZeroGroups
from .loss_scaler import LossScaler
from .muon import Muon
from .engine_memory import EngineMemory
from .experts import ExpertUnits, is_expert
from .placement import optimizer_placement
from .config import PrecisionConfig
from .precision import Precision, uses_weight_decay
from .stage3.coordinator import GatherCoordinator
from .stage3.leaves import LAYER_CLASS, find_leaf_modules, on_leaf_backward
from .stage3.units import UnitStorage
from .split_backward import SplitBackward
from .storage import PartitionedStorage, ReductionQueue
from megazero.models.param_info import param_info, set_param_info


@dataclasses.dataclass
class StepStats:
    grad_norm: float
    skipped: bool
    loss_scale: float


def _always(param) -> bool:
    return True


def _never(param) -> bool:
    return False


def _no_group(param) -> int:
    return 0


class ZeroEngine(SplitBackward):
    def __init__(self, modules: list[nn.Module], init_fn, *, groups: ZeroGroups, zero: ZeroConfig,
                 adam: AdamConfig, precision: PrecisionConfig | None = None, clip_grad: float = 0.0,
                 device="cpu", counts_in_norm=_always, isolated=_never, streams: Streams | None = None,
                 lr_group=None, expert_groups: ZeroGroups | None = None, expert_parallel=None,
                 muon: MuonConfig | None = None, muon_matrix=None, weight_decay_of=None,
                 uneven_gradients: bool = False):
        """`modules`: the model chunks whose (meta) parameters the engine replaces by its own;
        `init_fn(name, param)`: the full fp32 value of a parameter by its name. `precision`: the
        run's PrecisionConfig (default fp32). `counts_in_norm(param)`: whether this rank counts the parameter in the global gradient
        norm (a replicated copy is counted once). `isolated(param)`: parameters whose reduced
        gradients the caller sums across other ranks afterwards (a tied embedding on two pipeline
        stages); each gets buffers of its own, so its partition is laid out identically there.
        `streams`: the device's side streams (gradient reductions, stage-3 prefetch); made here
        when not given, no-ops on CPU. Stage 3's leaf modules (one unit each) come from
        zero.leaf_module and stage3_granularity (leaves.py).
        `lr_group(name) -> int`: which of the step's learning rates a parameter (by its name in
        the modules) takes when `step` is given one per group (default: 0 for every parameter).
        `expert_groups`: ZeRO's groups for mixture-of-experts weights (their expert-data-parallel
        ranks), `expert_parallel` the group holding the other experts (zero/experts.py); None:
        expert weights are sharded as the others. `muon`: Muon steps the parameters for which
        `muon_matrix(name, param, shape)` gives a MuonMatrix (megazero.zero.muon), Adam the rest.
        `weight_decay_of(name, full_shape) -> float`: a parameter's weight decay (default: Megatron's
        rule, adam.weight_decay on >= 2-D weights only; megazero.initialize gives the user's param
        groups' values). `uneven_gradients`: some parameters may get no gradient on some ranks (a
        user's model); stages 0-2 then reduce in one order on every rank (in_order.py)."""
        precision = precision if precision is not None else PrecisionConfig()
        self.modules, self.groups, self.zero, self.adam = modules, groups, zero, adam
        self.precision, self.clip_grad, self.device = Precision.from_config(precision), clip_grad, torch.device(device)
        self.loss_scaler = LossScaler.from_config(precision)
        self.step_count = 0
        self.skipped_steps = 0
        self.counts_in_norm = counts_in_norm
        self.weight_decay_rule = weight_decay_of
        self.expert_groups, self.expert_parallel = expert_groups, expert_parallel
        expert = (lambda p: is_expert(p)) if expert_groups is not None else _never
        self.grads_ready = False
        self.queue = ReductionQueue(zero.reduce_bucket_size, zero.overlap)
        self.streams = streams if streams is not None else Streams(self.device)
        named = _unique_named_parameters(modules)
        self.names = {id(p): n for n, p in named}
        user_init = init_fn
        init_fn = lambda p: user_init(self.names[id(p)], p)  # noqa: E731  (old params, by name)
        # A leaf module's parameters, small ones included, are gathered and reduced with the leaf
        # (its units, in unit order on every rank): kept persistent, the few an idle expert left
        # without gradients on one rank would be reduced in another order there than elsewhere.
        # A transformer layer ("layer" granularity) runs all of its modules on every rank: its
        # small parameters stay persistent.
        leaves = find_leaf_modules(modules, zero, groups.model_parallel) if zero.stage == 3 else []
        in_leaf = {id(p) for leaf in leaves if type(leaf).__name__ != LAYER_CLASS
                   and not any(leaf is root for root in modules) for p in leaf.parameters()}
        persistent = [(n, p) for n, p in named if zero.stage < 3
                      or (p.numel() <= zero.param_persistence_threshold and id(p) not in in_leaf)]
        self.flat_groups = self._build_flat_groups(persistent, init_fn, isolated, expert)
        self.in_order = InOrderReductions(self._flat_olds, [p for _, p in named]) \
            if uneven_gradients and zero.stage <= 2 else None
        for group in self.flat_groups:
            group.sequencer = self.in_order
        replaced = {id(old): new for g, olds in self._flat_olds for old, new in zip(olds, g.params)}
        self.unit_storage, self.gather, self.expert_units = None, None, None
        if zero.stage == 3:
            experts = [p for n, p in named if expert(p) and id(p) not in replaced]
            if experts:
                self.expert_units = ExpertUnits(modules, experts, expert_groups, self.precision, self.device,
                                                self.queue, zero, self.streams, init_fn)
                replaced.update(self.expert_units.replaced)
            replaced.update(self._build_units(modules, persistent + [(None, p) for p in experts], init_fn,
                                              isolated, leaves))
        _swap_parameters(modules, replaced)
        self.names = {id(replaced[k]): n for k, n in self.names.items()}
        group_of = (lambda p: lr_group(self.names[id(p)])) if lr_group is not None else _no_group
        self.muon = None if muon is None else Muon.for_engine(self, muon, muon_matrix, group_of)
        for storage in self.storages():
            storage.plan(self._weight_decay_of, counts_in_norm, group_of,
                         self.muon.steps if self.muon is not None else _never)
        self.placement = optimizer_placement(zero, groups, counts_in_norm)
        for i, storage in enumerate(self.storages()):
            self.placement.place(storage, "units" if storage is self.unit_storage else f"group{i}")
        self.memory = EngineMemory(self)
        self.has_grads = False
        me = weakref.ref(self)
        fuse = self.precision.fp32_weight_grads
        self._input_pass = False               # inside backward_input (B): no gradient may arrive
        self._leaves_of_pass: dict = {}        # ticket -> leaves whose backward B ran, in order
        for group in self.flat_groups:
            for p in group.params:
                set_param_info(p, zero_storage=group, zero_engine=me, fp32_grad=fuse and not group.grads_are_views)
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._outside_input_pass(group.on_grad_ready, group))
        for units in self._unit_storages():
            for p in units.params:
                set_param_info(p, zero_storage=units, zero_engine=me, fp32_grad=fuse)
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._outside_input_pass(self._on_unit_grad, units))

    # --- construction -----------------------------------------------------------------------
    def _weight_decay_of(self, param, full_shape) -> float:
        if self.weight_decay_rule is not None:
            return self.weight_decay_rule(self.names[id(param)], tuple(full_shape))
        return self.adam.weight_decay if uses_weight_decay(full_shape) else 0.0

    def _unit_storages(self) -> list[UnitStorage]:
        return [u for u in (self.unit_storage, self.expert_units and self.expert_units.storage) if u is not None]

    def _build_flat_groups(self, named, init_fn, isolated, expert) -> list[FlatParamGroup]:
        buckets: dict[tuple[bool, bool, bool], list] = {}
        for name, p in named:
            key = (bool(expert(p)), uses_weight_decay(p.shape), bool(isolated(p)))
            buckets.setdefault(key, []).append(p)
        stage = 2 if self.zero.stage == 3 else self.zero.stage
        # parameter_alignment (stages 1-2): each parameter's view starts 16-byte aligned.
        align = 16 // self.precision.param_dtype.itemsize if self.zero.parameter_alignment and \
            self.zero.stage in (1, 2) else 1
        groups, self._flat_olds = [], []
        for (experts, *_), params in sorted(buckets.items()):
            g = self.expert_groups if experts else self.groups
            group = FlatParamGroup(
                params, stage=stage, dp=g.dp, shard=g.shard if stage > 0 else None, replica=g.replica,
                precision=self.precision, bucket_size=self.zero.reduce_bucket_size,
                device=self.device, queue=self.queue, allgather_bucket_size=self.zero.allgather_bucket_size,
                reduce_scatter=self.zero.reduce_scatter, streams=self.streams,
                state_device="cpu" if self.zero.offloads_optimizer else None, param_align=align)
            self._flat_olds.append((group, params))
            group.materialize(init_fn)
            groups.append(group)
        return groups

    def _build_units(self, modules, persistent, init_fn, isolated, leaves) -> dict[int, nn.Parameter]:
        # A module's unit is its own non-persistent parameters; a parameter registered in two
        # modules (a tied head) belongs to the first and is external to the second. A leaf module's
        # unit takes the parameters of all its submodules too, so one gather serves the whole leaf
        # and nothing inside it is hooked. An isolated parameter stays a unit of its own, so its
        # partition matches its copy on other ranks.
        taken = {id(p) for _, p in persistent}
        units_params: list[tuple[str, list]] = []
        inside, leaf_of_unit = set(), {}
        for root in modules:
            for mod_name, module in root.named_modules():
                if module in inside:
                    continue
                is_leaf = module is not root and module in leaves
                if is_leaf:
                    inside.update(m for m in module.modules() if m is not module)
                params = [p for p in module.parameters(recurse=is_leaf) if id(p) not in taken]
                taken.update(id(p) for p in params)
                alone = [p for p in params if is_leaf and isolated(p)]
                name = mod_name or type(module).__name__
                rest = [p for p in params if not any(p is q for q in alone)]
                for group in [[p] for p in alone] + ([rest] if rest else []):
                    if is_leaf:
                        leaf_of_unit[len(units_params)] = module
                    units_params.append((name, group))
        self.unit_storage = UnitStorage(units_params, self.groups, self.precision, self.device, self.queue,
                               reduce_scatter=self.zero.reduce_scatter, streams=self.streams,
                               zero=self.zero)
        replaced = self.unit_storage.materialize(init_fn)
        self.gather = GatherCoordinator(self.unit_storage, self.zero)
        self.gather.attach(modules, {old_id: param_info(new).zero_unit for old_id, new in replaced.items()},
                           blocks=[m for m in leaves if not any(m is root for root in modules)])
        self.leaf_units: dict[nn.Module, list] = {}
        for index, leaf in leaf_of_unit.items():
            self.leaf_units.setdefault(leaf, []).append(self.unit_storage.units[index])
        self.leaf_unit_indices = set(leaf_of_unit)
        on_leaf_backward(self.leaf_units, self._leaf_backward_done)
        return replaced

    # --- microbatches -----------------------------------------------------------------------
    def begin_step(self) -> None:
        self.memory.check_states_home()
        self._leaves_of_pass.clear()
        for gather in self._gathers():
            gather.begin_pass("train")

    def backward(self, loss, *, last_microbatch: bool = True) -> None:
        """Backward of one microbatch from `loss` (scaled for fp16 here), or by calling `loss` when it
        is a function (a pipeline stage backpropagating a received gradient, already scaled).
        Stage 0/1 reduce after the last microbatch, stage 2/3 after each."""
        self._begin_gradients(last_microbatch)
        self._backprop(loss)
        self._end_gradients()

    def _backprop(self, loss) -> None:
        if callable(loss):
            loss()
        else:
            (loss * self.loss_scaler.scale if self.loss_scaler.scale != 1.0 else loss).backward()

    def _begin_gradients(self, last_microbatch: bool) -> None:
        if self.in_order is not None:
            self.in_order.start()
        for group in self.flat_groups:
            group.start_backward(reduce=last_microbatch)
        if self.unit_storage is not None:
            self.unit_storage.start_backward()
        if self.expert_units is not None:
            self.expert_units.start_backward()
        self.has_grads = True

    def _end_gradients(self) -> None:
        for group in self.flat_groups:
            group.end_backward()
        if self.in_order is not None:
            self.in_order.flush()
        if self.unit_storage is not None:
            for unit in self.unit_storage.units:
                # Some but not all of its gradients arrived (unused parameters): reduce what came.
                if unit.grad_staging is not None:
                    self.unit_storage.reduce_grads(unit)
                    self.gather.grads_done(unit)
        if self.expert_units is not None:
            self.expert_units.end_backward()

    def _gathers(self) -> list[GatherCoordinator]:
        return [g for g in (self.gather, self.expert_units and self.expert_units.gather) if g is not None]

    def _on_unit_grad(self, param: nn.Parameter) -> None:
        # A leaf's units are reduced when the leaf's backward is done (_leaf_backward_done): which of
        # its parameters get gradients may differ between ranks (an expert one rank's tokens skip),
        # the order of the reductions must not.
        if self.expert_units is not None and param_info(param).zero_storage is self.expert_units.storage:
            return self.expert_units.add_grad(param)
        unit = param_info(param).zero_unit
        if self.unit_storage.add_grad(param) and unit.index not in self.leaf_unit_indices:
            self.unit_storage.reduce_grads(unit)
            self.gather.grads_done(unit)

    def _leaf_backward_done(self, module) -> None:
        """Reduces the leaf's units with the gradients that came (zeros for parameters this rank's
        data did not use), in unit order on every rank, as DeepSpeed does for its leaf modules. In
        B of a split backward no gradient has come yet: the leaf waits for its W."""
        if self._input_pass:
            self._leaves_of_pass.setdefault(self.gather.ticket, []).append(module)
            return
        for unit in self.leaf_units[module]:
            if unit.grad_pending != -1 or unit.grad_staging is not None:
                self.unit_storage.reduce_grads(unit)
                self.gather.grads_done(unit)

    def finish_gradients(self) -> None:
        """Completes every reduction of the step (MiCS replicas included). Afterwards, and until
        the step, `grad_pieces` are this rank's reduced gradients (for finalize_model_grads)."""
        if self.grads_ready:
            return
        self.queue.wait_all()
        for storage in self.storages():
            storage.finish_gradients()
        self.grads_ready = True

    def grad_pieces(self, params) -> list[torch.Tensor]:
        """This rank's pieces (1-D views, possibly empty) of the reduced gradients of `params`."""
        self.finish_gradients()
        return [param_info(p).zero_storage.local_view(p, "grad") for p in params]

    # --- step -------------------------------------------------------------------------------
    def storages(self) -> list[PartitionedStorage]:
        return list(self.flat_groups) + self._unit_storages()

    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) gradients over DP shards, TP and PP; inf or nan when
        any rank holds a non-finite gradient (one all-reduce per group serves both)."""
        sumsq = self._summed(lambda storage: storage.grad_sumsq(), 1)
        value = host_read.read(sumsq, "gradient norm", healthy=1.0)
        return math.sqrt(value) / self.loss_scaler.scale if value >= 0 else float("nan")

    def counted_stats(self, kind: str) -> tuple[float, int]:
        """(L2 norm, number of zeros) of the parameters' fp32 values (kind "fp32") or of their
        reduced, still scaled gradients ("grad", call before `step`), each element counted once over
        DP shards, TP and PP, as the gradient norm counts them."""
        if kind == "grad":
            self.finish_gradients()
        stats = self._summed(lambda storage: storage.counted_stats(kind), 2)
        sumsq, zeros = host_read.read(stats, "parameter statistics", healthy=[1.0, 0.0])
        return math.sqrt(max(sumsq, 0.0)), int(zeros)

    def _summed(self, of_storage, size: int) -> torch.Tensor:
        """`of_storage(storage)` (float64 of `size`) summed over every storage and rank, each element
        once. Stage 0 ranks hold identical all-reduced gradients (a NaN anywhere reached every rank);
        partitions are summed over the shard group (MiCS replicas already hold the same sums); expert
        storages over their own shard group, then over the ranks holding the other experts."""
        total = torch.zeros(size, dtype=torch.float64, device=self.device).squeeze(0)
        experts = torch.zeros_like(total) if self.expert_groups is not None else None
        for storage in self.storages():
            if experts is not None and self.is_expert_storage(storage):
                experts += of_storage(storage)
            else:
                total += of_storage(storage)
        if self.zero.stage > 0:
            comm.all_reduce(total, self.groups.shard)
        if experts is not None:
            if self.zero.stage > 0:
                comm.all_reduce(experts, self.expert_groups.shard)
            comm.all_reduce(experts, self.expert_parallel)
            if self.expert_groups.model_parallel is not self.groups.model_parallel:
                # whole experts (etp 1): the expert groups spanned the tensor-parallel ranks already
                comm.all_reduce(experts, self.expert_groups.model_parallel)
                comm.all_reduce(total, self.groups.model_parallel)
                return total + experts
            total += experts
        comm.all_reduce(total, self.groups.model_parallel)
        return total

    def is_expert_storage(self, storage) -> bool:
        if self.expert_groups is None:
            return False
        if self.expert_units is not None and storage is self.expert_units.storage:
            return True
        return storage in self.flat_groups and is_expert(storage.params[0])

    def step(self, lr) -> StepStats:
        """Clips and applies the step's gradients with learning rate `lr` (a float, or one per lr
        group: see __init__'s `lr_group`); a non-finite gradient norm (any precision, any
        rank) skips the step on every rank instead, and fp16's dynamic loss scale backs off."""
        self.memory.check_states_home()
        self.finish_gradients()
        scale = self.loss_scaler.scale
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.skipped_steps += 1
            self.loss_scaler.update(True)
            self._end_step()
            return StepStats(norm, True, scale)
        coef = 1.0 / scale
        if self.clip_grad > 0 and norm > self.clip_grad:
            coef *= self.clip_grad / (norm + 1e-6)
        self.step_count += 1
        self.placement.before_step(self.storages(), self.step_count, coef)
        if self.muon is not None:
            self.muon.step(lr, coef)
        for storage in self.storages():
            storage.step(self.step_count, lr, self.adam, coef)
        self.loss_scaler.update(False)
        self._end_step()
        return StepStats(norm, False, scale)

    def _end_step(self) -> None:
        for gather in self._gathers():
            gather.end_pass()
        self.zero_grad()

    def zero_grad(self) -> None:
        for storage in self.storages():
            storage.zero_grad()
        self.grads_ready = self.has_grads = False

    # --- introspection ----------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in _unique_named_parameters(self.modules)]

    # DeepSpeed's engine API for moving states between steps (engine.memory has the rest).
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        self.memory.offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self.memory.reload_states(non_blocking)

    def empty_partition_cache(self) -> None:
        self.memory.empty_partition_cache()


def _unique_named_parameters(modules) -> list[tuple[str, nn.Parameter]]:
    """Parameters of all modules by their model names (pipeline chunks of one model never repeat a
    name: layers keep their global index)."""
    seen, out = set(), []
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def _swap_parameters(modules, replaced: dict[int, nn.Parameter]) -> None:
    """Points every module slot holding an old parameter at its replacement (shared slots included)."""
    for root in modules:
        for module in root.modules():
            for key, p in list(module._parameters.items()):
                if p is not None and id(p) in replaced:
                    module._parameters[key] = replaced[id(p)]
