"""Where the stage-3 low-precision parameter partition lives when `offload_param` moves it off the
device (ZeRO-Infinity): host memory (`HostParams`) or one file per unit under
`nvme_path/megazero_swap/rank{r}/params` (`NvmeParams`).

A home hands out this rank's chunk of a unit two ways: `host_chunk(b)`, a host tensor the optimizer
step, checkpoint loads and inspection read and write in place (the home's value of record), and
`to_device(b)`, the chunk on the compute device for the unit's all-gather (an asynchronous copy on
the copy stream; the caller's stream waits for it). `GatherOrder` remembers the order units were
fetched in during the last step, so the nvme home can start reading files ahead of the gathers.

Owns only the bytes and files; when a unit is gathered is coordinator.py's business, and the
partition's layout is the FlatLayout's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import weakref
from pathlib import Path

import torch

from megazero.core.errors import UsageError
from megazero.core.streams import Streams, copy_to_device
from ..config import OffloadParamConfig
from ..swap import SwapFile, SwapFileError  # noqa: F401 (SwapFileError: the error callers catch)


class HostParams:
    """The whole partition in host memory, pinned (`pin_memory`, on a GPU) so that the copies to the
    device run asynchronously on the copy stream."""

    location = "host_params"

    def __init__(
        self,
        chunks: list[tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
        streams: Streams,
        pin_memory: bool = True,
    ):
        self.chunks, self.device, self.streams = chunks, torch.device(device), streams
        size = sum(n for _, n in chunks)
        self.partition = torch.zeros(
            size, dtype=dtype, device="cpu", pin_memory=pin_memory and self.device.type == "cuda"
        )

    def host_chunk(self, b: int) -> torch.Tensor:
        offset, n = self.chunks[b]
        return self.partition[offset : offset + n]

    def prefetch(self, b: int) -> None:
        """Nothing to read ahead: the copy is issued when the gather is."""

    def to_device(self, b: int) -> torch.Tensor:
        return copy_to_device(self.host_chunk(b), self.device, self.streams)

    def flush(self) -> None:
        """Host memory is the home itself: nothing to write back."""

    def drop_cache(self) -> None:
        """Nothing is cached: the whole partition is the home."""

    def memory_bytes(self) -> dict[str, int]:
        return {"host_params": self.partition.numel() * self.partition.element_size()}


class NvmeParams:
    """One file per unit chunk; at most `buffer_count` chunks (and `max_in_cpu` elements, but two
    chunks at least) in host buffers at a time.

    The buffers are the value of record while they are held: a buffer handed out by `host_chunk`
    counts as written and goes back to its file when evicted (oldest first) or at `flush`. Reads
    and writes run on a thread pool; a read waits for a pending write of the same unit. Each file's
    size and CRC-32 are checked on every read against what was last written."""

    location = "nvme_params"

    def __init__(
        self,
        chunks: list[tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
        streams: Streams,
        config: OffloadParamConfig,
        rank: int,
    ):
        if not config.nvme_path:
            raise UsageError(
                "offload_param.device is nvme but offload_param.nvme_path is not set; "
                "set it to a directory on a fast local disk"
            )
        self.chunks, self.dtype, self.device, self.streams = chunks, dtype, torch.device(device), streams
        self.pin = config.pin_memory and self.device.type == "cuda"
        largest = max((n for _, n in chunks), default=0)
        # Chunks held in host memory: buffer_count of them, fewer where max_in_cpu elements bound
        # the cache, but the unit in use and one read ahead at least.
        self.capacity = max(2, min(config.buffer_count, config.max_in_cpu // max(largest, 1)))
        if largest > config.buffer_size:
            raise UsageError(
                f"offload_param.buffer_size {config.buffer_size} is below this rank's largest "
                f"stage-3 unit chunk ({largest} elements); raise it to at least {largest}"
            )
        self.folder = Path(config.nvme_path) / "megazero_swap" / f"rank{rank}" / "params"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(
                f"offload_param.nvme_path: cannot create {self.folder} ({err.strerror or err}); "
                f"point nvme_path at a writable directory"
            ) from None
        # One verified file per unit chunk (size and CRC-32 checked on every read).
        self.files = [SwapFile(self.path(b), n, [(0, n)], dtype) for b, (_, n) in enumerate(chunks)]
        self.held: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()
        self.dirty: set[int] = set()
        self.reads: dict[int, concurrent.futures.Future] = {}
        self.writes: dict[int, concurrent.futures.Future] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="param-swap")
        weakref.finalize(self, self.pool.shutdown, wait=False)

    def path(self, b: int) -> Path:
        return self.folder / f"unit{b:05d}.swp"

    # --- file I/O (on the pool's threads) ---------------------------------------------------------
    def _new_buffer(self, b: int) -> torch.Tensor:
        return torch.zeros(self.chunks[b][1], dtype=self.dtype, pin_memory=self.pin, device="cpu")

    def _read_file(self, b: int, pending_write) -> torch.Tensor:
        if pending_write is not None:
            pending_write.result()
        buffer = self._new_buffer(b)
        if self.files[b].crc[0] is not None:  # never written: a fresh, zero chunk
            self.files[b].read(0, buffer)
        return buffer

    # --- the cache ----------------------------------------------------------------------------
    def prefetch(self, b: int) -> None:
        """Starts reading unit b's file unless it is held or already being read."""
        if b not in self.held and b not in self.reads:
            self.reads[b] = self.pool.submit(self._read_file, b, self.writes.get(b))

    def _hold(self, b: int) -> torch.Tensor:
        if b in self.held:
            self.held.move_to_end(b)
            return self.held[b]
        self.prefetch(b)
        buffer = self.reads.pop(b).result()
        self.held[b] = buffer
        self._evict()
        return buffer

    def _evict(self) -> None:
        while len(self.held) > self.capacity:
            b, buffer = self.held.popitem(last=False)
            if b in self.dirty:
                self._start_write(b, buffer)

    def _start_write(self, b: int, buffer: torch.Tensor) -> None:
        self.dirty.discard(b)
        # The buffer is not written again once queued (evicted, or flush waits for the write).
        # Unchanged chunks (handed out by host_chunk for a norm or a checkpoint) are not rewritten.
        self.writes[b] = self.pool.submit(self.files[b].write_if_changed, 0, buffer)

    def host_chunk(self, b: int) -> torch.Tensor:
        """Unit b's chunk in a host buffer the caller may write (it goes back to the file)."""
        buffer = self._hold(b)
        self.dirty.add(b)
        return buffer

    def to_device(self, b: int) -> torch.Tensor:
        return copy_to_device(self._hold(b), self.device, self.streams)

    def flush(self) -> None:
        """Writes every written buffer back and waits for all writes (their errors raise here);
        the buffers stay held, clean, for the next reads."""
        for b in [b for b in self.held if b in self.dirty]:
            self._start_write(b, self.held[b])
        writes, self.writes = self.writes, {}
        for future in writes.values():
            future.result()

    def drop_cache(self) -> None:
        """Writes back and frees every host buffer (engine.empty_partition_cache); reads ahead are
        waited and dropped."""
        reads, self.reads = self.reads, {}
        for future in reads.values():
            future.result()
        self.flush()
        self.held.clear()

    def memory_bytes(self) -> dict[str, int]:
        element = torch.empty(0, dtype=self.dtype, device="cpu").element_size()
        buffers = sum(t.numel() for t in self.held.values()) + sum(self.chunks[b][1] for b in self.reads)
        return {"nvme_params": sum(n for _, n in self.chunks) * element, "param_swap_buffers": buffers * element}


def make_param_home(
    config: OffloadParamConfig, chunks: list[tuple[int, int]], dtype: torch.dtype, device, streams: Streams, rank: int
):
    """The home `config.device` names, for this rank's chunks ((offset, length) per unit)."""
    if config.device == "cpu":
        return HostParams(chunks, dtype, device, streams, config.pin_memory)
    return NvmeParams(chunks, dtype, device, streams, config, rank)


class GatherOrder:
    """The units fetched during the last step, in order, and where this step is in it: the nvme
    home reads the next ones' files while the current gather runs. A step that departs from the
    last one resynchronises at the unit's next occurrence (it is only a read-ahead hint)."""

    def __init__(self):
        self.previous: list[int] = []
        self.current: list[int] = []
        self.cursor = 0

    def next_after(self, b: int, depth: int) -> list[int]:
        """Records a fetch of unit b; returns up to `depth` units that followed it last step."""
        self.current.append(b)
        previous = self.previous
        if self.cursor >= len(previous) or previous[self.cursor] != b:
            if b not in previous:
                return []
            later = b in previous[self.cursor :]
            self.cursor = previous.index(b, self.cursor) if later else previous.index(b)
        self.cursor += 1
        return previous[self.cursor : self.cursor + depth]

    def end_step(self) -> None:
        if self.current:
            self.previous = self.current
        self.current, self.cursor = [], 0
