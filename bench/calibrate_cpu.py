"""Measures this CPU as the dry run's timeline models a device, and writes the measured device
model (default megazero/dry_run/cpu_measured.toml; docs/dry_run.md, "Calibrating a machine").

    python bench/calibrate_cpu.py                      # ~5-8 min on 2 quiet cores
    python bench/calibrate_cpu.py --quick --output /tmp/cpu.toml

What it measures, every figure at one torch thread per process (as torchrun's ranks run: OMP_NUM_THREADS=1):
- matmul: fp32 `torch.mm` of the GEMM shapes the CPU grid's layers run (the small GPT of
  bench/cpu_layouts.py: hidden, ffn, vocabulary and attention GEMMs, forward and backward, at tp 1 / 2
  and cp 1 / 2) and a few larger ones; GFLOP/s = 2mnk / (time per call - a 1x1x1 mm's), the
  time a GEMM adds to the host's per-op cost (the time per call is kept beside it);
- memory bandwidth: `copy_` (2 bytes moved per byte) and `add` (3) over buffers of 64-256 MiB, past
  the last-level cache; the median of those;
- host cost per op: `launch_us`, from a real training step of the CPU grid's model on one rank
  (one_rank_step: measured with torchrun as bench/cpu_layouts.py measures its layouts, minus the
  device model's time for the dry run's trace of that step, over the ops the trace issues): the
  loop's, schedule's, optimizer's and autograd's Python and each kernel's cost in a step beyond its
  back-to-back figure; `bare_op_us`, a 1-element `add` out of autograd; `tiny_step_op_us`, a tiny
  GPT's forward + backward over every aten op it dispatches (views included: ~2.4x the ops the
  trace counts), the load probe bench/cpu_layouts.py repeats before each layout;
- gloo collectives at 2, 4 and 8 ranks: all_reduce, all_gather (into one tensor), reduce_scatter (of
  one tensor), all_to_all (MoE's expert dispatch), send_recv (ranks in pairs, every pair at once, each
  call an exchange: a send and a receive in one batch_isend_irecv, waited, as a step's p2p runs), over
  message sizes 1 KiB - 16 MiB; then, with all n ranks alive, the same ops over n / g disjoint groups
  of each smaller g (2, 4: a 4-rank job's two tp groups, every group at once), at 1 KiB, 16 KiB,
  256 KiB and 4 MiB (the timeline costs a g-rank group of a job by the figure at its ranks on the host).
  One process group per world size (megazero.testing's pool: spawned once, every size swept); an
  op's time is the slowest rank's, a batch of calls each after --gap-us of small GEMMs (as a step
  computes between its collectives) less the same GEMMs timed alone, over their count, the median of
  batches. alpha and beta are fitted by Theil-Sen's medians (fit_alpha_beta), robust to a size timed wrong.

Ranks beyond the cores share them: 4 and 8 gloo ranks on 2 cores are measured as they run (the
figures include the sharing) and `cores` records how many there were.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import statistics
import time
import tomllib
from pathlib import Path

import torch

from calibrate_cpu_step import compute_device, one_rank_step, sharing_slowdown

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "megazero" / "dry_run" / "cpu_measured.toml"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")  # every calibration has them
# MoE's expert dispatch (megazero.core.comm.all_to_all / all_to_all_uneven); files before it lack it
ALL_OPS = OPS + ("all_to_all",)
# timed over groups smaller than the world too (send_recv is pairs at every world already)
GROUP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
GROUP_KEYS = ("group_ranks", "host_ranks", "group_alpha_us", "group_beta_gbps", "group_measured_us")
WORLDS = (2, 4, 8)
SIZES = tuple(1024 * 4**i for i in range(8))  # 1 KiB .. 16 MiB
MEMORY_SIZES = (64 << 20, 128 << 20, 256 << 20)
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


def _seconds_per_call(fn, min_seconds: float = 0.02, batches: int = 5) -> float:
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


def bare_op_us() -> float:
    a, b = torch.ones(1), torch.ones(1)
    return _seconds_per_call(lambda: torch.add(a, b)) * 1e6


def step_op_us() -> tuple[float, int]:
    """A tiny GPT's forward + backward time over its aten op count: the host's cost per op of a step."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from megazero.models.config import GPTConfig
    from megazero.models.gpt import GPT

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=64,
        hidden_size=8,
        num_layers=2,
        num_attention_heads=2,
        ffn_hidden_size=16,
        seq_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPT(cfg)
    tokens = torch.randint(0, 64, (1, 8))

    def step():
        model(tokens, tokens).sum().backward()

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return _seconds_per_call(step, min_seconds=0.1) / Count.ops * 1e6, Count.ops


def gemm_shapes() -> list[tuple[int, int, int]]:
    """(m, n, k) of C[m, n] = A[m, k] B[k, n]: bench/cpu_layouts.py's GPT (hidden 64, ffn 256, vocabulary
    8192, 4 heads, sequence 64, micro batch 1) at tp 1 / 2 and cp 1 / 2, forward (tokens x out x in),
    input gradient (tokens x in x out) and weight gradient (out x in x tokens); attention's scores and
    values per head; then larger squares and the vocabulary GEMM at more tokens."""
    hidden, ffn, vocab, head = 64, 256, 8192, 16
    shapes = set()
    for tp in (1, 2):
        for tokens in (64, 32):
            for out, inp in (
                (3 * hidden // tp, hidden),
                (hidden, hidden // tp),
                (ffn // tp, hidden),
                (hidden, ffn // tp),
                (vocab // tp, hidden),
            ):
                shapes |= {(tokens, out, inp), (tokens, inp, out), (out, inp, tokens)}
    shapes |= {(64, 64, head), (64, head, 64), (head, 64, 64), (32, 64, head), (32, head, 64)}
    shapes |= {(s, s, s) for s in (128, 256, 512, 1024, 2048)}
    shapes |= {(t, vocab, hidden) for t in (256, 1024)} | {(1024, 4 * 1024, 1024)}
    return sorted(shapes)


def matmul_gflops(shapes) -> tuple[list[list[float]], list[list[float]]]:
    """-> (rows [m, n, k, GFLOP/s net of the call's own cost], rows [m, n, k, microseconds per call]).
    The call's own cost is a 1x1x1 `torch.mm`'s, measured just before each shape (the load drifts)."""
    rows, calls = [], []
    one_a, one_b, one_out = torch.ones(1, 1), torch.ones(1, 1), torch.empty(1, 1)
    for m, n, k in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        t0 = _seconds_per_call(lambda: torch.mm(one_a, one_b, out=one_out))
        t = _seconds_per_call(lambda: torch.mm(a, b, out=out))
        device_s = max(t - t0, t * 0.1)  # noise guard: a GEMM's own work is never under 10% of its call
        rows.append([m, n, k, round(2 * m * n * k / device_s / 1e9, 3)])
        calls.append([m, n, k, round(t * 1e6, 2)])
    return rows, calls


def _bandwidths(size: int) -> dict:
    a, b, c = torch.ones(size // 4), torch.ones(size // 4), torch.empty(size // 4)
    return {
        f"copy {size >> 20} MiB": 2 * size / _seconds_per_call(lambda: c.copy_(a), 0.1, 3) / 1e9,
        f"add {size >> 20} MiB": 3 * size / _seconds_per_call(lambda: torch.add(a, b, out=c), 0.1, 3) / 1e9,
    }


def memory_gbps(sizes=MEMORY_SIZES) -> tuple[float, dict]:
    """Median GB/s of copy (read + write) and add (2 reads + write) over sizes past the cache."""
    found = {}
    for size in sizes:
        found.update(_bandwidths(size))
    return statistics.median(found.values()), found


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


def _fitted(op: str, g: int, sizes, times) -> tuple[float, float, list]:
    alpha, beta = fit_alpha_beta([wire_bytes(op, g, s) for s in sizes], times)
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

    module = importlib.import_module("calibrate_cpu")  # by module name: the workers import them
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
                for key, value in zip(GROUP_KEYS, (g, n, *_fitted(op, g, group_sizes, times[op]))):
                    out[op][key].append(value)
        print(
            f"  {n} ranks: GEMMs {shared['slowdown'][-1]:.2f}x slower than alone; "
            + ", ".join(
                f"{op} alpha {out[op]['alpha_us'][-1]:.0f} us beta {out[op]['beta_gbps'][-1]:.3f} GB/s"
                for op in ALL_OPS
            )
            + "".join(
                f"; groups of {g}: "
                + ", ".join(f"{op} alpha {_fitted(op, g, group_sizes, t[op])[0]:.0f} us" for op in GROUP_OPS)
                for g, t in inner.items()
            ),
            flush=True,
        )
    return out, shared


def machine_name() -> str:
    model = platform.processor() or "cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def memory_gb() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / 1e9, 1)
    except OSError:
        pass
    return 0.0


REQUIRED = {
    "name": str,
    "memory_gb": (int, float),
    "source": str,
    "cores": int,
    "launch_us": (int, float),
    "memory_gbps": (int, float),
    "matmul": list,
}


def check_schema(doc: dict) -> None:
    """Raises ValueError naming the first key of the agreed schema that is missing or malformed. The
    all_to_all table and the groups' entries (group_ranks, ...) are optional: files before them load."""
    cpu = doc.get("cpu")
    if not isinstance(cpu, dict):
        raise ValueError("no [cpu] table")
    for key, kind in REQUIRED.items():
        if not isinstance(cpu.get(key), kind) or isinstance(cpu.get(key), bool):
            raise ValueError(f"[cpu] {key}: missing or not {kind}")
    for row in cpu["matmul"]:
        if len(row) != 4 or not all(isinstance(v, (int, float)) and v > 0 for v in row):
            raise ValueError(f"[cpu] matmul row {row}: want [m, n, k, gflops], all positive")
    for op in ALL_OPS:
        table = cpu.get("collectives", {}).get(op)
        if table is None and op not in OPS:
            continue
        if not isinstance(table, dict):
            raise ValueError(f"no [cpu.collectives.{op}] table")
        ranks = table.get("ranks")
        if not ranks or any(len(table.get(k, [])) != len(ranks) for k in ("alpha_us", "beta_gbps")):
            raise ValueError(
                f"[cpu.collectives.{op}]: ranks, alpha_us and beta_gbps must have one entry per size of world"
            )
        if any(a < 0 for a in table["alpha_us"]) or any(b <= 0 for b in table["beta_gbps"]):
            raise ValueError(f"[cpu.collectives.{op}]: alpha_us >= 0 and beta_gbps > 0")
        _check_groups(op, table)


def _check_groups(op: str, table: dict) -> None:
    groups = table.get("group_ranks")
    if groups is None:
        return
    if any(len(table.get(k, [])) != len(groups) for k in GROUP_KEYS[1:4]):
        raise ValueError(
            f"[cpu.collectives.{op}]: group_ranks, host_ranks, group_alpha_us and group_beta_gbps must have "
            "one entry per group measured"
        )
    if any(not 2 <= g < n for g, n in zip(groups, table["host_ranks"])):
        raise ValueError(f"[cpu.collectives.{op}]: each group_ranks entry is 2 or more and below its host_ranks")
    if any(a < 0 for a in table["group_alpha_us"]) or any(b <= 0 for b in table["group_beta_gbps"]):
        raise ValueError(f"[cpu.collectives.{op}]: group_alpha_us >= 0 and group_beta_gbps > 0")


def _array(rows) -> str:
    return "[\n" + "".join(f"  {row},\n" for row in rows) + "]"


def _launch_lines(m: dict) -> list[str]:
    tiny = (
        f"# tiny_step_op_us: a tiny GPT's forward + backward over its {m['step_ops']} aten ops (views "
        "included), {:.2f} us.".format(m.get("tiny_launch_us", m["launch_us"]))
    )
    if "one_rank_ms" not in m:
        return ["# launch_us: the tiny GPT's figure below (no one-rank step measured: --no-step).", tiny]
    return [
        "# launch_us: the host's cost per op the timeline issues, from a real one-rank step of the grid's model",
        f"# (bench/cpu_layouts.py's): measured {m['one_rank_ms']:.1f} ms, the device model's work "
        f"{m['one_rank_work_ms']:.1f} ms, {m['one_rank_ops']} ops:",
        "# (measured - work) / ops (megazero.dry_run.speed.fitted_launch_us).",
        tiny,
    ]


def render(m: dict) -> str:
    """The TOML text of a measurement (the dict main builds)."""
    lines = [
        "# This CPU as the dry run's timeline models it (the device `cpu`), measured by",
        f"# bench/calibrate_cpu.py on {m['date']} on {m['name']},",
        f"# torch {torch.__version__}, one torch thread per process; 1-minute load average {m['load'][0]:.1f} "
        f"before, {m['load'][1]:.1f} after",
        "# (a loaded machine slows every figure alike; bench/cpu_layouts.py measures its layouts in the same run).",
        "# Times: a GEMM costs launch_us (host, per op) + 2*m*n*k / (gflops * 1e3) us; an op moving B bytes",
        "# launch_us + B / (memory_gbps * 1e3) us. A collective of a B-byte buffer over n ranks costs",
        "# alpha_us + bytes_on_wire / (beta_gbps * 1e3) us, bytes_on_wire by the ring algorithm:",
        "# all_reduce 2(n-1)/n*B, all_gather and reduce_scatter (n-1)/n*B of the full buffer, send_recv B;",
        "# all_to_all (n-1)/n*B; alpha_us and beta_gbps fitted on measured_us by Theil-Sen's medians",
        "# (calibrate_cpu.fit_alpha_beta). ranks: the whole world in one group; group_ranks / host_ranks:",
        "# groups of g ranks inside a world of n, every group at once (a 4-rank job's two tp groups), the",
        "# figure the timeline takes for a g-rank group of a job with n ranks on the host.",
        f"# Ranks share `cores` cores: {m['cores']} here, so at 4 and 8 ranks the collectives' figures include",
        "# the sharing, and a GEMM's figure is one process alone on a core.",
        f"# memory: {', '.join(f'{k} {v:.2f} GB/s' for k, v in m['memory_detail'].items())}",
        *_launch_lines(m),
        "# bare_op_us: one 1-element add out of autograd. A GEMM's gflops are net of its call's own cost",
        "# (a 1x1x1 mm's). send_recv: a pair's exchange (both send and receive, waited), a round trip.",
        "# shared_slowdown: with n ranks running at once each computes this much slower than one alone",
        "# (the cores, SMT, memory and the machine's other load as they were): the timeline's CPU share.",
        "",
        "[cpu]",
        f'name = "{m["name"]}"',
        f"memory_gb = {m['memory_gb']}",
        f'source = "measured by bench/calibrate_cpu.py, {m["date"]}"',
        f"cores = {m['cores']}",
        "threads_per_rank = 1",
        f"launch_us = {m['launch_us']:.2f}",
        f"bare_op_us = {m['bare_op_us']:.2f}",
        f"tiny_step_op_us = {m.get('tiny_launch_us', m['launch_us']):.2f}",
        *(
            [
                f"shared_ranks = {m['shared']['ranks']}",
                f"shared_slowdown = {m['shared']['slowdown']}   # a rank's GEMMs with that many ranks at once, over one alone",
            ]
            if m.get("shared")
            else []
        ),
        f"memory_gbps = {m['memory_gbps']:.2f}",
        f"matmul = {_array(m['matmul'])}",
        f"matmul_call_us = {_array(m['matmul_calls'])}   # [m, n, k, microseconds per torch.mm call, its host cost included]",
    ]
    for op, table in m["collectives"].items():
        lines += [
            "",
            f"[cpu.collectives.{op}]",
            f"ranks = {table['ranks']}" + ("   # the world's ranks, in pairs" if op == "send_recv" else ""),
            f"alpha_us = {table['alpha_us']}",
            f"beta_gbps = {table['beta_gbps']}",
            f"sizes_bytes = {m['sizes']}",
            f"measured_us = {_array(table['measured_us'])}   # one row per entry of ranks, by sizes_bytes",
        ]
        if table.get("group_ranks"):
            lines += [
                f"group_ranks = {table['group_ranks']}   # groups of this many ranks, every group at once,",
                f"host_ranks = {table['host_ranks']}   # with this many ranks alive on the host",
                f"group_alpha_us = {table['group_alpha_us']}",
                f"group_beta_gbps = {table['group_beta_gbps']}",
                f"group_sizes_bytes = {m.get('group_sizes', m['sizes'])}",
                f"group_measured_us = {_array(table['group_measured_us'])}   # one row per group entry, by group_sizes_bytes",
            ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="the TOML to write")
    p.add_argument("--quick", action="store_true", help="fewer shapes, sizes and batches (a smoke run)")
    p.add_argument("--ranks", default="2,4,8", help="sizes of world for gloo, comma-separated")
    p.add_argument(
        "--gap-us",
        type=float,
        default=GAP_US,
        help=f"compute before each timed collective, as in a step (default {GAP_US:g}; 0: back to back)",
    )
    p.add_argument(
        "--no-step",
        action="store_true",
        help="skip the one-rank training step (launch_us stays the tiny GPT's per-op figure)",
    )
    return p.parse_args(argv)


def measure(args) -> dict:
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    shapes = gemm_shapes()[:6] if args.quick else gemm_shapes()
    sizes = SIZES[::2] if args.quick else SIZES
    bare = bare_op_us()
    launch, ops = step_op_us()
    print(f"host per op: {launch:.1f} us in a step ({ops} ops), {bare:.1f} us bare", flush=True)
    gbps, detail = memory_gbps(MEMORY_SIZES[:1] if args.quick else MEMORY_SIZES)
    print(f"memory: {gbps:.2f} GB/s", flush=True)
    matmul, matmul_calls = matmul_gflops(shapes)
    print("matmul GFLOP/s: " + ", ".join(f"{m}x{n}x{k} {g:.1f}" for m, n, k, g in matmul), flush=True)
    # the one-rank step right after the figures it is timed by (the load drifts; the gloo sweep is long)
    step = {} if args.no_step else one_rank_step(compute_device(matmul, gbps))
    worlds = [int(n) for n in args.ranks.split(",")]
    # groups inside a larger world: every other size (1 KiB, 16 KiB, 256 KiB, 4 MiB), to keep the
    # calibration's wall time within ~1.5x of the world-only sweep's
    group_sizes = sizes[::2]
    collectives, shared = measure_collectives(
        worlds, sizes, batches=3 if args.quick else 5, gap_us=args.gap_us, group_sizes=group_sizes
    )
    found = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        name=machine_name(),
        memory_gb=memory_gb(),
        cores=os.cpu_count(),
        load=(load_before, os.getloadavg()[0]),
        launch_us=launch,
        tiny_launch_us=launch,
        bare_op_us=bare,
        step_ops=ops,
        memory_gbps=gbps,
        memory_detail=detail,
        matmul=matmul,
        matmul_calls=matmul_calls,
        sizes=list(sizes),
        group_sizes=list(group_sizes),
        collectives=collectives,
        shared=shared,
    )
    return {**found, **step}  # the fitted launch_us, when the step was measured


def main(argv=None) -> Path:
    args = parse_args(argv)
    started = time.perf_counter()
    text = render(measure(args))
    check_schema(tomllib.loads(text))
    args.output.write_text(text)
    print(f"wrote {args.output} ({time.perf_counter() - started:.0f} s)", flush=True)
    return args.output


if __name__ == "__main__":
    main()
