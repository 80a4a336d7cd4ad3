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

import zlib
from pathlib import Path

import torch

from megazero.core.errors import UsageError
from megazero.core.streams import Event
from megazero.ops.adam import adam_update, lr_of
from .tensor_memory import drop_storage
from .swap import SubGroupSwapper

OFFLOADED_KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def sub_group_bounds(numel: int, sub_group_size: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of the partition's sub-groups (at least one, possibly empty)."""
    return [(s, min(s + sub_group_size, numel)) for s in range(0, max(numel, 1), sub_group_size)]


def partition_range(storage, kind: str, start: int, end: int) -> torch.Tensor:
    """A host copy of partition elements [start, end) of `kind`, assembled from the bucket chunks
    (stage 0/1 chunks are not contiguous in the flat buffer)."""
    out = torch.empty(end - start, dtype=torch.float32, device="cpu")
    for b, bucket in enumerate(storage.layout.buckets):
        lo, hi = max(start, bucket.local_offset), min(end, bucket.local_offset + bucket.chunk)
        if lo < hi:
            chunk = storage.chunk(kind, b)
            out[lo - start:hi - start].copy_(chunk[lo - bucket.local_offset:hi - bucket.local_offset])
    return out


class OptimizerOffload:
    """The fp32 master and Adam moments of one storage, off the device (see module docstring)."""

    def __init__(self, storage, config, sub_group_size: int, folder: Path | None, name: str):
        if config.ratio != 1.0:
            raise UsageError(f"offload_optimizer.ratio = {config.ratio}: partial offload is not "
                             f"supported; set ratio 1.0 (all optimizer states offloaded) or remove it")
        self.device_kind = config.device                 # "cpu" | "nvme"
        self.bounds = sub_group_bounds(storage.layout.partition_size, sub_group_size)
        pin = config.pin_memory and storage.device.type == "cuda"
        longest = max(e - s for s, e in self.bounds)
        # Host staging of one sub-group: the reduced gradients in, the updated 16-bit weights out.
        host = dict(device="cpu", pin_memory=pin)
        self.grad_buffer = torch.empty(longest, dtype=storage.precision.grad_accum_dtype, **host)
        self.lp_buffer = (torch.empty(longest, dtype=storage.precision.param_dtype, **host)
                          if storage.precision.mixed else None)
        # Device<->host copies are issued without blocking and waited once per batch of them.
        self.copied = Event(storage.device)
        self.host: dict[str, torch.Tensor] | None = None
        self.swapper: SubGroupSwapper | None = None
        self._cache: tuple[int, int, dict[str, torch.Tensor]] | None = None
        if self.device_kind == "cpu":
            size = storage.layout.partition_size
            self.host = {kind: torch.empty(size, dtype=torch.float32, pin_memory=pin, device="cpu")
                         for kind in OFFLOADED_KINDS}
            for s, e in self.bounds:
                for kind in OFFLOADED_KINDS:
                    self.host[kind][s:e].copy_(partition_range(storage, kind, s, e))
        else:
            self.swapper = SubGroupSwapper(
                folder, name, OFFLOADED_KINDS, self.bounds, buffer_count=config.buffer_count,
                pipeline_read=config.pipeline_read, pipeline_write=config.pipeline_write, pin_memory=pin)
            for k, (s, e) in enumerate(self.bounds):
                self.swapper.write_initial(k, {kind: partition_range(storage, kind, s, e)
                                               for kind in OFFLOADED_KINDS})

    # --- values of record, for checkpoints and inspection -----------------------------------------
    def view(self, kind: str, start: int, length: int) -> torch.Tensor:
        """Partition elements [start, start + length) of `kind` as a writable host tensor. For nvme
        it is a view of a cache of the covering sub-groups; writes reach the files when the cache is
        flushed (before the next step, or when another range is asked for), so use it at once."""
        if self.host is not None:
            return self.host[kind][start:start + length]
        if length == 0:
            return torch.empty(0, dtype=torch.float32, device="cpu")
        end = start + length
        if self._cache is None or not (self._cache[0] <= start and end <= self._cache[1]):
            self.flush_cache()
            self._load_cache(start, end)
        lo = self._cache[0]
        return self._cache[2][kind][start - lo:end - lo]

    def _load_cache(self, start: int, end: int) -> None:
        ks = [k for k, (s, e) in enumerate(self.bounds) if s < end and start < e]
        lo, hi = self.bounds[ks[0]][0], self.bounds[ks[-1]][1]
        cache = {}
        for kind, file in self.swapper.files.items():
            cache[kind] = torch.empty(hi - lo, dtype=torch.float32, device="cpu")
            for k in ks:
                s, _ = self.bounds[k]
                file.read(k, cache[kind][s - lo:])
        self._cache = (lo, hi, cache)

    def flush_cache(self) -> None:
        """Writes back the sub-groups of the nvme cache whose values changed (the CRC tells), then
        drops the cache."""
        if self._cache is None:
            return
        lo, hi, cache = self._cache
        self._cache = None
        for kind, file in self.swapper.files.items():
            for k, (s, e) in enumerate(self.bounds):
                if lo <= s and e <= hi:
                    piece = cache[kind][s - lo:e - lo]
                    if zlib.crc32(piece.view(torch.uint8).numpy()) != file.crc[k]:
                        file.write(k, piece)

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
        if self.host is not None:
            s, e = self.bounds[k]
            return {kind: self.host[kind][s:e] for kind in OFFLOADED_KINDS}
        return self.swapper.fetch(k)

    def step(self, storage, step: int, lr, config, grad_scale: float) -> None:
        """Adam on the host states, sub-group by sub-group; the device weights follow."""
        self.flush_cache()
        pieces = self._pieces(storage)
        swapper = self.swapper
        try:
            if swapper is not None:
                swapper.prefetch(0)
            for k, (s, e) in enumerate(self.bounds):
                states = self._fetch(k)
                if swapper is not None:
                    swapper.prefetch(k + 1)
                self._step_sub_group(storage, pieces[k], states, e - s, step, lr, config, grad_scale)
                if swapper is not None:
                    # The buffer set is refilled once written: its copies to the device must be done.
                    self.copied.record()
                    self.copied.synchronize()
                    swapper.store(k, states)
            self.copied.record()
            self.copied.synchronize()
        finally:
            if swapper is not None:
                swapper.drain()

    def _step_sub_group(self, storage, pieces, states, n, step, lr, config, grad_scale) -> None:
        grad = self.grad_buffer[:n]
        for b, lo, hi, _, at, _ in pieces:
            grad[at:at + hi - lo].copy_(storage.grad_chunk(b)[lo:hi], non_blocking=True)
        # The host buffers are written below: the gradients must have arrived, and the previous
        # sub-group's weights (queued before on the same stream) must have left.
        self.copied.record()
        self.copied.synchronize()
        lp = self.lp_buffer[:n] if self.lp_buffer is not None else None
        master, m, v = states["fp32"], states["exp_avg"], states["exp_avg_sq"]
        for b, lo, hi, wd, at, group in pieces:
            r = slice(at, at + hi - lo)
            adam_update(master[r], grad[r], m[r], v[r], step=step, lr=lr_of(lr, group), config=config,
                        weight_decay=wd, grad_scale=grad_scale,
                        param_copy=None if lp is None else lp[r])
        updated = master if lp is None else lp
        for b, lo, hi, _, at, _ in pieces:
            storage.param_chunk(b)[lo:hi].copy_(updated[at:at + hi - lo], non_blocking=True)

    # --- accounting -------------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Off-device bytes: the states (host memory or swap files) and the host staging buffers."""
        state_bytes = sum(e - s for s, e in self.bounds) * 4
        buffers = _nbytes(self.grad_buffer) + _nbytes(self.lp_buffer)
        if self._cache is not None:
            buffers += sum(_nbytes(t) for t in self._cache[2].values())
        if self.swapper is not None:
            buffers += self.swapper.buffer_bytes()
        where = "host" if self.host is not None else "nvme"
        return {f"{where}_master": state_bytes, f"{where}_optimizer_states": 2 * state_bytes,
                "host_offload_buffers": buffers}

    def close(self) -> None:
        if self.swapper is not None:
            self.flush_cache()
            self.swapper.close()


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


# --- engine.offload_states / reload_states ------------------------------------------------------
OFFLOAD_STATES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
# The memory report's category of each state.
REPORT_CATEGORY = {"optim_states": "optimizer_states", "hp_params": "master", "lp_params": "params",
                   "lp_grads": "grads", "contiguous_grad_buffer": "buffers"}


def state_tensors(storage, name: str) -> list[torch.Tensor]:
    """The device tensors of state `name` in one storage that hold memory now. The gradient staging
    buckets (contiguous_grad_buffer) exist only from a backward to its reduction, so between steps
    there is nothing of them to move."""
    if name == "optim_states":
        found = [storage.exp_avg, storage.exp_avg_sq]
    elif name == "hp_params":
        found = [storage.master]
    elif name == "lp_params":        # stages 0-2: the full flat weights; stage 3: the partition
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
                t.untyped_storage().resize_(nbytes)
                t.copy_(host, non_blocking=non_blocking and host.is_pinned())
        self.moved = {}

    def bytes_by_category(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, entries in self.moved.items():
            category = REPORT_CATEGORY[name]
            out[category] = out.get(category, 0) + sum(_nbytes(host) for _, host, _ in entries)
        return out
