"""The ZeRO engine: the data-parallel axis of every run, stage 0 (plain DP) to stage 3.

Owns the model's parameters once built: it replaces every (meta) parameter of the given modules with
one it allocated, and from then on drives backward hooks, gradient reduction, the global gradient
norm and clipping, loss scaling and the Adam step. It knows nothing of tensor- or pipeline-parallel
layers: it gets modules, an `init_fn(name, param) -> full fp32 tensor`, process groups and
per-parameter flags. Its parameters fall into shard domains (shard_domain.py: the dense weights, and
the MoE expert weights with groups of their own, experts.py), each with its storages, stage-3 gather
coordinator and norm chain; every phase below runs over the domains alike.

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
import functools
import math
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from megazero.core import host_read
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
from .experts import expert_domain
from .placement import optimizer_placement
from .config import PrecisionConfig
from .precision import Precision, uses_weight_decay
from .stage3.coordinator import GatherCoordinator
from .stage3.leaves import LAYER_CLASS, find_leaf_modules
from .stage3.units import UnitStorage
from .shard_domain import ReduceWhenComplete, ShardDomain, Shared, owner, summed_over_domains
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
    def __init__(
        self,
        modules: list[nn.Module],
        init_fn,
        *,
        groups: ZeroGroups,
        zero: ZeroConfig,
        adam: AdamConfig,
        precision: PrecisionConfig | None = None,
        clip_grad: float = 0.0,
        device="cpu",
        counts_in_norm=_always,
        isolated=_never,
        streams: Streams | None = None,
        lr_group=None,
        expert_groups: ZeroGroups | None = None,
        expert_parallel=None,
        domains: Sequence[ShardDomain] = (),
        muon: MuonConfig | None = None,
        muon_matrix=None,
        weight_decay_of=None,
        uneven_gradients: bool = False,
    ):
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
        expert weights are sharded as the others. `domains`: further families of parameters, each a
        ShardDomain with the rule that claims its parameters and its own groups (shard_domain.py).
        `muon`: Muon steps the parameters for which `muon_matrix(name, param, shape)` gives a
        MuonMatrix (megazero.zero.muon), Adam the rest.
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
        self.grads_ready = False
        self.queue = ReductionQueue(zero.reduce_bucket_size, zero.overlap)
        self.streams = streams if streams is not None else Streams(self.device)
        # The families of parameters, each sharded over its own groups (shard_domain.py); the first
        # takes every parameter no other claims.
        self.domains = [ShardDomain("dense", groups, ReduceWhenComplete(), units_label="units")]
        if expert_groups is not None:
            self.domains.append(expert_domain(expert_groups, expert_parallel))
        self.domains += list(domains)
        self._input_pass = False  # inside backward_input (B): no gradient may arrive
        self._leaves_of_pass: dict = {}  # ticket -> (domain, leaf) whose backward B ran, in order
        self._replace_parameters(init_fn, isolated, uneven_gradients)
        self._plan_optimizer(lr_group, muon, muon_matrix)
        self.memory = EngineMemory(self)
        self.has_grads = False
        self._hook_gradients()

    # --- construction -----------------------------------------------------------------------
    def _replace_parameters(self, init_fn, isolated, uneven_gradients: bool) -> None:
        """The modules' parameters replaced by the storages' (`names` follows them), with the order
        of reductions fixed where gradients may be uneven, and each storage's domain known."""
        modules = self.modules
        named = _unique_named_parameters(modules)
        self.names = {id(p): n for n, p in named}
        user_init = init_fn
        replaced = self._build_storages(named, lambda p: user_init(self.names[id(p)], p), isolated)
        old_of = {id(replaced[id(p)]): p for _, p in named if id(p) in replaced}
        self.in_order = (
            InOrderReductions(
                [(g, [old_of[id(q)] for q in g.params]) for g in self._flat_groups()], [p for _, p in named]
            )
            if uneven_gradients and self.zero.stage <= 2
            else None
        )
        for group in self._flat_groups():
            group.sequencer = self.in_order
        _swap_parameters(modules, replaced)
        self.names = {id(replaced[k]): n for k, n in self.names.items()}
        self._domain_of = {id(s): d for d in self.domains for s in d.flat_groups + [d.units] if s is not None}

    def _plan_optimizer(self, lr_group, muon: MuonConfig | None, muon_matrix) -> None:
        """Each storage's optimizer plan (weight decay, norm counting, lr group, Muon or Adam) and
        where its optimizer states live (the placement: device, offload, ZenFlow)."""
        counts_in_norm = self.counts_in_norm
        group_of = (lambda p: lr_group(self.names[id(p)])) if lr_group is not None else _no_group
        self.muon = None if muon is None else Muon.for_engine(self, muon, muon_matrix, group_of)
        for storage in self.storages():
            storage.plan(
                self._weight_decay_of, counts_in_norm, group_of, self.muon.steps if self.muon is not None else _never
            )
        self.placement = optimizer_placement(self.zero, self.groups, counts_in_norm)
        for i, storage in enumerate(self.storages()):
            self.placement.place(storage, self.domain_of(storage).label(storage, i))

    def _build_storages(self, named, init_fn, isolated) -> dict[int, nn.Parameter]:
        """Every domain's storages over its parameters (init_fn(old parameter): its full fp32 value);
        returns id(old parameter) -> its replacement."""
        shared = Shared(self.zero, self.precision, self.device, self.queue, self.streams)
        of = {id(p): owner(self.domains, p) for _, p in named}
        # A leaf module's parameters, small ones included, are gathered and reduced with the leaf
        # (its units, in unit order on every rank): kept persistent, the few an idle expert left
        # without gradients on one rank would be reduced in another order there than elsewhere.
        # A transformer layer ("layer" granularity) runs all of its modules on every rank: its
        # small parameters stay persistent. (find_leaf_modules is collective: called once.)
        leaves = find_leaf_modules(self.modules, self.zero, self.groups.model_parallel) if self.zero.stage == 3 else []
        in_leaf = {
            id(p)
            for leaf in leaves
            if type(leaf).__name__ != LAYER_CLASS and not any(leaf is root for root in self.modules)
            for p in leaf.parameters()
        }
        persistent = [
            p
            for _, p in named
            if self.zero.stage < 3 or (p.numel() <= self.zero.param_persistence_threshold and id(p) not in in_leaf)
        ]
        replaced = {}
        for domain in self.domains:
            replaced.update(
                domain.build_flat_groups([p for p in persistent if of[id(p)] is domain], init_fn, isolated, shared)
            )
        if self.zero.stage == 3:
            # The catch-all builds last (the domains claiming a family hook their gathers first).
            for domain in reversed(self.domains):
                params = [p for _, p in named if of[id(p)] is domain and id(p) not in replaced]
                replaced.update(
                    domain.build_units(
                        self.modules,
                        params,
                        init_fn,
                        isolated,
                        shared,
                        functools.partial(self._leaf_backward_done, domain),
                        leaves,
                    )
                )
        return replaced

    def _hook_gradients(self) -> None:
        me = weakref.ref(self)
        fuse = self.precision.fp32_weight_grads
        for group in self._flat_groups():
            for p in group.params:
                set_param_info(p, zero_storage=group, zero_engine=me, fp32_grad=fuse and not group.grads_are_views)
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._outside_input_pass(group.on_grad_ready, group))
        for domain in self._unit_domains():
            for p in domain.units.params:
                set_param_info(p, zero_storage=domain.units, zero_engine=me, fp32_grad=fuse)
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._outside_input_pass(domain.on_unit_grad, domain.units))

    def _weight_decay_of(self, param, full_shape) -> float:
        if self.weight_decay_rule is not None:
            return self.weight_decay_rule(self.names[id(param)], tuple(full_shape))
        return self.adam.weight_decay if uses_weight_decay(full_shape) else 0.0

    def _flat_groups(self) -> list[FlatParamGroup]:
        return [g for d in self.domains for g in d.flat_groups]

    def _unit_domains(self) -> list[ShardDomain]:
        return [d for d in self.domains if d.units is not None]

    def domain_of(self, storage) -> ShardDomain:
        """The domain a storage of this engine belongs to (its groups: `.groups`)."""
        return self._domain_of[id(storage)]

    @property
    def unit_storage(self) -> UnitStorage | None:
        """Stage 3: the catch-all (dense) domain's unit storage (tests and benches read it)."""
        return self.domains[0].units

    @property
    def gather(self) -> GatherCoordinator | None:
        """Stage 3: the catch-all (dense) domain's gather coordinator."""
        return self.domains[0].gather

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
        for group in self._flat_groups():
            group.start_backward(reduce=last_microbatch)
        for domain in self.domains:
            domain.start_backward()
        self.has_grads = True

    def _end_gradients(self) -> None:
        for group in self._flat_groups():
            group.end_backward()
        if self.in_order is not None:
            self.in_order.flush()
        for domain in self.domains:
            domain.end_backward()

    def _gathers(self) -> list[GatherCoordinator]:
        return [d.gather for d in self._unit_domains()]

    def _leaf_backward_done(self, domain: ShardDomain, module) -> None:
        """A leaf module's backward is over: its domain reduces its units. In B of a split backward
        no gradient has come yet: the leaf waits for its W."""
        if self._input_pass:
            self._leaves_of_pass.setdefault(domain.gather.ticket, []).append((domain, module))
            return
        domain.leaf_backward_done(module)

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
        """Every domain's flat groups, then every domain's unit storage."""
        return self._flat_groups() + [d.units for d in self._unit_domains()]

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
        once: over each domain's storages, then along its norm chain (shard_domain.py)."""
        sums = {
            domain: torch.zeros(size, dtype=torch.float64, device=self.device).squeeze(0) for domain in self.domains
        }
        for storage in self.storages():
            sums[self.domain_of(storage)] += of_storage(storage)
        return summed_over_domains(self.domains, sums, self.zero.stage)

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
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
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
