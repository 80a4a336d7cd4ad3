"""ZeRO stage 3 storage: each module's non-persistent parameters form a unit, one bucket of the
flat layout partitioned over the shard group (rank r holds chunk r of every unit).

A `PartitionedStorage` whose weights exist in full only while gathered: the resident per-rank state
is this rank's chunk of every unit, packed into one low-precision partition (and the fp32 master,
Adam moments and gradient partition of the base class). Owns gathering and releasing a unit's full
parameters and collecting its gradients for reduction. Deciding *when* to gather is coordinator.py's
job. Gathers use their own communicator (`ZeroGroups.shard_gather`), so a prefetch does not wait
behind the gradient reductions queued on the shard group.

A released parameter's `.data` is an empty tensor, so any use before gathering fails with a shape
error instead of reading stale memory; the unit's full buffer keeps its tensor object but its storage
is resized to zero, so views that autograd saved during forward stay valid once it is re-gathered.

With `offload_param` the low-precision partition lives in a home off the device (param_offload.py:
host memory or per-unit files): `param_chunk` is then the home's host chunk, which the optimizer
step, checkpoints and inspection write in place, and `device_chunk` brings a unit's chunk to the
device for its gather (issued at prefetch time, nvme files read ahead along the last step's order).
"""

from __future__ import annotations

import contextlib
import enum

import torch
from torch import nn

from megazero.core import comm
from megazero.core.kernels import resize_storage
from megazero.core.streams import Event, label
from ..config import ZeroConfig
from ..flat import Bucket, FlatLayout
from ..zero_groups import ZeroGroups
from .param_gather import ParamGather
from .param_offload import GatherOrder, make_param_home
from ..precision import Precision, take_grad
from ..quantized_comm import quantized_gradient_reducer
from ..storage import PartitionedStorage, ReductionQueue
from ..tensor_memory import drop_storage, ensure_storage
from megazero.models.param_info import carry_param_info, param_info


class ParamStatus(enum.Enum):
    NOT_AVAILABLE = 1  # holds only this rank's partition
    INFLIGHT = 2  # an async all-gather is on its way
    AVAILABLE = 3  # full parameter present


class Unit:
    def __init__(self, index: int, name: str, params: list[nn.Parameter], first: int, bucket: Bucket, dtype, device):
        self.index, self.name, self.params, self.first = index, name, params, first
        self.numels = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.total = bucket.size  # padded: a multiple of the shard count
        self.part_size = bucket.chunk
        self.part_offset = bucket.local_offset
        self.full = label(
            torch.empty(self.total, dtype=dtype, device=device), f"stage-3 unit {name!r}, gathered parameters"
        )
        resize_storage(self.full.untyped_storage(), 0)
        self.status = ParamStatus.NOT_AVAILABLE
        self.handle: comm.Handle | None = None
        self.grad_staging: torch.Tensor | None = None
        self.grad_pending = 0


class UnitStorage(PartitionedStorage):
    weights_always_full = False

    def __init__(
        self,
        units_params: list[tuple[str, list[nn.Parameter]]],
        groups: ZeroGroups,
        precision: Precision,
        device,
        queue: ReductionQueue,
        reduce_scatter: bool = True,
        streams=None,
        zero: ZeroConfig | None = None,
    ):
        shard = groups.shard
        layout = FlatLayout.of_groups(
            [[p.numel() for p in params] for _, params in units_params], shard.size, shard.rank
        )
        zero = zero if zero is not None else ZeroConfig(stage=3)
        super().__init__(
            layout,
            shard,
            precision,
            device,
            queue,
            reduce_scatter,
            streams=streams,
            state_device="cpu" if zero.offloads_optimizer else None,
        )
        self.groups = groups
        self.zero = zero
        self.quantized_reduce = quantized_gradient_reducer(groups) if self.zero.zero_quantized_gradients else None
        # Marks the last write of the partition on the compute stream (the optimizer step): a
        # prefetch on its own stream waits for that, not for all the compute queued since.
        self.partition_ready = Event(self.device)
        self.units: list[Unit] = []
        first = 0
        for name, params in units_params:
            unit = Unit(
                len(self.units),
                name,
                params,
                first,
                layout.buckets[len(self.units)],
                precision.param_dtype,
                self.device,
            )
            self.units.append(unit)
            first += len(params)
        self.shapes = [shape for unit in self.units for shape in unit.shapes]
        self.partition_size = layout.partition_size
        # Offloaded: the device keeps an empty partition (for its dtype); the home holds the values.
        self.home, self.fetch_order, self._on_device = None, GatherOrder(), None
        if self.zero.offloads_params:
            chunks = [(b.local_offset, b.chunk) for b in layout.buckets]
            self.home = make_param_home(
                self.zero.offload_param,
                chunks,
                precision.param_dtype,
                self.device,
                self.streams,
                shard.ranks[shard.rank],
            )
        size = 0 if self.home is not None else layout.partition_size
        self.partition = label(
            torch.zeros(size, dtype=precision.param_dtype, device=self.device), "stage-3 parameter partition"
        )
        self.grad_part = label(
            torch.zeros(layout.partition_size, dtype=precision.grad_accum_dtype, device=self.device),
            "stage-3 gradient partition",
        )
        drop_storage(self.grad_part)
        self.placeholder = torch.empty(0, dtype=precision.param_dtype, device=self.device)
        self.live_numel = 0  # elements of full parameters held (AVAILABLE or INFLIGHT)
        self.peak_live_numel = 0
        self.param_gather = ParamGather(
            groups, self.zero, [u.total for u in self.units], precision.param_dtype, self.device, self.streams
        )

    @property
    def param_chunks_stay(self) -> bool:
        return self.home is None

    def param_chunk(self, b: int) -> torch.Tensor:
        if self.home is None:
            return self._part(self.partition, b)
        if self._on_device is not None:
            return self._device_copy(b)
        return self.home.host_chunk(b)

    def device_chunk(self, unit: Unit) -> torch.Tensor:
        """This rank's chunk of `unit` on the device, the source of its gather. Offloaded, the copy
        runs on the copy stream (the current stream waits for it); an nvme home also starts reading
        the files of the units that followed this one last step."""
        if self.home is None:
            return self.param_chunk(unit.index)
        for b in self.fetch_order.next_after(unit.index, getattr(self.home, "capacity", 1) - 1):
            self.home.prefetch(b)
        return label(
            self.home.to_device(unit.index),
            f"stage-3 unit '{unit.name}': this rank's chunk, copied from its offload home",
        )

    @contextlib.contextmanager
    def _chunks_on_device(self, write_back: bool):
        """Inside, `param_chunk(b)` is a device copy of the home's chunk, one bucket at a time (the
        previous one is written back, when `write_back`, as the next is asked for, and at exit): for
        the fp32 step of a device optimizer, and for collectives over the weights."""
        if self.home is None or self.device.type == "cpu":
            yield
            return
        self._on_device = [None, None, write_back]
        try:
            yield
        finally:
            self._release_device_copy()
            self._on_device = None

    def _device_copy(self, b: int) -> torch.Tensor:
        held = self._on_device
        if held[0] != b:
            self._release_device_copy()
            held[0], held[1] = b, self.home.to_device(b)
        return held[1]

    def _release_device_copy(self) -> None:
        b, chunk, write_back = self._on_device
        if chunk is not None and write_back:
            self.home.host_chunk(b).copy_(chunk)
        self._on_device[:2] = [None, None]

    def grad_chunk(self, b: int) -> torch.Tensor:
        return self._part(self.grad_part, b)

    def full_shape(self, i: int) -> torch.Size:
        return self.shapes[i]

    def unit_slice(self, tensor: torch.Tensor, unit: Unit) -> torch.Tensor:
        return self._part(tensor, unit.index)

    # --- construction -----------------------------------------------------------------------
    def materialize(self, init_fn) -> dict[int, nn.Parameter]:
        """Fills partitions from init_fn(param), one full parameter at a time (only for parameters
        this rank holds a piece of); returns a map from id(old parameter) to its new, released
        Parameter."""
        replaced = {}
        for unit in self.units:
            new_params = []
            for j, p in enumerate(unit.params):
                i = unit.first + j
                piece = self.layout.local_piece(i)
                if piece is not None:
                    value = init_fn(p).reshape(-1)
                    part_off, param_off, length = piece
                    rel = part_off - unit.part_offset
                    self.param_chunk(unit.index)[rel : rel + length].copy_(value[param_off : param_off + length])
                    self._write_initial_piece(i, value)
                new = nn.Parameter(self.placeholder, requires_grad=p.requires_grad)
                carry_param_info(p, new, zero_unit=unit, zero_index=j, zero_full_shape=p.shape)
                replaced[id(p)] = new
                new_params.append(new)
            unit.params = new_params
        if self.home is not None:
            self.home.flush()
        self.partition_ready.record()
        self.params = [p for unit in self.units for p in unit.params]
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        return replaced

    # --- gather / release ---------------------------------------------------------------------
    def start_gather(self, unit: Unit) -> None:
        if unit.status is not ParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"unit {unit.name} is {unit.status.name}; a second gather was requested")
        with self.streams.prefetch:
            self.partition_ready.wait()
            resize_storage(unit.full.untyped_storage(), unit.total * unit.full.element_size())
            # The backend's writes bump the buffer's version counter; autograd saved views of it
            # during forward must not see that as an in-place change, so it is restored after.
            keep_version = torch.autograd._unsafe_preserve_version_counter(unit.full)
            handle = self.param_gather.start(unit, self.device_chunk(unit))
        unit.handle = comm.Handle([handle], then=lambda: self._gathered(unit, keep_version))
        unit.status = ParamStatus.INFLIGHT
        self.live_numel += unit.total
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _gathered(self, unit: Unit, keep_version) -> None:
        keep_version.__exit__(None, None, None)
        # Allocated on the prefetch stream, read by the compute stream until released.
        self.streams.prefetch.keep_alive(unit.full)
        for p, off, n, shape in zip(unit.params, unit.offsets, unit.numels, unit.shapes):
            p.data = unit.full[off : off + n].view(shape)
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
        resize_storage(unit.full.untyped_storage(), 0)
        unit.status = ParamStatus.NOT_AVAILABLE
        self.live_numel -= unit.total

    # --- gradients ----------------------------------------------------------------------------
    def start_backward(self) -> None:
        for unit in self.units:
            unit.grad_pending = sum(p.requires_grad for p in unit.params)

    def add_grad(self, param: nn.Parameter) -> bool:
        """Moves param.grad into its unit's staging buffer; True when the unit's gradients are all in."""
        info = param_info(param)
        unit, j = info.zero_unit, info.zero_index
        if unit.grad_staging is None:
            unit.grad_staging = self.new_staging(unit.index)
        unit.grad_staging[unit.offsets[j] : unit.offsets[j] + unit.numels[j]].copy_(take_grad(param).reshape(-1))
        unit.grad_pending -= 1
        return unit.grad_pending == 0

    def reduce_grads(self, unit: Unit) -> None:
        """Reduces the unit's staged gradients into (or onto) its gradient partition."""
        self.ensure_grads()
        staging, unit.grad_staging = unit.grad_staging, None
        if staging is None:
            staging = self.new_staging(unit.index)
        unit.grad_pending = -1  # reduced for this backward
        self.reduce_bucket(unit.index, staging)

    def ensure_grads(self) -> None:
        """The gradient partition exists from the step's first reduction to the optimizer step."""
        ensure_storage(self.grad_part)

    def finish_gradients(self) -> None:
        """After the queue's wait: MiCS replicas summed."""
        self.ensure_grads()
        comm.all_reduce(self.grad_part, self.groups.replica)

    # --- optimizer ----------------------------------------------------------------------------
    def step(self, step: int, lr: float, config, grad_scale: float) -> None:
        # fp32 without a separate master: the offloaded weights are what Adam updates; a device
        # optimizer steps device copies of them, bucket by bucket.
        steps_copies = self.master is None and not self.zero.offloads_optimizer
        with self._chunks_on_device(write_back=True) if steps_copies else contextlib.nullcontext():
            super().step(step, lr, config, grad_scale)  # ends with after_step()
        if self.home is not None:
            self.home.flush()  # the updated chunks are in their home
            self.fetch_order.end_step()

    def gathered(self, param: nn.Parameter, kind: str) -> torch.Tensor:
        with self._chunks_on_device(write_back=False):
            return super().gathered(param, kind)

    def after_step(self) -> None:
        self.partition_ready.record()
        self.param_gather.partition_changed()

    def write_full_weights(self, i: int, flat: torch.Tensor) -> None:
        super().write_full_weights(i, flat)
        self.partition_ready.record()
        self.param_gather.partition_changed()

    def wrote_weights(self, i: int, flat: torch.Tensor) -> None:
        self.partition_ready.record()
        self.param_gather.partition_changed()

    def refresh_low_precision(self, param: nn.Parameter) -> None:
        super().refresh_low_precision(param)
        self.partition_ready.record()
        self.param_gather.partition_changed()

    def zero_grad(self) -> None:
        # Between steps the gradient partition holds no memory (as FSDP frees sharded grads), so
        # the forward, where activations peak, runs without it.
        super().zero_grad()
        drop_storage(self.grad_part)
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    # --- accounting ---------------------------------------------------------------------------
    def staging_bytes(self) -> int:
        """Gradient staging buffers of units still collecting gradients (in-flight ones are the
        reduction queue's)."""
        return sum(self.nbytes(u.grad_staging) for u in self.units)

    def memory_bytes(self) -> dict[str, int]:
        offloaded = self.home.memory_bytes() if self.home is not None else {}
        return {
            "params": self.nbytes(self.partition),
            **offloaded,
            "grads": self.nbytes(self.grad_part),  # its size in backward (freed between steps)
            "live_params": self.live_numel * self.partition.element_size(),
            **self.param_gather.memory_bytes(),
            **super().memory_bytes(),
        }
