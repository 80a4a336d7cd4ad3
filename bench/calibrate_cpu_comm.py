"""bench/calibrate_cpu.py's gloo collectives (docs/dry_run.md, "Calibrating a machine"): each op's
time per call over a world of n pool ranks and over its groups of g < n ranks at once
(sweep_collectives, measure_collectives), the ring's bytes on the wire (wire_bytes) and the
alpha-beta fit (fit_alpha_beta). Every figure at one torch thread per process, as calibrate_cpu sets
it; writes nothing (calibrate_cpu renders the file).
"""

from __future__ import annotations

import importlib
import statistics
import time

import torch

from calibrate_cpu_step import seconds_per_call as _seconds_per_call, sharing_slowdown

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")  # every calibration has them
# MoE's expert dispatch (megazero.core.comm.all_to_all / all_to_all_uneven); files before it lack it
ALL_OPS = OPS + ("all_to_all",)
# timed over groups smaller than the world too (send_recv is pairs at every world already)
GROUP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
GROUP_KEYS = ("group_ranks", "host_ranks", "group_alpha_us", "group_beta_gbps", "group_measured_us")
WORLDS = (2, 4, 8)
SIZES = tuple(1024 * 4**i for i in range(8))  # 1 KiB .. 16 MiB
# A collective in a step follows compute (tp2's all-reduces: ~0.2-0.5 ms of a layer apart): timed so,
# gloo's per-call cost at 2 ranks was 1.2-1.8 ms against 0.4-1.0 ms back to back at the same moment.
GAP_US = 200.0


def wire_bytes(op: str, ranks: int, buffer_bytes: float) -> float:
    """Bytes each rank puts on the wire by the ring algorithm: all_reduce 2(n-1)/n B, all_gather and
    reduce_scatter (n-1)/n B (B the full buffer: the gather's output, the scatter's input), send_recv B."""
    n = ranks
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "send_recv": 1.0,
        "all_to_all": (n - 1) / n,
    }[op]
    return factor * buffer_bytes


def fit_alpha_beta(wire: list[float], seconds: list[float]) -> tuple[float, float]:
    """time = alpha + wire / beta, fitted by Theil-Sen: 1/beta the median of the slopes between every
    two sizes, alpha the median of the times less their wire time at that slope. Returns (alpha in
    microseconds, beta in GB/s); a negative intercept (latency below the noise) is alpha = 0.

    Robust to a size or two timed wrong: on a shared machine one batch of one size can read 40% low
    or 2x high (the quiet 2-rank all_reduce of 2026-12-07 18:54 read 465 us at 256 KiB between 867 us
    at 16 KiB and 1,733 us at 1 MiB). A least-squares line bends to such a point, and its intercept
    moved the all_reduce's latency from the ~1.2 ms its small sizes cost to 654 us: every small
    synchronous all-reduce of a tensor-parallel step (tp2: 161 a step) was then 0.5 ms short. The
    medians also keep alpha from being ruled by the large messages' few-percent noise (each of
    those is many alphas)."""
    if len(wire) != len(seconds) or len(wire) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 (bytes, time) points, got {len(wire)}")
    pairs = [(i, j) for i in range(len(wire)) for j in range(i + 1, len(wire)) if wire[i] != wire[j]]
    slopes = [(seconds[j] - seconds[i]) / (wire[j] - wire[i]) for i, j in pairs]
    inv_beta = statistics.median(slopes) if slopes else 0.0
    if inv_beta <= 0:
        raise ValueError("the times do not grow with the message size: no bandwidth to fit")
    alpha = max(0.0, statistics.median(t - w * inv_beta for w, t in zip(wire, seconds)))
    return alpha * 1e6, 1e-9 / inv_beta


def exchange(send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
    """One p2p exchange as the step makes it (megazero.core.comm.send_recv: ring attention's K/V,
    a pipeline stage's activation out and gradient in): both sides post a send and a receive in one
    batch_isend_irecv and wait for both. Timed one after another, each is a round trip, the latency
    a step pays; a stream of one-way sends (the earlier figure) overlaps them and shows only the
    throughput, ~10x less at small sizes."""
    import torch.distributed as dist

    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, receive, peer)])
    for work in works:
        work.wait()


def _compute_between(gap_us: float):
    """What a step does between two collectives: `gap_us` of small GEMMs (the grid's 64-wide ones)."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    mm_s = _seconds_per_call(lambda: torch.mm(a, b), 0.01, 3)
    count = round(gap_us * 1e-6 / mm_s)

    def compute():
        for _ in range(count):
            torch.mm(a, b)

    return compute


def groups_of(n: int) -> list[int]:
    """The group sizes timed at a world of n ranks: 2, 4, .. n (powers of 2), as a step's tp, dp, ep
    groups divide its ranks."""
    return [g for g in (2**i for i in range(1, n.bit_length())) if n % g == 0]


def sweep_collectives(
    ctx, sizes=SIZES, batches: int = 5, min_seconds: float = 0.05, gap_us: float = 0.0, group_size=None, ops=OPS
) -> dict:
    """On every rank of the default gloo group (a megazero.testing pool's worker): seconds per call
    of each op at each buffer size, the slowest rank's, median of batches. -> {op: [seconds per size]}.
    `group_size` g < the world's n: the ranks split into n / g disjoint groups (consecutive ranks, one
    new_group each) and every group runs the op at the same time, as a step's tp or dp groups do;
    send_recv is always pairs. `gap_us` > 0: each call follows that much compute, as in a step, and a
    batch's time is its calls' with the compute less the same compute timed alone just before."""
    import torch.distributed as dist
    from megazero.core.comm import all_gather_single, reduce_scatter_single  # the calls megazero makes

    n, rank = ctx.world_size, ctx.rank
    g = group_size or n
    # every rank makes every group (new_group is collective over the world), then uses its own
    groups = [dist.new_group(list(range(first, first + g))) for first in range(0, n, g)] if g < n else [None]
    mine = groups[rank // g] if g < n else None
    peer = rank ^ 1  # send_recv: ranks in pairs (0, 1), (2, 3), ...
    received = {size: torch.zeros(size // 4) for size in sizes}

    def calls_for(size):
        full, shard = torch.zeros(size // 4), torch.zeros(size // 4 // g)
        swapped = torch.zeros(size // 4)
        calls = {
            "all_reduce": lambda: dist.all_reduce(full, group=mine),
            "all_gather": lambda: all_gather_single(full, shard, group=mine),
            "reduce_scatter": lambda: reduce_scatter_single(shard, full, group=mine),
            "send_recv": lambda: exchange(full, received[size], peer),
            "all_to_all": lambda: dist.all_to_all_single(swapped, full, group=mine),
        }
        return {op: calls[op] for op in ops}

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    compute = _compute_between(gap_us)
    found = {op: [] for op in ops}
    for size in sizes:
        for op, call in calls_for(size).items():
            call()
            dist.barrier()
            t0 = time.perf_counter()
            call()
            count = int(min(200, max(1, min_seconds / slowest(time.perf_counter() - t0))))
            per_batch = []
            for _ in range(batches):
                t0 = time.perf_counter()
                for _ in range(count):
                    compute()
                alone = time.perf_counter() - t0
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(count):
                    compute()
                    call()
                mixed = time.perf_counter() - t0
                per_batch.append(slowest(max(mixed - alone, 0.05 * mixed) / count))
            found[op].append(statistics.median(per_batch))
    for group in groups:
        if group is not None:
            dist.destroy_process_group(group)
    return found


def _fitted(op: str, g: int, sizes, times, world_beta: float | None = None) -> tuple[float, float, list]:
    """(alpha us, beta GB/s, the times in us) of one op's sweep. A group's four sizes at 8 ranks on a
    loaded machine can show no slope (4 MiB's wire time below the latencies' noise): with
    `world_beta` the bandwidth is the whole world's, and alpha the median of the times less their
    wire time at it (fit_alpha_beta's rule)."""
    wire = [wire_bytes(op, g, s) for s in sizes]
    try:
        alpha, beta = fit_alpha_beta(wire, times)
    except ValueError:
        if world_beta is None:
            raise
        beta = world_beta
        alpha = max(0.0, statistics.median(t - w / (beta * 1e9) for w, t in zip(wire, times))) * 1e6
        print(f"  {op} over groups of {g}: no slope to fit; the world's {beta:.3f} GB/s taken", flush=True)
    return round(alpha, 2), round(beta, 4), [round(t * 1e6, 1) for t in times]


def measure_collectives(
    worlds=WORLDS, sizes=SIZES, batches: int = 5, gap_us: float = 0.0, group_sizes=None
) -> tuple[dict, dict]:
    """({op: {"ranks", "alpha_us", "beta_gbps", "measured_us", and the groups': "group_ranks",
    "host_ranks", "group_alpha_us", "group_beta_gbps", "group_measured_us"}}, {"ranks", "slowdown"})
    from one pool per world size: its ranks' GEMM rate all at once against one process's alone just
    before (`slowdown`: how much slower a rank computes with that many ranks running), then the sweep
    of every op over the whole world (`ranks`: send_recv's pairs at that world), then over groups of
    each smaller size g at once (`group_sizes`, the sizes of buffer swept there: ~2x the calibration
    with every size) with all n ranks alive (`group_ranks` g, `host_ranks` n)."""
    from megazero.testing import DistributedPool

    module = importlib.import_module("calibrate_cpu_comm")  # by module name: the workers import them
    step_module = importlib.import_module("calibrate_cpu_step")
    group_sizes = list(group_sizes or sizes)
    keys = ("ranks", "alpha_us", "beta_gbps", "measured_us")
    out = {op: {k: [] for k in keys} for op in ALL_OPS}
    for op in GROUP_OPS:
        out[op].update({k: [] for k in GROUP_KEYS})
    shared = {"ranks": [1], "slowdown": [1.0]}
    for n in worlds:
        pool = DistributedPool(n)
        try:
            shared["ranks"].append(n)
            shared["slowdown"].append(round(max(1.0, sharing_slowdown(pool, step_module.gemm_rate)), 3))
            found = pool.run(module.sweep_collectives, list(sizes), batches, 0.05, gap_us, None, ALL_OPS, timeout=1800)
            inner = {
                g: pool.run(module.sweep_collectives, group_sizes, batches, 0.05, gap_us, g, GROUP_OPS, timeout=1800)[0]
                for g in groups_of(n)[:-1]
            }
        finally:
            pool.close()
        for op in ALL_OPS:
            for key, value in zip(keys, (n, *_fitted(op, n, sizes, found[0][op]))):
                out[op][key].append(value)
        for g, times in inner.items():
            for op in GROUP_OPS:
                fitted = _fitted(op, g, group_sizes, times[op], out[op]["beta_gbps"][-1])
                for key, value in zip(GROUP_KEYS, (g, n, *fitted)):
                    out[op][key].append(value)
        print(
            f"  {n} ranks: GEMMs {shared['slowdown'][-1]:.2f}x slower than alone; "
            + ", ".join(
                f"{op} alpha {out[op]['alpha_us'][-1]:.0f} us beta {out[op]['beta_gbps'][-1]:.3f} GB/s"
                for op in ALL_OPS
            )
            + "".join(
                f"; groups of {g}: "
                + ", ".join(f"{op} alpha {out[op]['group_alpha_us'][i]:.0f} us" for op in GROUP_OPS)
                for i, g in enumerate(inner, start=len(out["all_reduce"]["group_ranks"]) - len(inner))
            ),
            flush=True,
        )
    return out, shared
