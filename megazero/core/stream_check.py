"""The CPU stream sanitizer: a checking backend of megazero.core.streams and a dispatch mode over every op.

    with stream_check.checking() as checker:     # CPU side streams are modelled and checked inside
        state = setup(cfg, groups); train_step(...)
    print(checker.summary())

Owns the model of streams on CPU while checking is on. Streams are ids, each with the position of
its own work; an event captures the recording stream's view of every stream (a vector clock); a wait
merges the event's view into the waiting stream's. An access on stream B is ordered after one on
stream A at position p when B's view of A has reached p (B waited on an event recorded after it), or
when the host synchronized on such an event. A `TorchDispatchMode` (megazero.core.op_access)
attributes every aten op to the current stream: its inputs are read, the arguments its schema marks mutated and its fresh outputs
are written (views touch no data). Collectives are declared by megazero.core.comm (`collective`), and
run as torch's ProcessGroupNCCL runs them (megazero.core.nccl_semantics picks the model by torch
version: from 2.8 an async op's tensors are stashed until its wait, before that record_stream'ed).
A host thread (ZenFlow's CPU Adam) is declared the same way (`host_thread`), on a stream of its own
that is ordered only after what the host synchronized on.

Violations (StreamOrderError, naming the tensor's shape, dtype and label, both streams and both call
sites, the first frames outside torch and the stream and comm modules):
- read-after-write, write-after-read, write-after-write: two accesses to overlapping bytes of one
  storage on different streams, at least one a write, with no event between them;
- use-after-free: a storage freed (its last reference gone, or `untyped_storage().resize_`) goes
  back to the stream that allocated it, as in the CUDA caching allocator, which reuses it there at
  once; an access by another stream may still be running unless it is ordered before that stream,
  or before the point a stream `record_stream`ed on the storage (SideStream.keep_alive) had reached
  when it was freed: the allocator holds the block until each recorded stream passes that point.

On CPU every op runs when it is issued, so a checked run computes exactly what an unchecked one
does; the check says what a GPU would have raced on. The dry run (megazero.dry_run) checks its
ranks with `devices=("cpu", "meta")`: meta, its GPU, is modelled as a device too (a storage's bytes
are known without its values) and violations are collected (`collect`) instead of raised. Buffers get readable names through
`megazero.core.streams.label`. A launched run's line (counts summed over the ranks) is
megazero.core.stream_check_report's. Must not touch: the engine's tensors (only their metadata is read), CUDA
devices (they keep their CUDA backends; torch's own sanitizer, TORCH_CUDA_SANITIZER=1, checks those).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import weakref
from pathlib import Path

import torch

from megazero.core import kernels, op_access, source_paths, streams as _streams
from megazero.core.nccl_semantics import (  # noqa: F401 - re-exported: the tests and the dry run take them from here
    RECORD_STREAM,
    STASH,
    describe_semantics,
    nccl_semantics,
)

MAIN = 0
_SKIPPED_FILES = tuple(
    str(Path(p).resolve())
    for p in (
        Path(torch.__file__).parent,
        Path(__file__),
        Path(_streams.__file__),
        Path(_streams.__file__).with_name("comm.py"),
        Path(kernels.__file__),
        Path(op_access.__file__),
        Path(contextlib.__file__),
    )
)


class StreamOrderError(RuntimeError):
    """Two streams touch a tensor with no event between them, or one frees it under the other."""


class _Stream:
    """A modelled stream: `pos` counts its ops; `known[s]` is how far stream s is ordered before it."""

    def __init__(self, sid: int, name: str):
        self.id, self.name, self.pos = sid, name, 0
        self.known = {sid: 0}

    def __repr__(self) -> str:
        return f"stream '{self.name}'"


class _Event:
    __slots__ = ("clock", "stamp")

    def __init__(self):
        self.clock: dict[int, int] | None = None  # None: never recorded (waiting on it is a no-op)
        self.stamp: float | None = None


class _Storage:
    """A tracked storage and its current allocation: the stream its memory returns to when freed,
    the streams recorded on it, and its accesses as (write, stream, position, lo, hi, site)."""

    __slots__ = ("ref", "ptr", "label", "stream", "recorded", "accesses", "first")

    def __init__(self, ref, ptr: int, stream: int, first: str):
        self.ref, self.ptr, self.label = ref, ptr, None
        self.stream, self.recorded, self.accesses, self.first = stream, set(), [], first


def _merge(into: dict[int, int], clock: dict[int, int]) -> None:
    for sid, pos in clock.items():
        if pos > into.get(sid, 0):
            into[sid] = pos


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} tensor of shape {tuple(t.shape)}"


@functools.lru_cache(maxsize=None)
def _skipped(filename: str) -> bool:
    return str(Path(filename).resolve()).startswith(_SKIPPED_FILES) or filename.startswith("<")


def skip_frames_of(filename: str) -> None:
    """Call sites skip `filename`'s frames too (a module extending the checker: dry_run/trace.py)."""
    global _SKIPPED_FILES
    _SKIPPED_FILES = (*_SKIPPED_FILES, str(Path(filename).resolve()))
    _skipped.cache_clear()


def _call_site() -> str:
    """file:line (function) of the first frame outside torch, the stream/comm modules and a torch
    function mode's handler (the dry run's kernel choices: the call site is the model's line)."""
    frame = sys._getframe(1)
    while frame is not None and (_skipped(frame.f_code.co_filename) or frame.f_code.co_name == "__torch_function__"):
        frame = frame.f_back
    if frame is None:  # e.g. a backend's thread dropped a tensor's last reference
        return f"(thread {threading.current_thread().name})"
    return f"{source_paths.shown(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


class StreamChecker:
    """The backend of megazero.core.streams for CPU devices while checking (same interface as
    cuda_backends.TorchCudaBackend), and the record of every storage's accesses."""

    name = "stream-check"

    def __init__(self, semantics: str | None = None, devices: tuple[str, ...] = ("cpu",), collect: bool = False):
        self.semantics = semantics if semantics is not None else nccl_semantics()
        if self.semantics not in (STASH, RECORD_STREAM):
            raise ValueError(f"semantics must be {STASH!r} or {RECORD_STREAM!r}, not {self.semantics!r}")
        self.devices = tuple(devices)  # device types modelled: the CPU; the dry run adds meta, its GPU
        self.collect = collect  # violations kept in `found` and the run goes on (the dry run)
        self.found: list[str] = []  # with `collect`: each distinct violation's message, in order
        self.streams = [_Stream(MAIN, "main")]
        self.current = self.streams[MAIN]
        self.done: dict[int, int] = {}  # positions the host has synchronized on
        self.storages: dict[int, _Storage] = {}  # by StorageImpl address
        self.side_ops = 0  # ops (aten and collectives) not on the main stream
        self.violations = 0
        self.pending: list[str] = []  # found where raising is not possible (a free)
        self._communicators: dict[object, _Stream] = {}
        self._names: dict[str, int] = {}
        self._mode = op_access.AccessMode(self)
        self._previous_backend = None
        self._resize = None
        self.active = False

    # --- on and off -----------------------------------------------------------------------------
    def __enter__(self) -> "StreamChecker":
        if _streams.checker_for("cpu") is not None:
            raise RuntimeError("a stream checker is already on")
        self._previous_backend = _streams.use_cpu_backend(self)
        checker = self

        def watched(real):
            def resize(storage, nbytes):
                checker.before_resize(storage)
                result = real(storage, nbytes)
                checker.after_resize(storage)
                return result

            return resize

        self._resize = kernels.swapped((kernels.resize_storage, watched))
        self._resize.__enter__()
        self.active = True
        self._mode.__enter__()
        return self

    def __exit__(self, kind, value, tb) -> None:
        self._mode.__exit__(kind, value, tb)
        self._resize.__exit__(None, None, None)
        _streams.use_cpu_backend(self._previous_backend)
        self.active = False
        if kind is None:
            self.raise_pending()

    def summary(self) -> str:
        return (
            f"stream check ({self.describe_semantics()}): {self.side_ops} side-stream ops checked, "
            f"{self.violations} violations"
        )

    def describe_semantics(self) -> str:
        return describe_semantics(self.semantics)

    # --- streams and events (megazero.core.streams' backend interface) -------------------------------
    def current_device(self) -> int:
        return 0

    def current_stream(self, index: int) -> _Stream:
        return self.current

    def set_current_stream(self, stream: _Stream) -> None:
        self.current = stream

    def priority_range(self, index: int) -> tuple[int, int]:
        return 0, -1  # as a GPU: a high priority exists (it changes nothing here)

    def _new_stream(self, name: str) -> _Stream:
        count = self._names[name] = self._names.get(name, 0) + 1
        stream = _Stream(len(self.streams), name if count == 1 else f"{name}#{count}")
        self.streams.append(stream)
        return stream

    def create_stream(self, index: int, priority: int) -> _Stream:
        return self._new_stream("side")

    def name_stream(self, stream: _Stream, name: str) -> None:
        count = self._names[name] = self._names.get(name, 0) + 1
        stream.name = name if count == 1 else f"{name}#{count}"

    def create_event(self, index: int, timing: bool) -> _Event:
        return _Event()

    def record_event(self, event: _Event, stream: _Stream) -> None:
        event.clock, event.stamp = dict(stream.known), time.perf_counter()

    def wait_event(self, stream: _Stream, event: _Event) -> None:
        if event.clock is not None:
            _merge(stream.known, event.clock)

    def synchronize_event(self, event: _Event) -> None:
        if event.clock is not None:
            _merge(self.done, event.clock)

    def elapsed_ms(self, start: _Event, end: _Event) -> float:
        return 1000.0 * (end.stamp - start.stamp)

    def destroy_event(self, event: _Event) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream: _Stream) -> None:
        tracked = self._tracked(tensor)
        if tracked is not None:
            tracked.recorded.add(stream.id)

    # --- what the engine and the comm layer tell it ----------------------------------------------
    def label(self, tensor: torch.Tensor, what: str) -> None:
        tracked = self._tracked(tensor)
        if tracked is not None:
            tracked.label = what

    def label_of(self, tensor: torch.Tensor) -> str | None:
        tracked = self._tracked(tensor)
        return None if tracked is None else tracked.label

    def collective(self, key, name: str, reads, writes, issue, async_op: bool = True):
        """Runs `issue()` (a torch.distributed call reading `reads` and writing `writes`) as NCCL
        would (see `nccl_semantics`). Returns (issue's result, the event that ends it, or None for a
        sync op under STASH: it ran on the current stream, which has nothing to wait for).

        STASH: an async op is work on the communicator's stream after the work queued so far on the
        current stream, and nothing is recorded on its tensors: the caller keeps them alive until
        the wait (megazero.core.comm.Handle). RECORD_STREAM: every op is that work, with its tensors
        recorded on the communicator's stream."""
        if self.semantics == STASH and not async_op:
            self.op(list(reads), list(writes), [], host_sync=False)
            return issue(), None
        return self._run_on(
            key, f"{name} communicator", self.current.known, reads, writes, issue, keep=self.semantics == RECORD_STREAM
        )

    def host_thread(self, name: str, reads, writes, issue):
        """Runs `issue()` (which starts a host thread on host tensors) as work on a modelled stream
        for that thread: ordered after only what the host has synchronized on (a host thread never
        waits for queued device work), declared as reading `reads` and writing `writes`. Returns the
        event after it; the host synchronizes on it when it joins the thread."""
        return self._run_on(("host thread", name), f"{name} thread", self.done, reads, writes, issue, keep=False)[1]

    def _run_on(self, key, stream_name: str, after, reads, writes, issue, keep: bool):
        """`issue()` as work on the side stream `key` (made on first use), ordered after `after`;
        `keep`: the stream holds the tensors until it is done. Returns (result, event after it)."""
        self.raise_pending()
        issuing = self.current
        stream = self._communicators.get(key)
        if stream is None:
            stream = self._communicators[key] = self._new_stream(stream_name)
        _merge(stream.known, after)
        self.current = stream
        try:
            self.op(list(reads), list(writes), [], host_sync=False)
            if keep:
                for t in (*reads, *writes):
                    self.record_stream(t, stream)
            result = issue()
        finally:
            self.current = issuing
        done = _streams.Event("cpu", backend=self).record(stream)
        return result, done

    # --- accesses ---------------------------------------------------------------------------------
    def op(self, reads, writes, fresh, host_sync: bool) -> None:
        """One op on the current stream: checks and records its accesses."""
        self.raise_pending()
        stream = self.current
        stream.pos += 1
        stream.known[stream.id] = stream.pos
        if stream.id != MAIN:
            self.side_ops += 1
        site = _call_site()
        for tensors, write, new in ((fresh, True, True), (writes, True, False), (reads, False, False)):
            for t in tensors:
                self._access(t, write, stream, site, new)
        if host_sync:  # .item(): the host waited for this stream's work
            _merge(self.done, stream.known)

    def _tracked(self, t: torch.Tensor, new: bool = False) -> _Storage | None:
        if t.device.type not in self.devices:  # CUDA has its own backends
            return None
        storage = t.untyped_storage()
        key, ptr = storage._cdata, storage.data_ptr()
        tracked = self.storages.get(key)
        if tracked is not None and tracked.ptr != ptr:  # reallocated in C++ (aten.resize_)
            self._free(tracked, _call_site(), now=True)
            self._allocate(tracked, ptr, self.current.id, _describe(t))
        elif tracked is None:
            # First seen as an op's new output: allocated on this stream; else before checking began.
            stream = self.current.id if new else MAIN
            ref = weakref.ref(storage, functools.partial(_storage_died, weakref.ref(self), key))
            tracked = self.storages[key] = _Storage(ref, ptr, stream, _describe(t))
        return tracked

    def _access(self, t, write: bool, stream: _Stream, site: str, new: bool) -> None:
        if t.numel() == 0:
            return
        tracked = self._tracked(t, new)
        if tracked is None:
            return
        lo, hi = op_access.span(t)
        kept = []
        for record in tracked.accesses:
            was_write, sid, pos, rlo, rhi, rsite = record
            if rhi <= lo or hi <= rlo:
                kept.append(record)
                continue
            if (was_write or write) and sid != stream.id and not self._ordered(sid, pos, stream):
                kind = ("write" if write else "read") + "-after-" + ("write" if was_write else "read")
                self._violation(
                    f"stream check: {kind} race on a {_describe(t)} ({tracked.label or 'unlabelled'}): "
                    f"{'written' if was_write else 'read'} on {self.streams[sid]} at {rsite}, then "
                    f"{'written' if write else 'read'} on {stream} at {site} before {stream} waited "
                    f"on an event recorded after that",
                    now=True,
                )
            covered = lo <= rlo and rhi <= hi
            if covered and (write or (sid == stream.id and not was_write)):
                continue  # ordered before this access, and hidden by it
            kept.append(record)
        kept.append((write, stream.id, stream.pos, lo, hi, site))
        tracked.accesses = kept

    def _ordered(self, sid: int, pos: int, stream: _Stream) -> bool:
        return stream.known.get(sid, 0) >= pos or self.done.get(sid, 0) >= pos

    # --- frees --------------------------------------------------------------------------------
    def _allocate(self, tracked: _Storage, ptr: int, stream: int, first: str) -> None:
        tracked.ptr, tracked.stream, tracked.first = ptr, stream, first
        tracked.recorded, tracked.accesses = set(), []

    def _free(self, tracked: _Storage, site: str, now: bool) -> None:
        """The allocation's memory goes back to its stream: every other stream's access must be
        ordered before that stream's next work, or that stream recorded on it."""
        owner = self.streams[tracked.stream]
        holding = [self.streams[r] for r in tracked.recorded]
        for write, sid, pos, _, _, rsite in tracked.accesses:
            if (
                sid == owner.id
                or self._ordered(sid, pos, owner)
                or any(held.known.get(sid, 0) >= pos for held in holding)
            ):
                continue
            self._violation(
                f"stream check: use-after-free of a {tracked.first} ({tracked.label or 'unlabelled'}): "
                f"freed at {site}, its memory back with {owner} for reuse, while the "
                f"{'write' if write else 'read'} on {self.streams[sid]} at {rsite} may still run; "
                f"record_stream it on a stream ordered after that access (SideStream.keep_alive) or "
                f"keep it alive until {owner} waited on an event recorded after it",
                now=now,
            )
            break
        tracked.accesses = []

    def before_resize(self, storage) -> None:
        tracked = self.storages.get(storage._cdata)
        if tracked is not None and storage.nbytes() > 0:
            self._free(tracked, _call_site(), now=True)

    def after_resize(self, storage) -> None:
        tracked = self.storages.get(storage._cdata)
        if tracked is not None and storage.nbytes() > 0:
            self._allocate(tracked, storage.data_ptr(), self.current.id, tracked.first)

    # --- violations ---------------------------------------------------------------------------
    def _violation(self, message: str, now: bool) -> None:
        self.violations += 1
        if self.collect:
            if message not in self.found:
                self.found.append(message)
            return
        if now:
            raise StreamOrderError(message)
        self.pending.append(message)

    def raise_pending(self) -> None:
        if self.pending:
            message, self.pending = self.pending[0], []
            raise StreamOrderError(message)


def _storage_died(checker_ref, key: int, _ref) -> None:
    """A tracked storage's last reference is gone: a free, checked now, raised at the next op."""
    checker = checker_ref()
    if checker is None:
        return
    tracked = checker.storages.pop(key, None)
    if tracked is not None and checker.active:
        checker._free(tracked, _call_site(), now=False)


@contextlib.contextmanager
def checking(semantics: str | None = None, devices: tuple[str, ...] = ("cpu",), collect: bool = False):
    """Models and checks the streams of CPU devices inside the block (see the module docstring);
    `semantics` (STASH or RECORD_STREAM) overrides the torch version's NCCL model. `devices`: the
    device types modelled (the dry run adds "meta", its GPU: meta storages are tracked as CPU ones,
    without values); `collect`: violations are kept in `checker.found` instead of raised."""
    with StreamChecker(semantics, devices, collect) as checker:
        yield checker
