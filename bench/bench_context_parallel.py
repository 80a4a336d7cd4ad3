"""Context parallelism against sequence length: each rank's activation memory (measured peak beside
tools/plan_memory.py's estimate) and the step time, for cp 1 / 2 / 4 and each --cp-comm-type, with
ratios against cp 1 measured in the same run.

    python bench/bench_context_parallel.py                  # seq 2k-8k, cp 1/2/4, p2p/a2a/allgather
    python bench/bench_context_parallel.py --quick          # seq 2k and 4k, cp 1/2, one timed step
    python bench/bench_context_parallel.py --seqs 16384     # 16k (p2p at cp 2: ~3 GiB a rank, minutes)
    python bench/bench_context_parallel.py --tiny           # the test's path check, seconds

Every point trains a small GPT (RoPE, fp32 by default, ZeRO-1, micro batch 1, one sequence per step:
dp 1, so cp ranks split each sequence) on a pool of gloo ranks, one rank per CP rank. Its config is
built from pretrain_gpt.py's flags, as the planner builds it. A warm-up step, then the timed steps;
each rank's peak is its resident memory's high-water mark over all of them above what it held after
set-up (the method of bench/plan_memory_table.py: glibc returns freed blocks to the kernel, VmHWM
reset through /proc/self/clear_refs), so it is what training adds beside the model states:
activations, the CP attention's buffers and what it keeps from step to step (allgather's mask), the
gradients autograd hands over; also the first touch of Adam's zeroed states (~1 MB at the default
size) and, at the run's first point, the math libraries' workspaces. The planned figure beside it
is the plan's `activations` + `comm_buffers` (megazero.config.memory_estimate.plan_bytes).

Columns: ms/step is the median wall time of the timed steps (the slowest rank's); cpu ms is one
rank's process CPU time per step (the largest), so cp ranks sharing few cores show in wall time
but not in the work each does; `x cp1` divides by the cp 1 point of the same sequence length.
The losses of every layout at a sequence length must agree with cp 1's (LOSS_RTOL): equal work.

Checks (exit 1 if one fails): losses finite and equal to cp 1's; the planned figure within
PLAN_BOUNDS of the measured peak. On the CPU the ring's block kernel is the written-out math
(parallel/ring_attention.py), which holds a (local x local) score block per head in fp32: at long
sequences p2p's memory is that block's, not the activations' (the planner counts it).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from megazero.config.train_flags import config_from_args
from megazero.config.flags import build_parser
from megazero.config.memory_estimate import plan_bytes
from megazero.parallel.topology import Topology
from plan_memory_table import fresh_high_water_mark, status_bytes

COMM_TYPES = ("p2p", "a2a", "allgather")
LOSS_RTOL = 1e-5
# planned / measured: the planner's counts are upper bounds (it counts the fp32 logits and their
# gradient whole, where the fused loss holds a chunk: at vocab 512 and hidden 64 that alone took a2a
# to 1.95), the process adds what no formula sees (allocator rounding, small temporaries); at tiny
# sizes the interpreter's own noise (~1 MB) dominates, so the bound is checked only above
# MIN_CHECKED_BYTES.
PLAN_BOUNDS = (0.5, 2.0)
MIN_CHECKED_BYTES = 32e6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default=None, help="sequence lengths (default 2048,4096,8192)")
    p.add_argument("--cps", default=None, help="context-parallel sizes (default 1,2,4)")
    p.add_argument("--comm-types", default=",".join(COMM_TYPES))
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--vocab",
        type=int,
        default=128,
        help="small beside the hidden size, so that the attention's memory is what the run shows",
    )
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--quick", action="store_true", help="seq 2k and 4k, cp 1 and 2, one timed step")
    p.add_argument("--tiny", action="store_true", help="seq 64 (unless --seqs), hidden 32, one timed step")
    args = p.parse_args(argv)
    seqs, cps = "2048,4096,8192", "1,2,4"
    if args.quick:
        seqs, cps, args.steps = "2048,4096", "1,2", 1
    if args.tiny:
        seqs, args.hidden, args.vocab, args.steps = "64", 32, 64, 1
    args.seqs = [int(s) for s in (args.seqs or seqs).split(",")]
    args.cps = [int(c) for c in (args.cps or cps).split(",")]
    args.comm_types = args.comm_types.split(",")
    return args


def run_config(args, seq: int, cp: int, comm_type: str):
    """The point's TrainConfig, from pretrain_gpt.py's flags (what tools/plan_memory.py plans)."""
    argv = [
        "--num-layers",
        str(args.layers),
        "--hidden-size",
        str(args.hidden),
        "--num-attention-heads",
        str(args.heads),
        "--ffn-hidden-size",
        str(4 * args.hidden),
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--position-embedding-type",
        "rope",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--zero-stage",
        "1",
        "--lr",
        "1e-4",
        "--train-iters",
        "10",
        "--context-parallel-size",
        str(cp),
        "--cp-comm-type",
        comm_type,
        "--make-vocab-size-divisible-by",
        "8",
    ] + (["--bf16"] if args.bf16 else [])
    cfg = config_from_args(build_parser().parse_args(argv), world_size=cp)
    cfg.model.vocab_size = cfg.model.padded_vocab_size = args.vocab
    return cfg


def point_worker(ctx, args, seq: int, cp: int, comm_type: str):
    """Pool entry: one point on the first `cp` ranks -> this rank's losses, step times, CPU times
    and peak bytes above the post-warm-up baseline (None outside the point)."""
    from megazero.data.synthetic import ArithmeticTokens
    from megazero.data.sampler import MicrobatchSource
    from megazero.training import setup, train_step

    groups = ctx.groups(Topology(world_size=cp, cp=cp))
    if groups is None:
        return None
    cfg = run_config(args, seq, cp, comm_type)
    state = setup(cfg, groups)
    source = MicrobatchSource(ArithmeticTokens(cfg.model.vocab_size, seq, seed=3), 1, 1, 0, 1)
    base = fresh_high_water_mark()
    losses = [train_step(state, source.batch(0), 1e-4).loss]
    wall, cpu = [], []
    for it in range(1, args.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(train_step(state, source.batch(it), 1e-4).loss)  # .loss: a host value, synced
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = status_bytes("VmHWM") - base
    return {"losses": losses, "wall": wall, "cpu": cpu, "peak": peak}


def measure(pool, args, seq: int, cp: int, comm_type: str) -> dict:
    ranks = [r for r in pool.run(point_worker, args, seq, cp, comm_type) if r is not None]
    plan = plan_bytes(run_config(args, seq, cp, comm_type), cp)
    return {
        "seq": seq,
        "cp": cp,
        "comm": comm_type if cp > 1 else "-",
        "losses": ranks[0]["losses"],
        "ms": 1000 * max(statistics.median(r["wall"]) for r in ranks),
        "cpu_ms": 1000 * max(statistics.median(r["cpu"]) for r in ranks),
        "measured": max(r["peak"] for r in ranks),
        "planned": plan["activations"] + plan["comm_buffers"],
        "planned_activations": plan["activations"],
    }


def points(args) -> list[tuple[int, int, str]]:
    """(seq, cp, comm type) in run order: cp 1 first at each length (the ratios' base); a2a only
    where the heads divide by cp."""
    out = []
    for seq in args.seqs:
        for cp in args.cps:
            for comm_type in args.comm_types if cp > 1 else ["p2p"]:
                if comm_type == "a2a" and args.heads % cp:
                    continue
                out.append((seq, cp, comm_type))
    return out


def run(pool, args, warm_up: bool = True) -> list[dict]:
    """Every point, printed as it comes; first (`warm_up`) each (cp, comm type) once at a tiny length,
    so that what a process sets up once (the communicators' buffers, the math libraries'
    workspaces) is not counted in the first point of its kind."""
    for seq, cp, comm_type in points(args):
        if warm_up and seq == args.seqs[0]:
            pool.run(point_worker, argparse.Namespace(**{**vars(args), "steps": 0}), 8 * cp, cp, comm_type)
    rows = []
    for seq, cp, comm_type in points(args):
        rows.append(measure(pool, args, seq, cp, comm_type))
        print(format_row(rows[-1], _base(rows, seq)), flush=True)
    return rows


def _base(rows, seq):
    return next((r for r in rows if r["seq"] == seq and r["cp"] == 1), None)


HEADER = (
    "|   seq | cp | comm      | ms/step | cpu ms | x cp1 time | measured MB | planned MB | planned/measured "
    "| x cp1 memory |\n|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(r: dict, base: dict | None) -> str:
    time_ratio = f"{r['ms'] / base['ms']:.2f}" if base else "-"
    memory_ratio = f"{r['measured'] / base['measured']:.2f}" if base and base["measured"] > 0 else "-"
    ratio = r["planned"] / r["measured"] if r["measured"] > 0 else math.inf
    return (
        f"| {r['seq']:>5} | {r['cp']:>2} | {r['comm']:<9} | {r['ms']:7.1f} | {r['cpu_ms']:6.1f} | "
        f"{time_ratio:>10} | {r['measured'] / 1e6:11.1f} | {r['planned'] / 1e6:10.1f} | {ratio:16.2f} | "
        f"{memory_ratio:>12} |"
    )


def check(rows: list[dict]) -> list[str]:
    """The failed checks, one line each (empty: all passed)."""
    failed = []
    for r in rows:
        what = f"seq {r['seq']} cp {r['cp']} {r['comm']}"
        if not all(map(math.isfinite, r["losses"])):
            failed.append(f"{what}: a loss is not finite: {r['losses']}")
        base = _base(rows, r["seq"])
        if base is not None and any(abs(a - b) > LOSS_RTOL * abs(b) for a, b in zip(r["losses"], base["losses"])):
            failed.append(f"{what}: losses {r['losses']} differ from cp 1's {base['losses']}")
        ratio = r["planned"] / r["measured"] if r["measured"] > 0 else math.inf
        if r["measured"] >= MIN_CHECKED_BYTES and not PLAN_BOUNDS[0] <= ratio <= PLAN_BOUNDS[1]:
            failed.append(
                f"{what}: planned {r['planned'] / 1e6:.1f} MB vs measured {r['measured'] / 1e6:.1f} MB "
                f"(ratio {ratio:.2f} outside {PLAN_BOUNDS})"
            )
    return failed


def main(argv=None) -> int:
    from megazero.testing import DistributedPool

    args = parse_args(argv)
    print(
        f"GPT layers={args.layers} hidden={args.hidden} heads={args.heads} vocab={args.vocab} "
        f"{'bf16' if args.bf16 else 'fp32'}, ZeRO-1, micro batch 1; {args.steps} timed steps per point; "
        f"seqs {args.seqs}, cp {args.cps}, {args.comm_types}",
        flush=True,
    )
    print(HEADER, flush=True)
    pool = DistributedPool(max(args.cps))
    try:
        rows = run(pool, args)
    finally:
        pool.close()
    failed = check(rows)
    for line in failed:
        print(f"FAIL {line}")
    print("all checks passed" if not failed else f"{len(failed)} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
