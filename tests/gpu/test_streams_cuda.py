"""megazero.core.streams on a real CUDA device, with cuda-python when installed and with the torch.cuda
fallback: priorities as the device reports them, event ordering between streams, pinned copies
on the copy stream, timers."""

import pytest
import torch

from megazero.core import cuda_backends, streams as st

BACKENDS = {"default": None, "torch": cuda_backends.TorchCudaBackend()}


@pytest.fixture(params=list(BACKENDS))
def streams(request):
    s = st.Streams(torch.device("cuda", torch.cuda.current_device()), backend=BACKENDS[request.param])
    print(s.describe())
    return s


def test_priorities_are_the_devices(streams):
    least, greatest = streams.priority_range
    assert greatest <= least
    assert streams.prefetch.stream.priority == greatest and streams.reduce.stream.priority == greatest
    assert streams.copy.stream.priority == 0


def _busy(x: torch.Tensor, rounds: int = 200) -> None:
    """Queues enough kernels that a stream not waiting for them would run ahead."""
    for _ in range(rounds):
        x.mul_(1.0)


def test_side_stream_sees_main_writes_after_wait_current(streams):
    x = torch.ones(1 << 24, device="cuda")
    _busy(x)
    x.fill_(3.0)
    with streams.reduce as side:
        side.wait_current()
        y = x * 2
        side.keep_alive(x)
    side.current_waits()
    assert torch.equal(y, torch.full_like(x, 6.0))


def test_main_sees_side_writes_after_current_waits(streams):
    with streams.prefetch as side:
        side.wait_current()
        g = torch.ones(1 << 24, device="cuda")
        _busy(g)
        g.fill_(5.0)
        side.keep_alive(g)
    side.current_waits()
    assert float(g.sum()) == 5.0 * (1 << 24)


def test_copy_to_device_on_the_copy_stream(streams):
    host = torch.arange(1 << 22, dtype=torch.float32)
    out = st.copy_to_device(host, "cuda", streams)
    assert out.device.type == "cuda" and torch.equal(out.cpu(), host)
    assert st.copy_to_device(out, out.device, streams) is out


def test_timers_and_events_measure_gpu_work(streams):
    a = torch.randn(4096, 4096, device="cuda")
    timers = st.Timers("cuda", backend=streams.backend)
    start = st.Event("cuda", timing=True, backend=streams.backend).record()
    timers.start("matmul")
    for _ in range(10):
        a = a @ a.T / 4096
    timers.stop("matmul")
    end = st.Event("cuda", timing=True, backend=streams.backend).record()
    elapsed = timers.elapsed_ms()["matmul"]
    assert elapsed > 0 and start.elapsed_ms(end) >= elapsed * 0.5
