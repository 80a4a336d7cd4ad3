"""The CUDA driver behind megazero.core.streams: the backend objects whose calls make and order CUDA
streams and events (`CudartBackend`: cuda-python's runtime, cudaStreamCreateWithPriority;
`TorchCudaBackend`: torch.cuda, the fallback and where torch's current stream is read and set), and
the choice between them made once per process (`default_cuda_backend`).

Owns nothing but those calls: which work goes on which stream, events' order and timers are
megazero.core.streams'. Tests inject a fake cuda-python runtime to check priorities and errors
without a GPU; the CPU stream sanitizer (megazero.core.stream_check) has the same interface.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

log = logging.getLogger(__name__)


class CudaError(RuntimeError):
    """A CUDA runtime call returned a non-zero status."""


class TorchCudaBackend:
    """Streams and events from torch.cuda: the fallback, and where torch's own notion of the current
    stream is read or changed (that is torch state, whichever backend created the stream)."""

    name = "torch.cuda"

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_stream(self, index: int):
        return torch.cuda.current_stream(index)

    def set_current_stream(self, stream) -> None:
        torch.cuda.set_stream(stream)

    def priority_range(self, index: int) -> tuple[int, int]:
        """(least, greatest) priority, CUDA's convention: lower numbers run first. torch clamps an
        out-of-range request to the highest priority it supports, and reports what it chose."""
        return 0, torch.cuda.Stream(index, priority=-(1 << 16)).priority

    def create_stream(self, index: int, priority: int):
        return torch.cuda.Stream(index, priority=priority)

    def create_event(self, index: int, timing: bool):
        return torch.cuda.Event(enable_timing=timing)

    def record_event(self, event, stream) -> None:
        event.record(stream)

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def synchronize_event(self, event) -> None:
        event.synchronize()

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)

    def destroy_event(self, event) -> None:
        pass  # torch.cuda.Event frees itself

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


class CudartBackend(TorchCudaBackend):
    """Streams and events through cuda-python's runtime bindings (`runtime` is the module, injected
    so tests can pass a fake). Every call's status is checked: a failure raises CudaError naming the
    function. Stream and event handles are plain ints (cudaStream_t / cudaEvent_t values)."""

    name = "cuda-python"

    def __init__(self, runtime):
        self.rt = runtime

    def _call(self, function: str, *args):
        status, *values = getattr(self.rt, function)(*args)
        if int(status) != 0:
            raise CudaError(f"{function} failed: {self._error_name(status)} ({int(status)})")
        return values[0] if len(values) == 1 else tuple(values)

    def _error_name(self, status) -> str:
        lookup = getattr(self.rt, "cudaGetErrorName", None)
        if lookup is not None:
            ok, name = lookup(status)
            if int(ok) == 0:
                return name.decode() if isinstance(name, bytes) else str(name)
        return str(status)

    @contextlib.contextmanager
    def _on_device(self, index: int):
        """Streams and events belong to the current device: make it `index`, then put the caller's
        back (torch's runtime shares this per-thread state)."""
        previous = int(self._call("cudaGetDevice"))
        if previous != index:
            self._call("cudaSetDevice", index)
        try:
            yield
        finally:
            if previous != index:
                self._call("cudaSetDevice", previous)

    def priority_range(self, index: int) -> tuple[int, int]:
        with self._on_device(index):
            least, greatest = self._call("cudaDeviceGetStreamPriorityRange")
        return int(least), int(greatest)

    def create_stream(self, index: int, priority: int):
        # Non-blocking: no implicit synchronisation with the legacy default stream, as torch's streams.
        # The stream lives as long as the process (torch's own streams are never destroyed either).
        with self._on_device(index):
            handle = self._call("cudaStreamCreateWithPriority", int(self.rt.cudaStreamNonBlocking), priority)
        return torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", index))

    def create_event(self, index: int, timing: bool):
        flags = self.rt.cudaEventDefault if timing else self.rt.cudaEventDisableTiming
        with self._on_device(index):
            return int(self._call("cudaEventCreateWithFlags", int(flags)))

    def record_event(self, event, stream) -> None:
        self._call("cudaEventRecord", event, stream.cuda_stream)

    def wait_event(self, stream, event) -> None:
        self._call("cudaStreamWaitEvent", stream.cuda_stream, event, 0)

    def synchronize_event(self, event) -> None:
        self._call("cudaEventSynchronize", event)

    def elapsed_ms(self, start, end) -> float:
        return float(self._call("cudaEventElapsedTime", start, end))

    def destroy_event(self, event) -> None:
        self._call("cudaEventDestroy", event)


def import_cudart():
    """cuda-python's runtime module: `cuda.bindings.runtime` (12.6.1 and later), else the older
    `cuda.cudart`; None when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime

        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart

        return cudart
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def default_cuda_backend():
    """The backend for CUDA devices in this process (chosen once, so the fallback is logged once)."""
    runtime = import_cudart()
    if runtime is None:
        log.warning(
            "megazero.core.streams: cuda-python is not installed, streams and events use torch.cuda "
            "(pip install 'megazero[cuda]' for cuda-python)"
        )
        return TorchCudaBackend()
    backend = CudartBackend(runtime)
    try:
        backend._call("cudaGetDeviceCount")
    except CudaError as err:
        # e.g. cuda-python 13 under a CUDA 12 driver (cudaErrorInsufficientDriver)
        log.warning(
            f"megazero.core.streams: cuda-python cannot use this driver ({err}), streams and events use "
            f"torch.cuda (install the cuda-python major matching nvidia-smi's CUDA Version)"
        )
        return TorchCudaBackend()
    return backend
