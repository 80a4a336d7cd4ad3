"""ZeRO stage 3: when to gather and release each unit, driven by module hooks.

Owns the module hooks and the schedule: before a module's forward (and, through a hook on its
outputs, before its backward) its units are gathered; after its forward, and once its gradients are
all in, they are released. The order of unit uses is recorded on the first step ("trace") and then
drives prefetching (`prefetch_bucket_size` elements ahead, or a budget adaptive_prefetch.py moves
with the measured waits, never beyond `max_live_parameters`, at most MAX_GATHERS_IN_FLIGHT gathers
outstanding) and reuse (a released unit whose next use is within
`max_reuse_distance` elements stays gathered). If a step uses units in a different order the trace is
dropped with a warning and recorded again.

Hardening, after DeepSpeed's stage-3 bugs:
- While a trace is being recorded, each use is agreed on across the shard group (one tiny all-gather
  per use, then one for the end of the pass) *before* its unit is gathered, so ranks running different
  modules fail with a RuntimeError naming both, instead of hanging in mismatched all-gathers. Once a
  trace exists nothing extra is communicated: a rank that later leaves the trace on its own is not
  caught (that would cost a collective per use on every step).
- Units are reference-counted: every running forward of a module that uses a unit holds one reference,
  and the backward holds one from the first module backward that needs it until its gradients are all
  in, so a unit shared by nested or interleaved users is released only when the last is done. A split
  backward (zero-bubble schedules: B now, W later) holds one per `ticket` (its chunk and microbatch):
  B's module backwards take it, and it is let go when that ticket's W has brought the gradients
  (`grads_done`) or ended (`end_ticket`), so a unit B gathered stays gathered until its W ran, however
  many other microbatches' passes run in between.
- A module's outputs may be any nesting of tuples, lists, dicts and namedtuples with non-tensors
  inside: every tensor that requires grad gets the backward re-gather. A leaf that is neither a tensor
  nor a plain value (a custom class) is refused at the module's first forward that builds a graph.
- Hooks run outside torch.compile tracing (torch.compiler.disable), so compiled models see plain
  tensors and our Python bookkeeping never becomes part of a graph.

A parameter used by a module that does not own it (a tied output head) is an external parameter of
that module: detected when the same Parameter is registered in two modules, or declared with
`register_external_parameter`.
"""

from __future__ import annotations

import bisect
import collections
import enum
import itertools
import warnings

import torch
from torch import nn
from torch.utils import _pytree as pytree

from megazero.core import comm, host_read
from megazero.core.errors import UsageError
from ..config import ZeroConfig
from .adaptive_prefetch import AdaptivePrefetch
from .leaves import OnBackward
from .units import ParamStatus, Unit, UnitStorage

# Gathers issued and not yet waited for. A backend runs one communicator's collectives one after
# another (NCCL on its stream, gloo on its group's queue), so a third gather queued behind two
# others finishes no sooner than if it were issued when the first completes: two keep the link busy
# (one moving, the next queued with no idle gap), more only hold full-size buffers earlier and let a
# long prefetch queue stand in front of a gather that is needed now.
MAX_GATHERS_IN_FLIGHT = 2

_END_OF_PASS = -1  # a rank's "use" at the end of a recording pass, in the trace check
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device)


class Trace:
    """A recorded order of unit uses, with what reuse decisions need in O(log n) per query."""

    def __init__(self, order: list[int], totals: list[int]):
        self.order = order
        self.prefix = [0]  # elements fetched before each position
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
    def __init__(self, storage: UnitStorage, config: ZeroConfig):
        self.unit_storage, self.config = storage, config
        self.module_units: dict[nn.Module, list[Unit]] = {}
        self.traces: dict[object, Trace] = {}  # by pass kind: recorded unit order
        self.recording: list[int] | None = None
        self.pass_key: object = None  # "train", or ("eval", root) per evaluation forward
        self.position = 0
        self.refs: dict[int, int] = {}  # unit index -> running users (see docstring)
        # ticket -> units that backward holds a reference on (ticket None: a plain backward)
        self.backward_holds: dict[object, set[int]] = {}
        self.ticket: object = None  # the split backward's pass running now
        self.keep_all = config.keep_params_gathered_across_microbatches
        self.max_gathers_in_flight = MAX_GATHERS_IN_FLIGHT
        self.peak_gathers_in_flight = 0
        self._gathers: collections.deque[Unit] = collections.deque()  # issued by us, oldest first
        self._names: dict[nn.Module, str] = {}
        self.adaptive = (
            AdaptivePrefetch(config, storage.groups.shard, storage.device)
            if config.adaptive_prefetch_bucket_size
            else None
        )
        self._hooked: list[nn.Module] = []  # in hooking order (the same on every rank) ...
        self._module_id: dict[nn.Module, int] = {}  # ... so a position names a module in the trace check

    # --- registration -------------------------------------------------------------------------
    def attach(self, modules: list[nn.Module], owner_of: dict[int, Unit], blocks=()) -> None:
        """Hooks every module that owns a unit or uses another module's unit parameter. A module in
        `blocks` (stage3_granularity "layer") is hooked for the units of all its parameters, its
        submodules only for units from outside the block: the block's unit is gathered once before
        its first submodule runs and released after the block."""
        blocks = set(blocks)
        for root in modules:
            root.register_forward_pre_hook(self._root_pre_forward)
            root.register_forward_hook(self._root_post_forward)
            held_by_block: dict[nn.Module, list[Unit]] = {}  # submodule -> its block's units
            for name, module in root.named_modules():
                self._names.setdefault(module, name or type(module).__name__)
                in_block = module in blocks
                held = held_by_block.get(module, [])
                units = []
                for p in module.parameters(recurse=in_block):
                    unit = owner_of.get(id(p))
                    if unit is not None and unit not in units and unit not in held:
                        units.append(unit)
                if in_block:
                    held_by_block.update((m, held + units) for m in module.modules() if m is not module)
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

    def module_name(self, module: nn.Module) -> str:
        return self._names.get(module) or type(module).__name__

    def _hook(self, module: nn.Module) -> None:
        if module in self._module_id:
            return
        self._module_id[module] = len(self._hooked)
        self._hooked.append(module)
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)

    # --- hooks (kept out of torch.compile graphs: they gather, communicate and keep Python state) --
    @torch.compiler.disable
    def _root_pre_forward(self, module, args):
        if self.pass_key is None:  # outside a training step: an evaluation forward is one pass
            self.begin_pass(("eval", id(module)))

    @torch.compiler.disable
    def _root_post_forward(self, module, args, output):
        if self.pass_key == ("eval", id(module)):
            self.end_pass()

    @torch.compiler.disable
    def _pre_forward(self, module, args):
        units = self.units_of(module)
        for unit in units:
            self.refs[unit.index] = self.refs.get(unit.index, 0) + 1
        self._use(module, units)

    @torch.compiler.disable
    def _post_forward(self, module, args, output):
        for unit in self.units_of(module):
            self._drop(unit)
        if not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor):
            return OnBackward.apply(self.before_backward, module, output)[0] if output.requires_grad else output
        leaves, spec = pytree.tree_flatten(output)
        for leaf in leaves:
            if not isinstance(leaf, (torch.Tensor, *_PLAIN_LEAVES)):
                raise UsageError(
                    f"ZeRO-3: module {self.module_name(module)!r} returned a {type(leaf).__name__} inside "
                    f"its output, which stage 3 cannot look into to re-gather the module's parameters "
                    f"for backward; return tensors in tuples/lists/dicts/namedtuples, or register "
                    f"{type(leaf).__name__} with torch.utils._pytree.register_pytree_node"
                )
        grad_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not grad_at:
            return output
        wrapped = OnBackward.apply(self.before_backward, module, *(leaves[i] for i in grad_at))
        for i, tensor in zip(grad_at, wrapped):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, spec)

    @torch.compiler.disable
    def before_backward(self, module: nn.Module) -> None:
        """A module's backward is about to run: its units are held until their gradients are in."""
        units = self.units_of(module)
        holds = self.backward_holds.setdefault(self.ticket, set())
        for unit in units:
            if unit.index not in holds:
                holds.add(unit.index)
                self.refs[unit.index] = self.refs.get(unit.index, 0) + 1
        self._use(module, units)

    def grads_done(self, unit: Unit) -> None:
        """The unit's gradients are all in: its last use in this backward is over."""
        holds = self.backward_holds.get(self.ticket, set())
        if unit.index in holds:
            holds.discard(unit.index)
            self._drop(unit)
        elif not self.keep_all and unit.index not in self.refs:
            self.maybe_release(unit)

    def end_ticket(self, ticket) -> None:
        """A split backward's W for `ticket` is over: the units its B held and no gradient let go
        (none of theirs came) are let go now."""
        for index in sorted(self.backward_holds.pop(ticket, ())):
            self._drop(self.unit_storage.units[index])

    def _drop(self, unit: Unit) -> None:
        count = self.refs.get(unit.index, 0) - 1
        if count > 0:
            self.refs[unit.index] = count
            return
        self.refs.pop(unit.index, None)
        if not self.keep_all:
            self.maybe_release(unit)

    # --- use, prefetch, release ---------------------------------------------------------------
    def _use(self, module: nn.Module, units: list[Unit]) -> None:
        """Makes `units` available now (records the use, prefetches what the trace says comes next)."""
        for unit in units:
            self._record(unit, module)
        missing = [u for u in units if u.status is ParamStatus.NOT_AVAILABLE]
        self._make_room(sum(u.total for u in missing))
        for unit in missing:
            self._start_gather(unit, needed_now=True)
        self._prefetch()
        adaptive = self.adaptive if self.pass_key == "train" else None
        waiting = adaptive is not None and any(u.status is ParamStatus.INFLIGHT for u in units)
        started = adaptive.before_wait() if waiting else None
        for unit in units:
            self.unit_storage.wait_gather(unit)
        if waiting:
            adaptive.after_wait(started)

    def _record(self, unit: Unit, module: nn.Module) -> None:
        trace = self.traces.get(self.pass_key)
        if trace is not None:
            if self.position < len(trace.order) and trace.order[self.position] == unit.index:
                self.position += 1
                return
            warnings.warn(
                f"ZeRO-3: module order changed at use {self.position} (unit {unit.name}); "
                f"re-recording the prefetch trace on the next step",
                stacklevel=3,
            )
            del self.traces[self.pass_key]
            if self.adaptive is not None and self.pass_key == "train":
                self.adaptive.dropped_trace()
        if self.recording is not None:
            self._agree_on_use(unit.index, self._module_id[module])
            self.recording.append(unit.index)
        self.position += 1

    def _agree_on_use(self, unit_index: int, module_id: int) -> None:
        """Recording pass: every shard rank must be at the same unit now; else all raise, naming it."""
        shard = self.unit_storage.groups.shard
        if shard.size == 1:
            return
        mine = torch.tensor([unit_index, module_id], dtype=torch.int64, device=self.unit_storage.device)
        everyone = torch.empty(2 * shard.size, dtype=torch.int64, device=self.unit_storage.device)
        comm.all_gather(everyone, mine, shard)
        uses = host_read.read(
            everyone.view(shard.size, 2),
            "stage-3 use agreement",
            healthy=lambda: [[unit_index, module_id]] * shard.size,
        )
        other = next((r for r, (u, _) in enumerate(uses) if u != unit_index), None)
        if other is not None:
            raise RuntimeError(
                f"ZeRO-3: ranks of the shard group diverge at use {self.position} of "
                f"{_pass_name(self.pass_key)}: this rank (shard rank {shard.rank}) "
                f"{self._describe(unit_index, module_id)}, shard rank {other} {self._describe(*uses[other])}; "
                f"every rank must run the same modules in the same order (rank-dependent control flow? a "
                f"mixture-of-experts block whose experts may get no tokens on a rank must be a leaf module: "
                f"zero_optimization.leaf_module, or set_z3_leaf_modules for your own model)"
            )

    def _describe(self, unit_index: int, module_id: int) -> str:
        if unit_index == _END_OF_PASS:
            return "has ended the pass"
        if not (0 <= unit_index < len(self.unit_storage.units) and 0 <= module_id < len(self._hooked)):
            return f"uses unit #{unit_index} in module #{module_id} (its model differs from this rank's)"
        return (
            f"uses unit {self.unit_storage.units[unit_index].name!r} in module "
            f"{self.module_name(self._hooked[module_id])!r}"
        )

    def _start_gather(self, unit: Unit, needed_now: bool) -> bool:
        """Issues the unit's all-gather within MAX_GATHERS_IN_FLIGHT: a gather needed now first
        waits for the oldest ones (they would finish before it anyway); a prefetch is not issued."""
        self._gathers = collections.deque(u for u in self._gathers if u.status is ParamStatus.INFLIGHT)
        while len(self._gathers) >= self.max_gathers_in_flight:
            if not needed_now:
                return False
            self.unit_storage.wait_gather(self._gathers.popleft())
        self.unit_storage.start_gather(unit)
        self._gathers.append(unit)
        self.peak_gathers_in_flight = max(self.peak_gathers_in_flight, len(self._gathers))
        return True

    def _prefetch(self) -> None:
        """Gathers ahead along the trace until `prefetch_bucket_size` elements lie ahead gathered or
        in flight (units already there count against it), never beyond max_live_parameters."""
        trace = self.traces.get(self.pass_key)
        budget = self.adaptive.budget if self.adaptive is not None else self.config.prefetch_bucket_size
        if trace is None or budget == 0:
            return
        seen = set(self.refs)
        for index in itertools.islice(trace.order, self.position, None):
            if index in seen:
                continue
            seen.add(index)
            unit = self.unit_storage.units[index]
            if unit.total > budget:
                break
            budget -= unit.total
            if unit.status is ParamStatus.NOT_AVAILABLE:
                if self.unit_storage.live_numel + unit.total > self.config.max_live_parameters:
                    break
                if not self._start_gather(unit, needed_now=False):
                    break

    def maybe_release(self, unit: Unit) -> None:
        if unit.index in self.refs or unit.status is ParamStatus.NOT_AVAILABLE:
            return
        if (
            self._next_use_distance(unit) <= self.config.max_reuse_distance
            and self.unit_storage.live_numel <= self.config.max_live_parameters
        ):
            return
        self.unit_storage.release(unit)

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
        for unit in self.unit_storage.units:
            if self.unit_storage.live_numel + needed <= limit:
                break
            if unit.index not in self.refs and unit.status is not ParamStatus.NOT_AVAILABLE:
                self.unit_storage.release(unit)

    # --- pass boundaries ----------------------------------------------------------------------
    def begin_pass(self, key) -> None:
        """Starts a training step ("train") or an evaluation forward; records a trace if none."""
        self.pass_key, self.position = key, 0
        self.recording = [] if key not in self.traces else None
        if key == "train" and self.adaptive is not None:
            self.adaptive.begin_pass(traced=self.recording is None)

    def end_pass(self) -> None:
        """Ends the pass: keeps a freshly recorded trace once every shard rank is seen to end it here
        too (a rank with more uses fails the check, not a gather), and releases every unit."""
        if self.pass_key == "train" and self.adaptive is not None:
            self.adaptive.end_pass()  # on every rank at every training pass (a collective)
        try:
            if self.recording is not None:
                self._agree_on_use(_END_OF_PASS, _END_OF_PASS)
                if self.recording:
                    self.traces[self.pass_key] = Trace(self.recording, [u.total for u in self.unit_storage.units])
        finally:
            self.pass_key, self.recording, self.position = None, None, 0
            self.refs.clear()
            self.backward_holds.clear()
            for unit in self.unit_storage.units:
                self.unit_storage.release(unit)
            self._gathers.clear()

    def trace_names(self, key="train") -> list[str]:
        trace = self.traces.get(key)
        return [self.unit_storage.units[i].name for i in trace.order] if trace else []


def _pass_name(key) -> str:
    return "the training step" if key == "train" else "an evaluation forward"
