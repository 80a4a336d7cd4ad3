"""ZeRO stage 3: when to gather and release each unit, driven by module hooks.

Owns the module hooks and the schedule: before a module's forward (and, through a hook on its
outputs, before its backward) its units are gathered; after its forward, and once its gradients are
all in, they are released. The order of unit uses is recorded on the first step ("trace") and then
drives prefetching (`prefetch_bucket_size` elements ahead, never beyond `max_live_parameters`) and
reuse (a released unit whose next use is within `max_reuse_distance` elements stays gathered). If a
step uses units in a different order the trace is dropped with a warning and recorded again.

A parameter used by a module that does not own it (a tied output head) is an external parameter of
that module: detected when the same Parameter is registered in two modules, or declared with
`register_external_parameter`.
"""
from __future__ import annotations

import bisect
import itertools
import warnings

import torch
from torch import nn

from .config import ZeroConfig
from .stage3_units import ParamStatus, Unit, UnitStore


class _BeforeBackward(torch.autograd.Function):
    """Identity on a module's outputs whose backward gathers the module's units first."""

    @staticmethod
    def forward(ctx, coordinator, module, *tensors):
        ctx.coordinator, ctx.module = coordinator, module
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.coordinator.use(ctx.coordinator.units_of(ctx.module))
        return (None, None, *grads)


class Trace:
    """A recorded order of unit uses, with what reuse decisions need in O(log n) per query."""

    def __init__(self, order: list[int], totals: list[int]):
        self.order = order
        self.prefix = [0]                       # elements fetched before each position
        self.positions: dict[int, list[int]] = {}
        for position, index in enumerate(order):
            self.prefix.append(self.prefix[-1] + totals[index])
            self.positions.setdefault(index, []).append(position)

    def distance_to_next_use(self, index: int, position: int) -> float:
        """Elements fetched from `position` until unit `index` is used again (inf if never)."""
        uses = self.positions.get(index, [])
        k = bisect.bisect_left(uses, position)
        return self.prefix[uses[k]] - self.prefix[position] if k < len(uses) else float("inf")


class GatherCoordinator:
    def __init__(self, store: UnitStore, config: ZeroConfig):
        self.store, self.config = store, config
        self.module_units: dict[nn.Module, list[Unit]] = {}
        self.traces: dict[object, Trace] = {}         # by pass kind: recorded unit order
        self.recording: list[int] | None = None
        self.pass_key: object = None                 # "train", or ("eval", root) per evaluation forward
        self.position = 0
        self.in_use: set[int] = set()
        self.keep_all = config.keep_params_gathered_across_microbatches
        self._hooked: set[nn.Module] = set()

    # --- registration -------------------------------------------------------------------------
    def attach(self, modules: list[nn.Module], owner_of: dict[int, Unit]) -> None:
        """Hooks every module that owns a unit or uses another module's unit parameter."""
        for root in modules:
            root.register_forward_pre_hook(self._root_pre_forward)
            root.register_forward_hook(self._root_post_forward)
            for module in root.modules():
                units = []
                for p in module.parameters(recurse=False):
                    unit = owner_of.get(id(p))
                    if unit is not None and unit not in units:
                        units.append(unit)
                if units:
                    self.module_units[module] = units
                    self._hook(module)

    def register_external(self, module: nn.Module, unit: Unit) -> None:
        units = self.module_units.setdefault(module, [])
        if unit not in units:
            units.append(unit)
        self._hook(module)

    def units_of(self, module: nn.Module) -> list[Unit]:
        return self.module_units.get(module, [])

    def _hook(self, module: nn.Module) -> None:
        if module in self._hooked:
            return
        self._hooked.add(module)
        module.register_forward_pre_hook(lambda m, args: self.use(self.units_of(m)))
        module.register_forward_hook(self._post_forward)

    def _root_pre_forward(self, module, args):
        if self.pass_key is None:     # outside a training step: an evaluation forward is one pass
            self.begin_pass(("eval", id(module)))

    def _root_post_forward(self, module, args, output):
        if self.pass_key == ("eval", id(module)):
            self.end_pass()

    def _post_forward(self, module, args, output):
        units = self.units_of(module)
        for unit in units:
            self.in_use.discard(unit.index)
        if not self.keep_all:
            for unit in units:
                self.maybe_release(unit)
        if not torch.is_grad_enabled():
            return output
        tensors = output if isinstance(output, tuple) else (output,)
        if not all(isinstance(t, torch.Tensor) for t in tensors) or not any(t.requires_grad for t in tensors):
            return output
        wrapped = _BeforeBackward.apply(self, module, *tensors)
        return wrapped if isinstance(output, tuple) else wrapped[0]

    # --- use, prefetch, release ---------------------------------------------------------------
    def use(self, units: list[Unit]) -> None:
        """Makes `units` available now (records the use, prefetches what the trace says comes next)."""
        for unit in units:
            self._record(unit)
            self.in_use.add(unit.index)
        missing = [u for u in units if u.status is ParamStatus.NOT_AVAILABLE]
        self._make_room(sum(u.total for u in missing))
        for unit in missing:
            self.store.start_gather(unit)
        self._prefetch()
        for unit in units:
            self.store.wait_gather(unit)

    def _record(self, unit: Unit) -> None:
        trace = self.traces.get(self.pass_key)
        if trace is not None:
            if self.position < len(trace.order) and trace.order[self.position] == unit.index:
                self.position += 1
                return
            warnings.warn(f"ZeRO-3: module order changed at use {self.position} (unit {unit.name}); "
                          f"re-recording the prefetch trace on the next step", stacklevel=3)
            del self.traces[self.pass_key]
        if self.recording is not None:
            self.recording.append(unit.index)
        self.position += 1

    def _prefetch(self) -> None:
        """Gathers ahead along the trace until `prefetch_bucket_size` elements lie ahead gathered or
        in flight (units already there count against it), never beyond max_live_parameters."""
        trace = self.traces.get(self.pass_key)
        if trace is None or self.config.prefetch_bucket_size == 0:
            return
        budget = self.config.prefetch_bucket_size
        seen = set(self.in_use)
        for index in itertools.islice(trace.order, self.position, None):
            if index in seen:
                continue
            seen.add(index)
            unit = self.store.units[index]
            if unit.total > budget:
                break
            budget -= unit.total
            if unit.status is ParamStatus.NOT_AVAILABLE:
                if self.store.live_numel + unit.total > self.config.max_live_parameters:
                    break
                self.store.start_gather(unit)

    def maybe_release(self, unit: Unit) -> None:
        if unit.index in self.in_use or unit.status is ParamStatus.NOT_AVAILABLE:
            return
        if self._next_use_distance(unit) <= self.config.max_reuse_distance and \
                self.store.live_numel <= self.config.max_live_parameters:
            return
        self.store.release(unit)

    def _next_use_distance(self, unit: Unit) -> float:
        """Elements fetched between now and the unit's next use in the trace (inf if unknown)."""
        trace = self.traces.get(self.pass_key)
        if trace is None:
            return float("inf")
        return trace.distance_to_next_use(unit.index, self.position)

    def _make_room(self, needed: int) -> None:
        """Releases gathered units kept for reuse (not in use now) until `needed` more elements fit
        under max_live_parameters; what is needed now is gathered even if nothing can go."""
        limit = self.config.max_live_parameters
        for unit in self.store.units:
            if self.store.live_numel + needed <= limit:
                break
            if unit.index not in self.in_use and unit.status is not ParamStatus.NOT_AVAILABLE:
                self.store.release(unit)

    def grads_done(self, unit: Unit) -> None:
        """The unit's gradients are all in: its last use in this backward is over."""
        self.in_use.discard(unit.index)
        if not self.keep_all:
            self.maybe_release(unit)

    # --- pass boundaries ----------------------------------------------------------------------
    def begin_pass(self, key) -> None:
        """Starts a training step ("train") or an evaluation forward; records a trace if none."""
        self.pass_key, self.position = key, 0
        self.recording = [] if key not in self.traces else None

    def end_pass(self) -> None:
        """Ends the pass: keeps a freshly recorded trace and releases every unit."""
        if self.recording is not None and self.pass_key not in self.traces and self.recording:
            self.traces[self.pass_key] = Trace(self.recording, [u.total for u in self.store.units])
        self.pass_key, self.recording, self.position = None, None, 0
        self.in_use.clear()
        for unit in self.store.units:
            self.store.release(unit)

    def trace_names(self, key="train") -> list[str]:
        trace = self.traces.get(key)
        return [self.store.units[i].name for i in trace.order] if trace else []
