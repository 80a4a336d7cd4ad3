"""The ZeRO engine: the data-parallel axis of every run, stage 0 (plain DP) to stage 3.

Owns the model's parameters once built: it replaces every (meta) parameter of the given modules with
one it allocated, and from then on drives backward hooks, gradient reduction, the global gradient
norm and clipping, loss scaling and the Adam step. It knows nothing of tensor- or pipeline-parallel
layers: it gets modules, an `init_fn(param) -> full fp32 tensor`, process groups and per-parameter
flags.

A training step, as the loop drives it:
    engine.begin_step()
    for each microbatch: forward, then engine.backward(loss | tensors+grads, last_microbatch=...)
    stats = engine.step(lr)           # reduces what is left, clips, updates, regathers
"""
from __future__ import annotations

import dataclasses
import math
import weakref

import torch
from torch import nn

from megazero import comm
from .adam import AdamConfig
from .config import ZeroConfig
from .flat_group import FlatParamGroup
from .groups import Precision, ZeroGroups, counts_in_norm, uses_weight_decay
from .loss_scaler import LossScaler
from .stage3_gather import GatherCoordinator
from .stage3_units import UnitStore


MAX_REDUCTIONS_IN_FLIGHT = 2      # stage-3 gradient reduce-scatters overlapping backward


@dataclasses.dataclass
class StepStats:
    grad_norm: float
    skipped: bool
    loss_scale: float


class ZeroEngine:
    def __init__(self, modules: list[nn.Module], init_fn, groups: ZeroGroups, zero: ZeroConfig,
                 adam: AdamConfig, precision: Precision = Precision(), clip_grad: float = 0.0,
                 loss_scaler: LossScaler | None = None, device="cpu"):
        self.modules, self.groups, self.zero, self.adam = modules, groups, zero, adam
        self.precision, self.clip_grad, self.device = precision, clip_grad, torch.device(device)
        self.loss_scaler = loss_scaler or LossScaler()
        self.step_count = 0
        self.grads_ready = False
        self._inflight: list[tuple[comm.Handle, int]] = []     # stage-3 reductions, staged elements
        named = _unique_named_parameters(modules)
        self.names = {id(p): n for n, p in named}
        user_init = init_fn
        init_fn = lambda p: user_init(self.names[id(p)], p)  # noqa: E731  (old params, by name)
        persistent = [(n, p) for n, p in named if zero.stage < 3 or p.numel() <= zero.param_persistence_threshold]
        self.flat_groups = self._build_flat_groups(persistent, init_fn)
        replaced = {id(old): new for g, olds in self._flat_olds for old, new in zip(olds, g.params)}
        self.store, self.gather, self._shared_units = None, None, []
        if zero.stage == 3:
            replaced.update(self._build_units(modules, persistent, init_fn))
        _swap_parameters(modules, replaced)
        self.names = {id(replaced[k]): n for k, n in self.names.items()}
        self.has_grads = False
        me = weakref.ref(self)
        for group in self.flat_groups:
            for p in group.params:
                p.zero_storage, p.zero_engine = group, me
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(group.on_grad_ready)
        if self.store is not None:
            for unit in self.store.units:
                for p in unit.params:
                    p.zero_storage, p.zero_engine = self.store, me
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(self._on_unit_grad)

    # --- construction -----------------------------------------------------------------------
    def _build_flat_groups(self, named, init_fn) -> list[FlatParamGroup]:
        buckets: dict[tuple[bool, bool], list] = {}
        for name, p in named:
            key = (uses_weight_decay(p.shape), bool(getattr(p, "shared_embedding", False)))
            buckets.setdefault(key, []).append(p)
        stage = 2 if self.zero.stage == 3 else self.zero.stage
        groups, self._flat_olds = [], []
        for (decay, shared), params in sorted(buckets.items()):
            group = FlatParamGroup(
                params, stage=stage, weight_decay=self.adam.weight_decay if decay else 0.0,
                groups=self.groups, precision=self.precision, bucket_size=self.zero.reduce_bucket_size,
                overlap=self.zero.overlap, shared=shared,
                counted=[counts_in_norm(p, self.groups) for p in params], device=self.device,
                allgather_bucket_size=self.zero.allgather_bucket_size,
                reduce_scatter=self.zero.reduce_scatter or self.zero.stage == 3)
            self._flat_olds.append((group, params))
            group.materialize(init_fn)
            groups.append(group)
        return groups

    def _build_units(self, modules, persistent, init_fn) -> dict[int, nn.Parameter]:
        # A module's unit is its own non-persistent parameters; a parameter registered in two
        # modules (a tied head) belongs to the first and is external to the second.
        taken = {id(p) for _, p in persistent}
        units_params: list[tuple[str, list]] = []
        for root in modules:
            for mod_name, module in root.named_modules():
                params = [p for p in module.parameters(recurse=False) if id(p) not in taken]
                taken.update(id(p) for p in params)
                if params:
                    units_params.append((mod_name or type(module).__name__, params))
        self.store = UnitStore(units_params, self.groups, self.precision, self.device)
        replaced = self.store.materialize(init_fn)
        self.store.plan_segments(
            lambda p: self.adam.weight_decay if uses_weight_decay(p.zero_full_shape) else 0.0,
            lambda p: counts_in_norm(p, self.groups))
        # Units holding a tied embedding copy (first and last pipeline stage) sum their gradients.
        self._shared_units = [u for u in self.store.units if self.groups.embedding.size > 1
                              and any(getattr(p, "shared_embedding", False) for p in u.params)]
        self.gather = GatherCoordinator(self.store, self.zero)
        self.gather.attach(modules, {old_id: new.zero_unit for old_id, new in replaced.items()})
        return replaced

    # --- microbatches -----------------------------------------------------------------------
    def begin_step(self) -> None:
        if self.gather is not None:
            self.gather.begin_pass("train")

    def backward(self, loss, *, last_microbatch: bool = True) -> None:
        """Backward of one microbatch from `loss` (scaled for fp16 here), or by calling `loss` when it
        is a function (a pipeline stage backpropagating a received gradient, already scaled).
        Stage 0/1 reduce after the last microbatch, stage 2/3 after each."""
        for group in self.flat_groups:
            group.start_backward(reduce=last_microbatch)
        if self.store is not None:
            self.store.start_backward()
        self.has_grads = True
        if callable(loss):
            loss()
        else:
            (loss * self.loss_scaler.scale if self.loss_scaler.scale != 1.0 else loss).backward()
        for group in self.flat_groups:
            group.end_backward()
        if self.store is not None:
            for unit in self.store.units:
                # Some but not all of its gradients arrived (unused parameters): reduce what came.
                if unit.grad_staging is not None:
                    self.store.reduce_grads(unit, self._inflight)
                    self.gather.grads_done(unit)

    def _on_unit_grad(self, param: nn.Parameter) -> None:
        if self.store.add_grad(param):
            unit = param.zero_unit
            self.store.reduce_grads(unit, self._inflight)
            if not self.zero.overlap:
                self._wait_inflight()
            # Staging buffers live until their reduce-scatter ends. A backend runs collectives one
            # at a time anyway, so two in flight keep the overlap; more would only hold memory.
            while len(self._inflight) > MAX_REDUCTIONS_IN_FLIGHT or (
                    len(self._inflight) > 1 and
                    sum(n for _, n in self._inflight) > self.zero.reduce_bucket_size):
                self._inflight.pop(0)[0].wait()
            self.gather.grads_done(unit)

    def _wait_inflight(self) -> None:
        inflight, self._inflight = self._inflight, []
        for handle, _ in inflight:
            handle.wait()

    def finish_gradients(self) -> None:
        """Completes every reduction of the step (MiCS replicas and tied stages included)."""
        if self.grads_ready:
            return
        for group in self.flat_groups:
            group.finish_gradients()
        self._wait_inflight()
        if self.store is not None:
            self.store.ensure_grads()
            comm.all_reduce(self.store.grad_part, self.groups.replica)
            for unit in self._shared_units:
                comm.all_reduce(self.store.unit_slice(self.store.grad_part, unit), self.groups.embedding)
        self.grads_ready = True

    # --- step -------------------------------------------------------------------------------
    def _storages(self):
        return list(self.flat_groups) + ([self.store] if self.store is not None else [])

    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) gradients over DP shards, TP and PP."""
        sumsq = sum((s.grad_sumsq() for s in self._storages()), torch.zeros((), dtype=torch.float64))
        if self.zero.stage > 0:
            comm.all_reduce(sumsq, self.groups.shard)
        comm.all_reduce(sumsq, self.groups.model_parallel)
        return math.sqrt(sumsq.item()) / self.loss_scaler.scale

    def _overflow(self) -> bool:
        if not self.loss_scaler.dynamic:
            return False
        local = float(any(s.has_inf_or_nan() for s in self._storages()))
        flag = comm.all_reduce_object_max(local, self.groups.shard if self.zero.stage > 0 else self.groups.dp)
        return comm.all_reduce_object_max(flag, self.groups.model_parallel) > 0

    def step(self, lr: float) -> StepStats:
        self.finish_gradients()
        scale = self.loss_scaler.scale
        if self._overflow():
            self.loss_scaler.update(True)
            self._end_step()
            return StepStats(float("nan"), True, scale)
        norm = self.grad_norm()
        coef = 1.0 / scale
        if self.clip_grad > 0 and norm > self.clip_grad:
            coef *= self.clip_grad / (norm + 1e-6)
        self.step_count += 1
        for storage in self._storages():
            storage.step(self.step_count, lr, self.adam, coef)
        self.loss_scaler.update(False)
        self._end_step()
        return StepStats(norm, False, scale)

    def _end_step(self) -> None:
        if self.gather is not None:
            self.gather.end_pass()
        self.zero_grad()

    def zero_grad(self) -> None:
        for storage in self._storages():
            storage.zero_grad()
        self.grads_ready = self.has_grads = False

    # --- introspection ----------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in _unique_named_parameters(self.modules)]

    def memory_report(self) -> dict[str, int]:
        """Bytes held by this rank, by category: low-precision params (stage 3: partitions plus
        persistent ones), grads, fp32 master, optimizer states, live (gathered) params now and at
        peak, buffers (module buffers and gradient staging); model_states sums the first four."""
        report = {"params": 0, "grads": 0, "master": 0, "optimizer_states": 0, "live_params": 0}
        for storage in self._storages():
            for key, value in storage.memory_bytes().items():
                report[key] = report.get(key, 0) + value
        if self.store is not None:
            report["peak_live_params"] = self.store.peak_live_numel * self.store.partition.element_size()
        # Module buffers, and gradient staging buckets alive right now (in flight or filling).
        report["buffers"] = sum(b.numel() * b.element_size() for m in self.modules for b in m.buffers())
        report["buffers"] += sum(s.staging_bytes() for s in self._storages())
        grad_bytes = torch.empty((), dtype=self.precision.grad_dtype).element_size()
        report["buffers"] += sum(n for _, n in self._inflight) * grad_bytes
        report["model_states"] = sum(report[k] for k in ("params", "grads", "master", "optimizer_states"))
        return report


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
