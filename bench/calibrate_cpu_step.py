"""bench/calibrate_cpu.py's measurements of a training step's own costs on this CPU (docs/dry_run.md,
"Calibrating a machine"): the host's cost per op fitted on the CPU grid's one-rank step
(one_rank_step), and how much slower a rank computes with n ranks running at once than one alone
(sharing_slowdown), and the timing of a call both scripts use (seconds_per_call). Every figure at one
torch thread per process, as calibrate_cpu sets it.
"""

from __future__ import annotations

import importlib
import os
import statistics
import time
from pathlib import Path

import torch


def seconds_per_call(fn, min_seconds: float = 0.02, batches: int = 5) -> float:
    """Median over batches of (batch time / calls), each batch at least min_seconds long."""
    fn()  # warm: first-call allocations and dispatch caches
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, int(min_seconds / once))
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def gemm_rate(ctx=None, seconds: float = 1.0) -> float:
    """Small GEMMs (the grid's 64-wide) a second, one process running them for `seconds`; on a pool's
    ranks (`ctx`), every rank at once."""
    if ctx is not None:
        import torch.distributed as dist

        dist.barrier()
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        calls += 1
    return calls / (time.perf_counter() - t0)


def sharing_slowdown(pool, rate, rounds: int = 5, seconds: float = 0.4) -> float:
    """One process's GEMM rate alone over each of the pool's ranks' with all of them running at once,
    alternated `rounds` times (the load drifts), the median."""
    ratios = []
    for _ in range(rounds):
        alone = gemm_rate(None, seconds)
        ratios.append(alone / statistics.mean(pool.run(rate, seconds, timeout=600)))
    return statistics.median(ratios)


def compute_device(matmul: list, gbps: float):
    """The device model of what is measured so far (GEMMs, memory), at no launch cost: what the
    one-rank step, which makes no collective, is timed by."""
    from megazero.dry_run.devices import Device

    return Device(
        key="cpu",
        name="calibrating",
        kind="cpu",
        memory_gb=0.0,
        peak_tflops={"fp32": 1.0},
        memory_gbps=gbps,
        launch_us=0.0,
        matmul=[list(r) for r in matmul],
        cores=os.cpu_count() or 1,
    )


def one_rank_step(device, steps: int = 8) -> dict:
    """The host's cost per op in a real step: the CPU grid's model (bench/cpu_grid.py's, one rank,
    launched with torchrun and timed as the layouts are: the median step after the first two) beside
    the dry run's trace of the same step timed by `device` (compute_device: the GEMMs and memory just
    measured); launch_us = (measured - the device's work) / the ops the step issues
    (megazero.dry_run.speed.fitted_launch_us). One rank only: the layouts the bench reports are
    predicted with it, none of them is fitted."""
    import tempfile
    from megazero.dry_run import speed
    from megazero.dry_run.job import simulate

    cpu_grid = importlib.import_module("cpu_grid")
    argv = cpu_grid.layout_argv([], steps)
    with tempfile.TemporaryDirectory(prefix="calibrate_one_rank_") as folder:
        measured_ms = cpu_grid.measure_layout(1, argv, Path(folder))
    runs = simulate(argv, 1, local_world=1, device_kind="cpu", save=False)
    if runs[0].error is not None:
        raise RuntimeError(f"the dry run of the one-rank step failed: {runs[0].error}")
    launch, work, ops = speed.fitted_launch_us(speed.step_traces(runs), device, measured_ms / 1e3)
    print(
        f"one-rank step: measured {measured_ms:.1f} ms, device work {work * 1e3:.1f} ms, {ops} ops issued: "
        f"launch_us {launch:.2f}",
        flush=True,
    )
    if launch == 0.0:
        print(
            "  the device's work alone exceeds the measured step: the load moved between the GEMM sweep "
            "and the step; rerun on a quieter machine",
            flush=True,
        )
    return dict(launch_us=launch, one_rank_ms=measured_ms, one_rank_work_ms=work * 1e3, one_rank_ops=ops)
