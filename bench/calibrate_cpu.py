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
figures include the sharing) and `cores` records how many there were. The collectives' sweep and
fit are bench/calibrate_cpu_comm.py's, the one-rank step and the sharing slowdown
bench/calibrate_cpu_step.py's; this script measures the rest and writes the file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
import tomllib
from pathlib import Path

import torch

from calibrate_cpu_comm import (  # noqa: F401  (the collectives' sweep and fit, re-exported for the tests)
    ALL_OPS,
    GAP_US,
    GROUP_KEYS,
    GROUP_OPS,
    OPS,
    SIZES,
    WORLDS,
    exchange,
    fit_alpha_beta,
    groups_of,
    measure_collectives,
    sweep_collectives,
    wire_bytes,
)
from calibrate_cpu_step import compute_device, one_rank_step, seconds_per_call as _seconds_per_call

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "megazero" / "dry_run" / "cpu_measured.toml"
MEMORY_SIZES = (64 << 20, 128 << 20, 256 << 20)


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
    # groups inside a larger world: every other size (1 KiB, 16 KiB, 256 KiB, 4 MiB; --quick too), to keep the
    # calibration's wall time within ~1.5x of the world-only sweep's
    group_sizes = SIZES[::2]
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
