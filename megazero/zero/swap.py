"""Swap files for offloaded states (ZeRO-Infinity's nvme tier): bytes on disk, verified.

A `SwapFile` holds one tensor (one kind of optimizer state of one storage's partition, or one
stage-3 unit's parameter chunk) cut into sub-groups. Reads and writes are positioned (`os.preadv` / `os.pwrite`) straight into and out of
host tensors, one sub-group at a time, so they run in worker threads without the GIL. Every write
records the sub-group's CRC-32; every read checks the file's size and the CRC first, so a file
truncated or altered behind our back is a `SwapFileError` naming it, never a wrong step.

`SubGroupSwapper` swaps the states of one partition sub-group by sub-group with `buffer_count`
host buffer sets: `fetch(k)` hands back sub-group k's states (read now, or earlier by `prefetch`),
`write(k, ...)` writes them back (behind, in a thread, when `pipeline_write`), `drain()` waits for
every write. Which sub-groups to step and when is offload.py's business; this module owns bytes.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import weakref
import zlib
from pathlib import Path

import torch

from megazero.core.errors import UsageError


class SwapFileError(UsageError):
    """A swap file is not what was written to it; the message names the file and the fix."""


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer, for the OS calls and the CRC."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _checksums(data: memoryview) -> tuple[int, int]:
    return zlib.crc32(data), zlib.adler32(data)


class SwapFile:
    """One tensor of `numel` elements of `dtype` in a file of exactly that many bytes; `bounds` are
    the sub-groups' [start, end) element ranges, each with the CRC of what was last written there
    (None: never written). The file is opened per read or write, so a run with one file per stage-3
    unit holds no descriptors between them."""

    def __init__(self, path: Path, numel: int, bounds: list[tuple[int, int]], dtype=torch.float32):
        self.path, self.numel, self.bounds = Path(path), numel, bounds
        self.element = torch.empty(0, dtype=dtype, device="cpu").element_size()
        self.crc: list[int | None] = [None] * len(bounds)
        self.adler: list[int | None] = [None] * len(bounds)  # with crc: did a write change it
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))

    @property
    def nbytes(self) -> int:
        return self.numel * self.element

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            raise SwapFileError(
                f"swap file {self.path} is missing; keep nvme_path intact while the run "
                f"lasts and restart from a checkpoint"
            ) from None

    def write(self, k: int, values: torch.Tensor, checksums: tuple[int, int] | None = None) -> None:
        """Writes sub-group k from a contiguous CPU tensor of its length (`checksums`: its CRC-32 and
        Adler-32 when the caller has them already)."""
        start, end = self.bounds[k]
        data = _as_bytes(values[: end - start])
        offset, done, fd = start * self.element, 0, self._open()
        try:
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
        finally:
            os.close(fd)
        self.crc[k], self.adler[k] = checksums or _checksums(data)

    def write_if_changed(self, k: int, values: torch.Tensor) -> bool:
        """Writes sub-group k unless the file already holds these values (its CRC says so): a
        buffer handed out for writing but only read (a norm, a checkpoint) costs no disk write.
        Unchanged means both checksums agree (64 bits: one CRC-32 alone would skip one changed
        write in 4 billion, a run's worth)."""
        start, end = self.bounds[k]
        checksums = _checksums(_as_bytes(values[: end - start]))
        if self.crc[k] is not None and checksums == (self.crc[k], self.adler[k]):
            return False
        self.write(k, values, checksums)
        return True

    def read(self, k: int, out: torch.Tensor) -> torch.Tensor:
        """Reads sub-group k into the front of `out` (contiguous CPU) after checking the file's size,
        and its CRC after; returns the filled view."""
        start, end = self.bounds[k]
        view = out[: end - start]
        data = _as_bytes(view)
        offset, done, fd = start * self.element, 0, self._open()
        try:
            size = os.fstat(fd).st_size
            if size != self.nbytes:
                raise SwapFileError(
                    f"swap file {self.path} holds {size} bytes, {self.nbytes} were "
                    f"written: it was truncated or replaced while training; keep "
                    f"nvme_path private to this run and restart from a checkpoint"
                )
            while done < len(data):
                got = os.preadv(fd, [data[done:]], offset + done)
                if got == 0:
                    raise SwapFileError(
                        f"swap file {self.path} ended early while reading elements "
                        f"{start}-{end}; restart from a checkpoint"
                    )
                done += got
        finally:
            os.close(fd)
        if zlib.crc32(data) != self.crc[k]:
            raise SwapFileError(
                f"swap file {self.path} was altered: elements {start}-{end} fail their "
                f"checksum; keep nvme_path private to this run and restart from a "
                f"checkpoint"
            )
        return view


class SubGroupSwapper:
    """The swapped states of one partition: one `SwapFile` per kind under `folder`, host buffer
    sets for `buffer_count` sub-groups at a time, and the threads that read ahead and write behind.

    A buffer set (one host tensor per kind) is held from `fetch` until its write completes; a read
    ahead takes a set only when one is free, so no order of calls can deadlock: at worst the
    overlap is lost (one set: fully synchronous)."""

    def __init__(
        self,
        folder: Path,
        prefix: str,
        kinds: tuple[str, ...],
        bounds: list[tuple[int, int]],
        *,
        buffer_count: int,
        pipeline_read: bool,
        pipeline_write: bool,
        pin_memory: bool,
        dtypes: dict | None = None,
    ):
        folder = Path(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(
                f"offload_optimizer.nvme_path: cannot create {folder} ({err.strerror or err}); "
                f"point nvme_path at a writable directory"
            ) from None
        numel = bounds[-1][1] if bounds else 0
        self.kinds, self.bounds = kinds, bounds
        dtypes = {kind: (dtypes or {}).get(kind, torch.float32) for kind in kinds}  # fp32 unless named
        self.files = {kind: SwapFile(folder / f"{prefix}.{kind}.swp", numel, bounds, dtypes[kind]) for kind in kinds}
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        longest = max((e - s for s, e in bounds), default=0)
        sets = max(1, min(buffer_count, len(bounds)))
        self.sets = [
            {kind: torch.empty(longest, dtype=dtypes[kind], pin_memory=pin_memory, device="cpu") for kind in kinds}
            for _ in range(sets)
        ]
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for buffers in self.sets:
            self._free.put(buffers)
        self._reads: dict[int, concurrent.futures.Future] = {}
        self._writes: list[concurrent.futures.Future] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2 * len(kinds), thread_name_prefix="optimizer-swap"
        )
        # An engine dropped without close() still lets its idle I/O threads go.
        weakref.finalize(self, self.pool.shutdown, False)

    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for buffers in self.sets for t in buffers.values())

    def paths(self) -> list[Path]:
        return [f.path for f in self.files.values()]

    # --- reads ----------------------------------------------------------------------------------
    def _read_set(self, k: int, buffers: dict) -> dict:
        for kind, file in self.files.items():
            file.read(k, buffers[kind])
        return buffers

    def prefetch(self, k: int) -> None:
        """Starts reading sub-group k in a thread, if reading ahead is on and a buffer set is free."""
        if not self.pipeline_read or k >= len(self.bounds) or k in self._reads:
            return
        try:
            buffers = self._free.get_nowait()
        except queue.Empty:
            return
        self._reads[k] = self.pool.submit(self._read_set, k, buffers)

    def fetch(self, k: int) -> dict[str, torch.Tensor]:
        """Sub-group k's states, one host tensor per kind (views of a buffer set, held by the caller
        until `write(k, ...)`)."""
        future = self._reads.pop(k, None)
        if future is not None:
            buffers = future.result()
        else:
            buffers = self._read_set(k, self._free.get())
        n = self.bounds[k][1] - self.bounds[k][0]
        return {kind: buffers[kind][:n] for kind in self.kinds}

    # --- writes ---------------------------------------------------------------------------------
    def _write_set(self, k: int, buffers: dict) -> None:
        try:
            for kind, file in self.files.items():
                file.write(k, buffers[kind])
        finally:
            self._free.put(buffers)

    def write(self, k: int, states: dict[str, torch.Tensor]) -> None:
        """Writes sub-group k back from the tensors `fetch(k)` returned; the buffer set is free
        again once written."""
        buffers = self._set_of(states)
        if self.pipeline_write:
            self._writes.append(self.pool.submit(self._write_set, k, buffers))
        else:
            self._write_set(k, buffers)

    def write_initial(self, k: int, values: dict[str, torch.Tensor]) -> None:
        """Writes sub-group k from arbitrary host tensors (the states' first values)."""
        buffers = self._free.get()
        try:
            n = self.bounds[k][1] - self.bounds[k][0]
            for kind, file in self.files.items():
                buffers[kind][:n].copy_(values[kind])
                file.write(k, buffers[kind])
        finally:
            self._free.put(buffers)

    def _set_of(self, states: dict[str, torch.Tensor]) -> dict:
        first = states[self.kinds[0]]
        for buffers in self.sets:
            if buffers[self.kinds[0]].data_ptr() == first.data_ptr():
                return buffers
        raise RuntimeError("write() takes the tensors fetch() returned")

    def drain(self) -> None:
        """Waits for every read ahead and write behind; raises the first error one met."""
        reads, self._reads = list(self._reads.values()), {}
        writes, self._writes = self._writes, []
        error = None
        for future in reads:
            try:
                self._free.put(future.result())
            except Exception as err:  # the buffer set is lost with the failed read; it is the end
                error = error or err
        for future in writes:
            try:
                future.result()
            except Exception as err:
                error = error or err
        if error is not None:
            raise error

    def close(self) -> None:
        self.pool.shutdown(wait=True)
