"""Where a storage's optimizer states live, and moving them: ZeRO-Offload and the engine's
offload_states / reload_states.

`OptimizerOffload` (the `offload_optimizer` config, stages 1-3): the fp32 master and both Adam
moments of one `PartitionedStorage` live in host memory (device "cpu") or in swap files under
`nvme_path` (device "nvme", swap.py), and the step runs on the CPU: sub-group by sub-group
(`sub_group_size` elements of the partition), the reduced gradients are copied to a host buffer,
the CPU Adam updates the host states (writing the bf16/fp16 copy in the same pass), and the updated
weights are copied back into the device chunks. For nvme, reading sub-group k+1 overlaps the step
of k (`pipeline_read`) and writing k overlaps the next (`pipeline_write`). Even where the device
is the CPU, the host states are tensors of their own and every move is an explicit copy, so the
path a GPU run takes is the one the CPU tests take.

`HostCopies` (engine.offload_states): named states (DeepSpeed's OffloadStateTypeEnum names) moved
to host memory and back, bitwise. A moved tensor keeps its identity (its storage is emptied, as
`drop_storage` does), so every view of it, parameters included, is valid again after the reload.

Owns no policy of when to step or gather; the storage calls `step`, the engine calls the rest.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from megazero.core.errors import UsageError
from megazero.core.kernels import resize_storage
from megazero.core.streams import Event
from megazero.ops.adam import adam_update, lr_of
from .config import ZeroConfig
from .tensor_memory import drop_storage
from .swap import SubGroupSwapper
from .zero_groups import ZeroGroups

OFFLOADED_KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def sub_group_bounds(numel: int, sub_group_size: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of the partition's sub-groups (at least one, possibly empty)."""
    return [(s, min(s + sub_group_size, numel)) for s in range(0, max(numel, 1), sub_group_size)]


def partition_range(storage, kind: str, start: int, end: int) -> torch.Tensor:
    """A host copy of partition elements [start, end) of `kind`, in the kind's dtype, assembled from
    the bucket chunks (stage 0/1 chunks are not contiguous in the flat buffer)."""
    out = torch.empty(end - start, dtype=storage.precision.state_dtype(kind), device="cpu")
    for b, bucket in enumerate(storage.layout.buckets):
        lo, hi = max(start, bucket.local_offset), min(end, bucket.local_offset + bucket.chunk)
        if lo < hi:
            chunk = storage.chunk(kind, b)
            out[lo - start : hi - start].copy_(chunk[lo - bucket.local_offset : hi - bucket.local_offset])
    return out


def resident_sub_groups(count: int, ratio: float) -> int:
    """How many of the `count` sub-groups keep their states on the device under offload `ratio`:
    DeepSpeed offloads sub-group k when k >= int((1 - ratio) * count), so the first ones stay (the
    tiny epsilon keeps 0.9 * 10 from rounding down to 8.99...)."""
    return min(count, int((1.0 - ratio) * count + 1e-9))


class OptimizerOffload:
    """The fp32 master and Adam moments of one storage, off the device (see module docstring).

    With `ratio` < 1 (stage 3's partial offload) the first `resident` sub-groups, elements
    [0, split) of the partition, keep their states on the device and are stepped there; the rest
    [split, partition) are offloaded. A view that crosses `split` (or any view, for nvme) is served
    from a host cache written back before the next step."""

    def __init__(
        self, storage, config, sub_group_size: int, folder: Path | None, name: str, cpu_threads: int | None = None
    ):
        self.device_kind = config.device  # "cpu" | "nvme"
        self.cpu_threads = cpu_threads  # the CPU Adam's threads (None: torch's count)
        size = storage.layout.partition_size
        self.bounds = sub_group_bounds(size, sub_group_size)
        self.resident = resident_sub_groups(len(self.bounds), config.ratio)
        self.split = self.bounds[self.resident][0] if self.resident < len(self.bounds) else size
        pin = config.pin_memory and storage.device.type == "cuda"
        longest = max(e - s for s, e in self.bounds)
        # Each kind keeps its dtype in every tier: the moments may be bf16 (--exp-avg-dtype ...).
        self.dtypes = {kind: storage.precision.state_dtype(kind) for kind in OFFLOADED_KINDS}
        # Host staging of one sub-group: the reduced gradients in, the updated 16-bit weights out.
        host = dict(device="cpu", pin_memory=pin)
        self.grad_buffer = torch.empty(longest, dtype=storage.precision.grad_accum_dtype, **host)
        self.lp_buffer = (
            torch.empty(longest, dtype=storage.precision.param_dtype, **host) if storage.precision.mixed else None
        )
        # Device<->host copies are issued without blocking and waited once per batch of them.
        self.copied = Event(storage.device)
        self.on_device = {
            kind: partition_range(storage, kind, 0, self.split).to(storage.device) for kind in OFFLOADED_KINDS
        }
        self.host: dict[str, torch.Tensor] | None = None
        self.swapper: SubGroupSwapper | None = None
        self._cache: tuple[int, int, dict[str, torch.Tensor]] | None = None
        offloaded = [(s - self.split, e - self.split) for s, e in self.bounds[self.resident :]]
        if self.device_kind == "cpu":
            self.host = {
                kind: torch.empty(size - self.split, dtype=self.dtypes[kind], pin_memory=pin, device="cpu")
                for kind in OFFLOADED_KINDS
            }
            for s, e in offloaded:
                for kind in OFFLOADED_KINDS:
                    self.host[kind][s:e].copy_(partition_range(storage, kind, s + self.split, e + self.split))
        elif offloaded:
            self.swapper = SubGroupSwapper(
                folder,
                name,
                OFFLOADED_KINDS,
                offloaded,
                buffer_count=config.buffer_count,
                pipeline_read=config.pipeline_read,
                pipeline_write=config.pipeline_write,
                pin_memory=pin,
                dtypes=self.dtypes,
            )
            for k, (s, e) in enumerate(offloaded):
                self.swapper.write_initial(
                    k,
                    {kind: partition_range(storage, kind, s + self.split, e + self.split) for kind in OFFLOADED_KINDS},
                )

    # --- values of record, for checkpoints and inspection -----------------------------------------
    def view(self, kind: str, start: int, length: int) -> torch.Tensor:
        """Partition elements [start, start + length) of `kind` as a writable tensor (a device one
        for the resident part). A view the cache serves (nvme, or one crossing `split`) is a view of
        a host copy of the covering sub-groups; writes reach the states when the cache is flushed
        (before the next step, or when another range is asked for), so use it at once."""
        if length == 0:
            return torch.empty(0, dtype=self.dtypes[kind], device="cpu")
        end = start + length
        direct = None
        if end <= self.split:
            direct = self.on_device[kind][start:end]
        elif start >= self.split and self.host is not None:
            direct = self.host[kind][start - self.split : end - self.split]
        if direct is not None:
            if self._cache is not None and start < self._cache[1] and self._cache[0] < end:
                self.flush_cache()  # the cache's copy of these elements would overwrite them
            return direct
        if self._cache is None or not (self._cache[0] <= start and end <= self._cache[1]):
            self.flush_cache()
            self._load_cache(start, end)
        lo = self._cache[0]
        return self._cache[2][kind][start - lo : end - lo]

    def _covering(self, start: int, end: int) -> list[int]:
        return [k for k, (s, e) in enumerate(self.bounds) if s < end and start < e]

    def _load_cache(self, start: int, end: int) -> None:
        ks = self._covering(start, end)
        lo, hi = self.bounds[ks[0]][0], self.bounds[ks[-1]][1]
        cache = {kind: torch.empty(hi - lo, dtype=self.dtypes[kind], device="cpu") for kind in OFFLOADED_KINDS}
        for k in ks:
            s, e = self.bounds[k]
            for kind in OFFLOADED_KINDS:
                if k < self.resident:
                    cache[kind][s - lo : e - lo].copy_(self.on_device[kind][s:e])
                elif self.host is not None:
                    cache[kind][s - lo : e - lo].copy_(self.host[kind][s - self.split : e - self.split])
                else:
                    self.swapper.files[kind].read(k - self.resident, cache[kind][s - lo :])
        self._cache = (lo, hi, cache)

    def flush_cache(self) -> None:
        """Writes the cached sub-groups back (to swap files only those whose values changed, which
        the CRC tells), then drops the cache."""
        if self._cache is None:
            return
        lo, hi, cache = self._cache
        self._cache = None
        for k in self._covering(lo, hi):
            s, e = self.bounds[k]
            for kind in OFFLOADED_KINDS:
                piece = cache[kind][s - lo : e - lo]
                if k < self.resident:
                    self.on_device[kind][s:e].copy_(piece)
                elif self.host is not None:
                    self.host[kind][s - self.split : e - self.split].copy_(piece)
                else:
                    self.swapper.files[kind].write_if_changed(k - self.resident, piece)

    # --- the step ---------------------------------------------------------------------------------
    def _pieces(self, storage) -> list[list[tuple]]:
        """Per sub-group: (bucket, lo, hi, weight decay, offset in the sub-group, lr group) of each
        run of the storage's plan, clipped to the sub-group."""
        out = [[] for _ in self.bounds]
        for b, lo, hi, wd, group in storage.runs:
            base = storage.layout.buckets[b].local_offset
            for k, (s, e) in enumerate(self.bounds):
                a, c = max(base + lo, s), min(base + hi, e)
                if a < c:
                    out[k].append((b, a - base, c - base, wd, a - s, group))
        return out

    def _fetch(self, k: int) -> dict[str, torch.Tensor]:
        s, e = self.bounds[k]
        if k < self.resident:
            return {kind: self.on_device[kind][s:e] for kind in OFFLOADED_KINDS}
        if self.host is not None:
            return {kind: self.host[kind][s - self.split : e - self.split] for kind in OFFLOADED_KINDS}
        return self.swapper.fetch(k - self.resident)

    def step(self, storage, step: int, lr, config, grad_scale: float) -> None:
        """Adam on the resident sub-groups on the device, then on the offloaded ones on the host,
        sub-group by sub-group; the device weights follow. On a GPU the resident part's kernels are
        only queued before the host part starts, so the two run at the same time."""
        self.flush_cache()
        pieces = self._pieces(storage)
        for k in range(self.resident):
            states = self._fetch(k)
            for b, lo, hi, wd, at, group in pieces[k]:
                r = slice(at, at + hi - lo)
                adam_update(
                    states["fp32"][r],
                    storage.grad_chunk(b)[lo:hi],
                    states["exp_avg"][r],
                    states["exp_avg_sq"][r],
                    step=step,
                    lr=lr_of(lr, group),
                    config=config,
                    weight_decay=wd,
                    grad_scale=grad_scale,
                    param_copy=storage.param_chunk(b)[lo:hi],
                )
        swapper = self.swapper
        try:
            if swapper is not None:
                swapper.prefetch(0)
            for k in range(self.resident, len(self.bounds)):
                states = self._fetch(k)
                if swapper is not None:
                    swapper.prefetch(k + 1 - self.resident)
                s, e = self.bounds[k]
                self._step_sub_group(storage, pieces[k], states, e - s, step, lr, config, grad_scale)
                if swapper is not None:
                    # The buffer set is refilled once written: its copies to the device must be done.
                    self.copied.record()
                    self.copied.synchronize()
                    swapper.write(k - self.resident, states)
            self.copied.record()
            self.copied.synchronize()
        finally:
            if swapper is not None:
                swapper.drain()

    def _step_sub_group(self, storage, pieces, states, n, step, lr, config, grad_scale) -> None:
        grad = self.grad_buffer[:n]
        for b, lo, hi, _, at, _ in pieces:
            grad[at : at + hi - lo].copy_(storage.grad_chunk(b)[lo:hi], non_blocking=True)
        # The host buffers are written below: the gradients must have arrived, and the previous
        # sub-group's weights (queued before on the same stream) must have left.
        self.copied.record()
        self.copied.synchronize()
        lp = self.lp_buffer[:n] if self.lp_buffer is not None else None
        master, m, v = states["fp32"], states["exp_avg"], states["exp_avg_sq"]
        for b, lo, hi, wd, at, group in pieces:
            r = slice(at, at + hi - lo)
            adam_update(
                master[r],
                grad[r],
                m[r],
                v[r],
                step=step,
                lr=lr_of(lr, group),
                config=config,
                weight_decay=wd,
                grad_scale=grad_scale,
                param_copy=None if lp is None else lp[r],
                num_threads=self.cpu_threads,
            )
        updated = master if lp is None else lp
        for b, lo, hi, _, at, _ in pieces:
            storage.param_chunk(b)[lo:hi].copy_(updated[at : at + hi - lo], non_blocking=True)

    # --- accounting -------------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the states by where they are: the resident part's on the device ("master",
        "optimizer_states"), the offloaded part's in host memory or swap files, and the host
        staging buffers."""
        size = {kind: torch.empty(0, dtype=dtype).element_size() for kind, dtype in self.dtypes.items()}
        resident, offloaded = self.split, self.bounds[-1][1] - self.split
        moments = size["exp_avg"] + size["exp_avg_sq"]
        buffers = _nbytes(self.grad_buffer) + _nbytes(self.lp_buffer)
        if self._cache is not None:
            buffers += sum(_nbytes(t) for t in self._cache[2].values())
        if self.swapper is not None:
            buffers += self.swapper.buffer_bytes()
        where = "host" if self.device_kind == "cpu" else "nvme"
        return {
            "master": 4 * resident,
            "optimizer_states": moments * resident,
            f"{where}_master": 4 * offloaded,
            f"{where}_optimizer_states": moments * offloaded,
            "host_offload_buffers": buffers,
        }

    def close(self) -> None:
        if self.swapper is not None:
            self.flush_cache()
            self.swapper.close()


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


# --- engine.offload_states / reload_states ------------------------------------------------------
OFFLOAD_STATES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
# The memory report's category of each state.
REPORT_CATEGORY = {
    "optim_states": "optimizer_states",
    "hp_params": "master",
    "lp_params": "params",
    "lp_grads": "grads",
    "contiguous_grad_buffer": "buffers",
}


def state_tensors(storage, name: str) -> list[torch.Tensor]:
    """The device tensors of state `name` in one storage that hold memory now. The gradient staging
    buckets (contiguous_grad_buffer) exist only from a backward to its reduction, so between steps
    there is nothing of them to move."""
    if name == "optim_states":
        found = [storage.exp_avg, storage.exp_avg_sq]
    elif name == "hp_params":
        found = [storage.master]
    elif name == "lp_params":  # stages 0-2: the full flat weights; stage 3: the partition
        found = [getattr(storage, "param_flat", None), getattr(storage, "partition", None)]
    elif name == "lp_grads":
        found = [getattr(storage, "grad_flat", None), getattr(storage, "grad_part", None)]
    else:
        found = []
    return [t for t in found if t is not None and t.untyped_storage().nbytes() > 0]


def check_state_names(include) -> tuple[str, ...]:
    """The state names `include` asks for (None: all); one name alone, or enum members with the
    names as values (DeepSpeed's OffloadStateTypeEnum), are accepted too."""
    if include is None:
        return OFFLOAD_STATES
    if isinstance(include, str) or hasattr(include, "value"):
        include = [include]
    names = tuple(getattr(name, "value", name) for name in include)
    for name in names:
        if name not in OFFLOAD_STATES:
            raise UsageError(f"offload_states: unknown state {name!r}; use some of {', '.join(OFFLOAD_STATES)}")
    return names


class HostCopies:
    """States moved to host memory by `offload`, brought back bitwise by `reload`."""

    def __init__(self):
        self.moved: dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}

    def __bool__(self) -> bool:
        return bool(self.moved)

    def offload(self, storages, include, *, pin_memory: bool, non_blocking: bool) -> None:
        for name in check_state_names(include):
            if name in self.moved:
                continue
            entries, seen = [], set()
            for storage in storages:
                for t in state_tensors(storage, name):
                    if t.data_ptr() in seen:
                        continue
                    seen.add(t.data_ptr())
                    pin = pin_memory and t.device.type == "cuda"
                    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                    host.copy_(t, non_blocking=non_blocking and pin)
                    entries.append((t, host, t.untyped_storage().nbytes()))
                    drop_storage(t)
            if entries:
                self.moved[name] = entries

    def reload(self, non_blocking: bool) -> None:
        for name, entries in self.moved.items():
            for t, host, nbytes in entries:
                resize_storage(t.untyped_storage(), nbytes)
                t.copy_(host, non_blocking=non_blocking and host.is_pinned())
        self.moved = {}

    def bytes_by_category(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, entries in self.moved.items():
            category = REPORT_CATEGORY[name]
            out[category] = out.get(category, 0) + sum(_nbytes(host) for _, host, _ in entries)
        return out


# --- the optimizer placements of megazero.zero.placement -------------------------------------
class OnDevice:
    """States on the device, in the storages: nothing to do around the step."""

    def place(self, storage, name: str) -> None:
        pass

    def before_step(self, storages, step: int, coef: float) -> None:
        pass

    def checkpoint_index(self, storages, name_of) -> dict:
        return {}

    def restore(self, indexes: list[dict], storages, name_of) -> None:
        pass


class Offloaded(OnDevice):
    """offload_optimizer: each storage's master and moments in host memory or swap files."""

    def __init__(self, zero: ZeroConfig, groups: ZeroGroups):
        self.config, self.sub_group_size = zero.offload_optimizer, zero.sub_group_size
        self.folder = None
        self.cpu_threads = zero.cpu_optimizer_threads or torch.get_num_threads()
        if self.config.device == "nvme":
            rank = groups.dp.ranks[groups.dp.rank]
            self.folder = Path(self.config.nvme_path) / "megazero_swap" / f"rank{rank}" / "optimizer"

    def make_offload(self):
        """What builds a storage's offload: `make(storage, config, sub_group_size, folder, name)`."""
        return functools.partial(OptimizerOffload, cpu_threads=self.cpu_threads)

    def place(self, storage, name: str) -> None:
        storage.offload_optimizer_states(self.config, self.sub_group_size, self.folder, name, make=self.make_offload())
