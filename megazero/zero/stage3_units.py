"""ZeRO stage 3 storage: each module's non-persistent parameters form a unit, partitioned over the
shard group as one padded flat buffer (rank r holds elements [r*P, (r+1)*P)).

Owns the resident per-rank state of all units, packed into contiguous tensors so the optimizer runs
over a few long segments: the low-precision partition, the fp32 master (aliasing the partition in
fp32 runs), Adam's moments and the gradient partition. Also owns gathering and releasing a unit's
full parameters and reducing its gradients. Deciding *when* to gather is stage3_gather's job.

A released parameter's `.data` is an empty tensor, so any use before gathering fails with a shape
error instead of reading stale memory; the unit's full buffer keeps its tensor object but its storage
is resized to zero, so views that autograd saved during forward stay valid once it is re-gathered.
"""
from __future__ import annotations

import enum

import torch
from torch import nn

from megazero import comm
from .adam import AdamConfig, adam_update
from .groups import Precision, ZeroGroups, drop_storage, ensure_storage, sum_of_squares


class ParamStatus(enum.Enum):
    NOT_AVAILABLE = 1     # holds only this rank's partition
    INFLIGHT = 2          # an async all-gather is on its way
    AVAILABLE = 3         # full parameter present


class Unit:
    def __init__(self, index: int, name: str, params: list[nn.Parameter], shards: int, rank: int,
                 part_offset: int, dtype, device):
        self.index, self.name, self.params = index, name, params
        self.numels = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.part_size = -(-self.numel // shards)
        self.total = self.part_size * shards
        self.rank = rank
        self.part_offset = part_offset
        self.full = torch.empty(self.total, dtype=dtype, device=device)
        self.full.untyped_storage().resize_(0)
        self.status = ParamStatus.NOT_AVAILABLE
        self.handle: comm.Handle | None = None
        self.grad_staging: torch.Tensor | None = None
        self.grad_pending = 0
        self.grad_fresh = True

    def piece(self, i: int) -> tuple[int, int, int] | None:
        """(offset in this rank's partition of the unit, offset in param i, length) or None."""
        lo, hi = self.rank * self.part_size, (self.rank + 1) * self.part_size
        start, end = max(lo, self.offsets[i]), min(hi, self.offsets[i] + self.numels[i])
        if start >= end:
            return None
        return start - lo, start - self.offsets[i], end - start


class UnitStore:
    def __init__(self, units_params: list[tuple[str, list[nn.Parameter]]], groups: ZeroGroups,
                 precision: Precision, device):
        self.groups, self.precision, self.device = groups, precision, device
        shard = groups.shard
        self.units: list[Unit] = []
        offset = 0
        for name, params in units_params:
            unit = Unit(len(self.units), name, params, shard.size, shard.rank, offset,
                        precision.param_dtype, device)
            self.units.append(unit)
            offset += unit.part_size
        self.partition_size = offset
        f32 = dict(dtype=torch.float32, device=device)
        self.partition = torch.zeros(offset, dtype=precision.param_dtype, device=device)
        self.master = torch.zeros(offset, **f32) if precision.mixed else self.partition
        self.exp_avg = torch.zeros(offset, **f32)
        self.exp_avg_sq = torch.zeros(offset, **f32)
        self.grad_part = torch.zeros(offset, dtype=precision.grad_dtype, device=device)
        drop_storage(self.grad_part)
        self.placeholder = torch.empty(0, dtype=precision.param_dtype, device=device)
        self.live_numel = 0           # elements of full parameters held (AVAILABLE or INFLIGHT)
        self.peak_live_numel = 0

    def unit_slice(self, tensor: torch.Tensor, unit: Unit) -> torch.Tensor:
        return tensor[unit.part_offset:unit.part_offset + unit.part_size]

    # --- construction -----------------------------------------------------------------------
    def materialize(self, init_fn) -> dict[int, nn.Parameter]:
        """Fills partitions from init_fn(param), one full parameter at a time; returns a map from
        id(old parameter) to its new, released Parameter."""
        replaced = {}
        for unit in self.units:
            new_params = []
            for i, p in enumerate(unit.params):
                piece = unit.piece(i)
                if piece is not None:
                    value = init_fn(p).reshape(-1)
                    part_off, param_off, length = piece
                    at = unit.part_offset + part_off
                    self.partition[at:at + length].copy_(value[param_off:param_off + length])
                    if self.master is not self.partition:
                        self.master[at:at + length].copy_(value[param_off:param_off + length])
                new = nn.Parameter(self.placeholder, requires_grad=p.requires_grad)
                new.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
                new.zero_unit, new.zero_index, new.zero_full_shape = unit, i, p.shape
                replaced[id(p)] = new
                new_params.append(new)
            unit.params = new_params
        return replaced

    # --- gather / release ---------------------------------------------------------------------
    def start_gather(self, unit: Unit) -> None:
        if unit.status is not ParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"unit {unit.name} is {unit.status.name}; a second gather was requested")
        unit.full.untyped_storage().resize_(unit.total * unit.full.element_size())
        # The backend's writes bump the buffer's version counter; autograd saved views of it during
        # forward and must not see that as an in-place change, so the counter is restored after.
        keep_version = torch.autograd._unsafe_preserve_version_counter(unit.full)
        handle = comm.all_gather(unit.full, self.unit_slice(self.partition, unit), self.groups.shard,
                                 async_op=True)
        unit.handle = comm.Handle([handle], then=lambda: self._gathered(unit, keep_version))
        unit.status = ParamStatus.INFLIGHT
        self.live_numel += unit.total
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _gathered(self, unit: Unit, keep_version) -> None:
        keep_version.__exit__(None, None, None)
        for p, off, n, shape in zip(unit.params, unit.offsets, unit.numels, unit.shapes):
            p.data = unit.full[off:off + n].view(shape)
        unit.status = ParamStatus.AVAILABLE

    def wait_gather(self, unit: Unit) -> None:
        if unit.status is ParamStatus.INFLIGHT:
            unit.handle.wait()
            unit.handle = None

    def release(self, unit: Unit) -> None:
        if unit.status is ParamStatus.NOT_AVAILABLE:
            return
        self.wait_gather(unit)
        for p in unit.params:
            p.data = self.placeholder
        unit.full.untyped_storage().resize_(0)
        unit.status = ParamStatus.NOT_AVAILABLE
        self.live_numel -= unit.total

    # --- gradients ----------------------------------------------------------------------------
    def start_backward(self) -> None:
        for unit in self.units:
            unit.grad_pending = sum(p.requires_grad for p in unit.params)

    def add_grad(self, param: nn.Parameter) -> bool:
        """Moves param.grad into its unit's staging buffer; True when the unit's gradients are all in."""
        unit, i = param.zero_unit, param.zero_index
        if unit.grad_staging is None:
            unit.grad_staging = torch.zeros(unit.total, dtype=self.precision.grad_dtype, device=self.device)
        unit.grad_staging[unit.offsets[i]:unit.offsets[i] + unit.numels[i]].copy_(param.grad.reshape(-1))
        param.grad = None
        unit.grad_pending -= 1
        return unit.grad_pending == 0

    def reduce_grads(self, unit: Unit, inflight: list) -> None:
        """Reduce-scatters the unit's gradients into (or onto) its gradient partition; appends
        (handle, staged elements) to `inflight` (the staging buffer lives until the handle is waited)."""
        self.ensure_grads()
        staging, unit.grad_staging = unit.grad_staging, None
        if staging is None:
            staging = torch.zeros(unit.total, dtype=self.precision.grad_dtype, device=self.device)
        unit.grad_pending = -1             # reduced for this backward
        target = self.unit_slice(self.grad_part, unit)
        if unit.grad_fresh:
            handle = comm.reduce_scatter(target, staging, self.groups.shard, async_op=True)
            inflight.append((comm.Handle([handle], then=lambda s=staging: None), unit.total))
        else:
            out = torch.empty_like(target)
            handle = comm.reduce_scatter(out, staging, self.groups.shard, async_op=True)
            inflight.append((comm.Handle([handle], then=lambda t=target, o=out, s=staging: t.add_(o)),
                             unit.total))
        unit.grad_fresh = False

    # --- optimizer ----------------------------------------------------------------------------
    def plan_segments(self, weight_decay_of, counted) -> None:
        """Splits the packed partition into runs of equal weight decay (padding joins its neighbour)
        and lists the ranges whose gradients count in the global norm."""
        runs: list[list] = []
        self.norm_ranges: list[tuple[int, int]] = []
        for unit in self.units:
            cursor = unit.part_offset
            end = unit.part_offset + unit.part_size
            for i, p in enumerate(unit.params):
                piece = unit.piece(i)
                if piece is None:
                    continue
                lo = unit.part_offset + piece[0]
                hi = lo + piece[2]
                wd = weight_decay_of(p)
                if runs and runs[-1][2] == wd and runs[-1][1] == cursor:
                    runs[-1][1] = hi
                else:
                    runs.append([cursor, hi, wd])
                cursor = hi
                if counted(p):
                    if self.norm_ranges and self.norm_ranges[-1][1] == lo:
                        self.norm_ranges[-1] = (self.norm_ranges[-1][0], hi)
                    else:
                        self.norm_ranges.append((lo, hi))
            if cursor < end:              # padding: zero gradients, updates stay zero
                if runs and runs[-1][1] == cursor:
                    runs[-1][1] = end
                else:
                    runs.append([cursor, end, 0.0])
        self.segments = [tuple(r) for r in runs]

    def grad_sumsq(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for lo, hi in self.norm_ranges:
            total += sum_of_squares(self.grad_part[lo:hi])
        return total

    def has_inf_or_nan(self) -> bool:
        return not bool(torch.isfinite(self.grad_part).all())

    def step(self, step: int, lr: float, config: AdamConfig, grad_scale: float) -> None:
        for lo, hi, wd in self.segments:
            adam_update(self.master[lo:hi], self.grad_part[lo:hi], self.exp_avg[lo:hi],
                        self.exp_avg_sq[lo:hi], step=step, lr=lr, config=config, weight_decay=wd,
                        grad_scale=grad_scale)
        if self.master is not self.partition:
            self.partition.copy_(self.master)

    def ensure_grads(self) -> None:
        """The gradient partition exists from the step's first reduction to the optimizer step."""
        ensure_storage(self.grad_part)

    def zero_grad(self) -> None:
        # Between steps the gradient partition holds no memory (as FSDP frees sharded grads), so
        # the forward, where activations peak, runs without it.
        drop_storage(self.grad_part)
        for unit in self.units:
            unit.grad_fresh = True
            for p in unit.params:
                p.grad = None

    # --- inspection (see megazero.zero.inspect) ---------------------------------------------
    def _kind_tensor(self, kind: str) -> torch.Tensor:
        return {"fp32": self.master, "grad": self.grad_part, "exp_avg": self.exp_avg,
                "exp_avg_sq": self.exp_avg_sq}[kind]

    def local_view(self, param: nn.Parameter, kind: str) -> torch.Tensor:
        unit, i = param.zero_unit, param.zero_index
        piece = unit.piece(i)
        tensor = self._kind_tensor(kind)
        if piece is None:
            return tensor[:0]
        at = unit.part_offset + piece[0]
        return tensor[at:at + piece[2]]

    def gathered(self, param: nn.Parameter, kind: str) -> torch.Tensor:
        unit, i = param.zero_unit, param.zero_index
        part = self.unit_slice(self._kind_tensor(kind), unit).contiguous()
        whole = part.new_empty(unit.total)
        comm.all_gather(whole, part, self.groups.shard)
        piece = whole[unit.offsets[i]:unit.offsets[i] + unit.numels[i]].view(unit.shapes[i])
        return piece.to(torch.float32, copy=True)

    def write_full(self, param: nn.Parameter, kind: str, value: torch.Tensor) -> None:
        unit, i = param.zero_unit, param.zero_index
        piece = unit.piece(i)
        if piece is None:
            return
        flat = value.detach().reshape(-1)[piece[1]:piece[1] + piece[2]]
        self.local_view(param, kind).copy_(flat)
        if kind == "fp32" and self.master is not self.partition:
            at = unit.part_offset + piece[0]
            self.partition[at:at + piece[2]].copy_(flat)

    def refresh_low_precision(self, param: nn.Parameter) -> None:
        """After a local fp32 write: the 16-bit partition follows (used from the next gather)."""
        if self.master is not self.partition:
            self.local_view(param, "fp32")   # validates
            unit, piece = param.zero_unit, param.zero_unit.piece(param.zero_index)
            if piece is not None:
                at = unit.part_offset + piece[0]
                self.partition[at:at + piece[2]].copy_(self.master[at:at + piece[2]])

    def staging_bytes(self) -> int:
        """Gradient staging buffers of units still collecting gradients (in-flight ones are the
        engine's to count: it holds their handles)."""
        return sum(u.grad_staging.numel() * u.grad_staging.element_size()
                   for u in self.units if u.grad_staging is not None)

    def memory_bytes(self) -> dict[str, int]:
        def nbytes(t):
            return t.numel() * t.element_size()
        return {
            "params": nbytes(self.partition),
            "grads": nbytes(self.grad_part),      # its size in backward (it is freed between steps)
            "master": 0 if self.master is self.partition else nbytes(self.master),
            "optimizer_states": nbytes(self.exp_avg) + nbytes(self.exp_avg_sq),
            "live_params": self.live_numel * self.partition.element_size(),
        }
