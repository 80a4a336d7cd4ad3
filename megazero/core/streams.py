"""CUDA streams and events for the whole runtime, and the same API as a no-op on CPU.

Owns: the side streams (`Streams`: host<->device copies, stage-3 parameter prefetch, gradient
reduction), the events that order them against the compute stream, timers for a step's phases, and
the pinned, non-blocking host->device copy of token batches. It knows nothing of ZeRO, TP or PP: the
engine and the training loop create one `Streams(device)` and say which work goes where.

On a CUDA device the streams are made by cuda-python (`pip install megazero[cuda]`) with
cudaStreamCreateWithPriority and handed to torch as `torch.cuda.ExternalStream`, so torch kernels and
NCCL calls made inside `with streams.reduce:` run on them. Without cuda-python the same streams and
events come from torch.cuda (one logged line says so). On CPU there is no backend: every call below
returns at once, so the CPU tests run the identical code path; or, while megazero.core.stream_check is
on, the checker is the CPU backend: it models the streams and events and checks every tensor access
against them, so the CPU runs the GPU's stream path and fails where a GPU would race.

All driver calls sit behind a small backend object (megazero.core.cuda_backends: `CudartBackend`,
`TorchCudaBackend`); tests inject a fake one to check priorities and the order of event records and
waits without a GPU.
"""

from __future__ import annotations

import time

import torch

from megazero.core.cuda_backends import default_cuda_backend


_cpu_backend = None  # the stream checker while one is on (megazero.core.stream_check), else None


def use_cpu_backend(backend):
    """Makes `backend` (the stream checker, or None) the backend of CPU devices for streams and events
    made from now on; returns the previous one."""
    global _cpu_backend
    previous, _cpu_backend = _cpu_backend, backend
    return previous


def checker_for(device):
    """The stream checker modelling `device` while one is on (a CPU device; also the meta device
    under the dry run, whose checker models both: its `devices`), else None."""
    if _cpu_backend is None or torch.device(device).type not in getattr(_cpu_backend, "devices", ("cpu",)):
        return None
    return _cpu_backend


def backend_for(device: torch.device):
    """The CUDA backend on CUDA; elsewhere None (every stream and event call is a no-op there), or
    the stream checker modelling the device while one is on."""
    device = torch.device(device)
    if device.type == "cuda":
        return default_cuda_backend()
    return checker_for(device)


def label(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Names a buffer (e.g. "stage-3 unit 'layers.0' (gathered)") in the stream checker's messages;
    a no-op unless a checker is on."""
    if _cpu_backend is not None:
        _cpu_backend.label(tensor, what)
    return tensor


def record_on_current_stream(tensor: torch.Tensor) -> None:
    """The caching allocator must not reuse `tensor`'s memory before the work queued so far on the
    current stream is done (a buffer allocated on another stream and read here)."""
    backend = backend_for(tensor.device)
    if backend is not None:
        backend.record_stream(tensor, backend.current_stream(_device_index(tensor.device, backend)))


def _device_index(device: torch.device, backend) -> int:
    return device.index if device.index is not None else backend.current_device()


class Event:
    """A CUDA event on `device`; on CPU, a perf_counter stamp when `timing`, else nothing.

    `stream` arguments take a SideStream, a torch stream, or None for the current stream."""

    def __init__(self, device, timing: bool = False, backend=None):
        self._handle = None
        self.device = torch.device(device)
        self.timing = timing
        self._backend = backend if backend is not None else backend_for(self.device)
        self._stamp = None  # CPU: perf_counter at record()
        if self._backend is not None:
            self._index = _device_index(self.device, self._backend)
            self._handle = self._backend.create_event(self._index, timing)

    def _raw(self, stream):
        if stream is None:
            return self._backend.current_stream(self._index)
        return stream.stream if isinstance(stream, SideStream) else stream

    def record(self, stream=None) -> "Event":
        """Marks the work queued so far on `stream`."""
        if self._backend is None:
            self._stamp = time.perf_counter() if self.timing else None
        else:
            self._backend.record_event(self._handle, self._raw(stream))
        return self

    def wait(self, stream=None) -> None:
        """Work queued on `stream` after this call starts only once the recorded work is done."""
        if self._backend is not None:
            self._backend.wait_event(self._raw(stream), self._handle)

    def synchronize(self) -> None:
        """Blocks the host until the recorded work is done."""
        if self._backend is not None:
            self._backend.synchronize_event(self._handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end` (waits for `end`); both need timing=True."""
        if not (self.timing and end.timing):
            raise RuntimeError("Event.elapsed_ms needs both events created with timing=True")
        if self._backend is None:
            if self._stamp is None or end._stamp is None:
                raise RuntimeError("Event.elapsed_ms: record() both events first")
            return 1000.0 * (end._stamp - self._stamp)
        end.synchronize()
        return self._backend.elapsed_ms(self._handle, end._handle)

    def __del__(self):
        if self._handle is not None:
            try:
                self._backend.destroy_event(self._handle)
            except Exception:  # interpreter shutdown: the bindings may be gone
                pass


class SideStream:
    """One side stream; `with side:` makes it torch's current stream on its device.

    "The main stream" below is the stream that is current outside this context (the compute stream):
    inside `with side:` it is the one that was current on entry. On CPU every method is a no-op."""

    def __init__(self, name: str, device, backend, priority: int = 0):
        self.name, self.device, self.priority = name, torch.device(device), priority
        self._backend = backend
        self._outer: list = []  # the main stream at each (nested) entry
        self.stream = None  # the torch stream (ExternalStream on cuda-python)
        if backend is not None:
            self._index = _device_index(self.device, backend)
            self.stream = backend.create_stream(self._index, priority)
            if hasattr(backend, "name_stream"):  # the stream checker's messages name it
                backend.name_stream(self.stream, name)
            # Reused for every wait: a stream wait captures the event's state when it is issued.
            self._main_done = Event(self.device, backend=backend)
            self._side_done = Event(self.device, backend=backend)

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    def _main(self):
        if self._outer:
            return self._outer[-1]
        return self._backend.current_stream(self._index)

    def __enter__(self) -> "SideStream":
        if self.enabled:
            self._outer.append(self._backend.current_stream(self._index))
            self._backend.set_current_stream(self.stream)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._backend.set_current_stream(self._outer.pop())

    def wait_current(self) -> None:
        """This stream waits for the work queued so far on the main stream (e.g. before reducing
        gradients the backward just produced)."""
        if self.enabled:
            self._main_done.record(self._main())
            self._main_done.wait(self.stream)

    def current_waits(self) -> None:
        """The main stream waits for the work queued so far on this stream (e.g. before a forward
        reads parameters a prefetch gathered)."""
        if self.enabled:
            self._side_done.record(self.stream)
            self._side_done.wait(self._main())

    def keep_alive(self, tensor: torch.Tensor) -> torch.Tensor:
        """Call for a tensor that both this stream and the main stream use, after queuing the uses.

        The caching allocator ties a block to the stream that allocated it and hands it out again on
        that stream as soon as the tensor is freed, without waiting for other streams. So the stream
        to record is the *other* one: a gathered parameter allocated here and read by the main
        stream's forward needs the main stream recorded; a gradient allocated by the main stream's
        backward and reduced here needs this stream recorded. Both are recorded, because the
        allocator ignores a record on the allocating stream, so this is right whichever side
        allocated it. On free, the block then waits for the work queued by that time on both."""
        if self.enabled:
            self._backend.record_stream(tensor, self.stream)
            self._backend.record_stream(tensor, self._main())
        return tensor


class Streams:
    """The side streams of one device: `copy` (host<->device), `prefetch` (stage-3 parameter
    gathers) and `reduce` (gradient reductions). prefetch and reduce get the highest priority the
    device reports, so a gather the next layer waits for is not stuck behind bulk work; copy gets the
    default priority. `enabled` is False on CPU, where all three are no-ops (unless the stream
    checker is on: then they are its modelled streams)."""

    def __init__(self, device, backend=None):
        self.device = torch.device(device)
        self.backend = backend if backend is not None else backend_for(self.device)
        self.enabled = self.backend is not None
        least, greatest = 0, 0
        if self.enabled:
            least, greatest = self.backend.priority_range(_device_index(self.device, self.backend))
        self.priority_range = (least, greatest)
        self.copy = SideStream("copy", self.device, self.backend, priority=0)
        self.prefetch = SideStream("prefetch", self.device, self.backend, priority=greatest)
        self.reduce = SideStream("reduce", self.device, self.backend, priority=greatest)

    def describe(self) -> str:
        if not self.enabled:
            return f"streams: none on {self.device} (no-op)"
        return (
            f"streams on {self.device} via {self.backend.name}: copy={self.copy.priority} "
            f"prefetch={self.prefetch.priority} reduce={self.reduce.priority} "
            f"(priority range least={self.priority_range[0]} greatest={self.priority_range[1]})"
        )


class Timers:
    """Named wall-clock timers for a step's phases (DeepSpeed's `wall_clock_breakdown`: forward,
    backward, reduce, step). On CUDA, start/stop record events on the given (default: current)
    stream and nothing waits for the GPU until `elapsed_ms` reads them; on CPU they are perf_counter
    stamps (host time, which on CPU is the work's time)."""

    def __init__(self, device, backend=None):
        self.device = torch.device(device)
        self._backend = backend if backend is not None else backend_for(self.device)
        self._running: dict[str, Event] = {}
        self._done: dict[str, list[tuple[Event, Event]]] = {}

    def _event(self, stream) -> Event:
        return Event(self.device, timing=True, backend=self._backend).record(stream)

    def start(self, name: str, stream=None) -> None:
        """Starts `name` on `stream` (a SideStream, a torch stream, None: the current one): time a
        side stream's work (e.g. reductions) on that stream."""
        if name in self._running:
            raise RuntimeError(f"timer {name!r} is already running; stop it first")
        self._running[name] = self._event(stream)

    def stop(self, name: str, stream=None) -> None:
        if name not in self._running:
            raise RuntimeError(f"timer {name!r} was not started")
        self._done.setdefault(name, []).append((self._running.pop(name), self._event(stream)))

    def elapsed_ms(self, reset: bool = True) -> dict[str, float]:
        """Total milliseconds per timer over its finished start/stop intervals since the last reset
        (running timers are left running and not counted)."""
        totals = {name: sum(start.elapsed_ms(end) for start, end in pairs) for name, pairs in self._done.items()}
        if reset:
            self._done.clear()
        return totals


def host_thread_work(device, name: str, reads, writes, start) -> Event:
    """Work a host thread does on host tensors (`reads`, `writes`), begun by `start()`. A host thread
    sees only what the host has waited for, never the device's queued work: synchronize on an event
    after any copy or kernel touching these tensors before starting it. Synchronize on the event
    returned once the thread is joined, before the host (or the device) touches them again. Under the
    stream checker the thread is a modelled stream and both rules are checked; otherwise the event
    orders nothing (the join itself does)."""
    checker = checker_for(device)
    if checker is None:
        start()
        return Event("cpu")
    return checker.host_thread(name, reads, writes, start)


def copy_to_device(tensor: torch.Tensor, device, streams: Streams | None = None) -> torch.Tensor:
    """`tensor` on `device`. A CPU target returns it unchanged (under the stream checker: a copy made
    on `streams.copy`, as a GPU's would be). A CUDA target copies from pinned host memory with
    non_blocking=True: on `streams.copy` when given (the main stream then waits for the copy), else
    on the current stream. Issue it ahead of use (e.g. the next microbatch) to overlap.

    The pinned staging buffer comes from torch's caching host allocator, which records the copy's
    stream and does not reuse the buffer before the copy has run; the result, allocated on the copy
    stream and used on the main one, is recorded with keep_alive."""
    device = torch.device(device)
    # Under the stream checker a CPU or meta (the dry run's GPU) target is a modelled device.
    modelled = device.type in ("cpu", "meta") and streams is not None and streams.enabled
    if tensor.device == device and device.type != "cpu" or not modelled and device.type == "cpu":
        return tensor
    if not modelled and device.type != "cuda":  # meta without the checker: no streams, no pinning
        return tensor.to(device)
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    if streams is None or not streams.enabled:
        return tensor.to(device, non_blocking=True)
    # No wait_current first on a GPU: the source is host memory that no queued GPU work writes. On
    # the CPU the main stream's ops are what write it.
    if device.type == "cpu":
        streams.copy.wait_current()
    with streams.copy:
        out = tensor.clone() if device.type == "cpu" else tensor.to(device, non_blocking=True)
    streams.copy.current_waits()
    return streams.copy.keep_alive(out)
