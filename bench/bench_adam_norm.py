"""ZeRO's optimizer step and gradient norm on one rank's partition: the fused paths a GPU step takes
("now" below) against the per-run ones it took before, on the same data in the same run.

The partition is a GPT's parameters laid out flat as a ZeRO storage holds them (tp = pp = dp = 1,
so one rank holds everything), cut into the storage's runs: consecutive parameters of equal weight
decay form one Adam run (biases and norms: none, matrices: --weight-decay), runs never cross a
bucket (--bucket-size elements, DeepSpeed's reduce_bucket_size), and the gradient norm sums one run
per bucket.

Adam, in two precisions: "fp32" (the fp32 parameters are the master, no copy) and "bf16 weights"
(an fp32 master, fp32 gradients as accumulated, the updated master also written to a bf16 copy: the
model's weights):
    reference  before: megazero.ops.adam.adam_update_reference on every run, then the bf16 copy
               run by run (what PartitionedStorage.step ran on any device but the CPU)
    fused      now: adam_update_fused, torch's fused AdamW kernel, one call per weight decay over
               all runs, then one multi-tensor copy (what adam_step runs on a GPU)
    C++ kernel (CPU only) adam_step's CPU route, the C++ kernel with the copy in the same pass:
               what the engine runs on CPU, before and after; shown for scale
Gradient norm (the float64 sum of squares of the partition's gradients):
    reference  before: precision.sum_of_squares on every run (an fp32 dot per 1M-element slice)
    foreach    now: precision.sum_of_squares_many over all runs (fp32 norms of 64K-element slices on
               CPU, 1M on a GPU, in one torch._foreach_norm; their squares summed in float64)

Sides take turns over rounds, each round from fresh, identical state (same seed), so load from
elsewhere lands on all of them; per side and round the median step time is kept, and the table
shows the median over rounds and the fastest round. Time is wall time between timing events (CUDA
events on a GPU), with the process CPU time beside it on CPU (steadier on a shared machine).
"x before" = the old path's time / this side's (above 1: faster than before). "ops" counts the aten
operators one step dispatches, views not counted (on a GPU each is at least one kernel launch;
torch's fused and foreach kernels launch a few per call however many tensors). "extra MiB" (GPU
only) is the step's peak allocation above what was allocated before it: the temporaries.

Agreement, after the same steps from the same state: the new path's parameter and moments against
the reference's, max |new - old| / max |old|; the norms' relative gap, and each norm's gap to the
exact sum (float64 squares of every element); the bf16 copy is checked against the fused side's
own parameter rounded (the reference's parameter differs by ulps, so its rounding may too). On CPU
the fused kernel's moments equal the reference's, its parameter is a few ulps off
(tests/ops/test_adam_fused.py); both norms are a few 1e-6 off the exact sum (tests/zero/test_precision_norm.py).

`--json PATH` (bench/gpu_check.sh, on the GPU) writes the figures in bench/gpu_check.py's step
format: the gaps bounded by GAP_BOUND and EXACT_BOUND, the times and op counts reported.

    python bench/bench_adam_norm.py                      # CPU: 10M-parameter GPT, ~2 min
    python bench/bench_adam_norm.py --device cuda        # GPU: the ~1.3B GPT of bench_gpu_step.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.core.streams import Event
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT
from megazero.ops.adam import AdamSegment, adam_step, adam_update_fused, adam_update_reference
from megazero.ops.adam_config import AdamConfig
from megazero.zero.precision import sum_of_squares, sum_of_squares_many, uses_weight_decay

CONFIG = AdamConfig(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
GAP_BOUND = 1e-6  # fused vs reference Adam after the timed steps (fp32: a few ulps a step)
EXACT_BOUND = 2e-6  # the foreach norm against the exact sum (fp32 norms of slices)
SHAPES = {
    "cpu": dict(hidden_size=384, num_layers=4, num_attention_heads=6, vocab_size=8192),
    "cuda": dict(hidden_size=2048, num_layers=24, num_attention_heads=16, vocab_size=50304),
}


class OpCount(TorchDispatchMode):
    """Counts the aten operators dispatched inside it, views excepted (they launch nothing)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def partition_runs(sizes: list[int], decays: list[float], bucket: int) -> tuple[list, list]:
    """(Adam runs as (start, end, weight decay), norm runs as (start, end)) over the flat partition
    of parameters of `sizes`, as PartitionedStorage.plan cuts them (buckets of at least one
    parameter, closed once they reach `bucket` elements)."""
    runs, norm_runs, offset, bucket_start = [], [], 0, 0
    for n, wd in zip(sizes, decays):
        if offset - bucket_start >= bucket:
            norm_runs.append((bucket_start, offset))
            bucket_start = offset
        if runs and runs[-1][2] == wd and runs[-1][0] >= bucket_start:
            runs[-1] = (runs[-1][0], offset + n, wd)
        else:
            runs.append((offset, offset + n, wd))
        offset += n
    norm_runs.append((bucket_start, offset))
    return runs, norm_runs


class Partition:
    """One rank's flat states, made on `device` from `seed`, and the runs that cut them."""

    def __init__(self, sizes, decays, bucket: int, device, bf16_copy: bool, seed: int = 0):
        self.runs = partition_runs(sizes, decays, bucket)[0]
        n = sum(sizes)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.param = torch.randn(n, generator=gen, device=device) * 0.02
        self.grad = torch.randn(n, generator=gen, device=device) * 1e-3
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.param), torch.zeros_like(self.param)
        self.copy = torch.empty(n, dtype=torch.bfloat16, device=device) if bf16_copy else None

    def segments(self) -> list[AdamSegment]:
        return [
            AdamSegment(
                self.param[lo:hi],
                self.grad[lo:hi],
                self.exp_avg[lo:hi],
                self.exp_avg_sq[lo:hi],
                wd,
                None if self.copy is None else self.copy[lo:hi],
            )
            for lo, hi, wd in self.runs
        ]


def adam_sides(device: torch.device) -> dict[str, Callable]:
    """side -> make(partition) -> step(step number)."""

    def reference(p: Partition):
        segments = p.segments()

        def step(k: int) -> None:
            for seg in segments:
                adam_update_reference(*seg[:4], step=k, lr=CONFIG.lr, config=CONFIG, weight_decay=seg.weight_decay)
                if seg.param_copy is not None:
                    seg.param_copy.copy_(seg.param)

        return step

    def fused(p: Partition):
        segments = p.segments()
        return lambda k: adam_update_fused(segments, step=k, lr=CONFIG.lr, config=CONFIG)

    sides = {"reference": reference, "fused": fused}
    if device.type == "cpu":

        def cpp(p: Partition):
            segments = p.segments()
            return lambda k: adam_step(segments, step=k, lr=CONFIG.lr, config=CONFIG)

        sides["C++ kernel"] = cpp
    return sides


NORM_SIDES = {
    "reference": lambda pieces: sum(sum_of_squares(t) for t in pieces),
    "foreach": lambda pieces: sum_of_squares_many(pieces, device=pieces[0].device),
}


def timed(device, fn: Callable[[int], object], warmup: int, steps: int) -> dict:
    """Median wall and CPU ms of `steps` calls after `warmup` (fn gets the step number from 1), the
    ops one call dispatches, its extra peak memory on a GPU, and the last call's result."""
    for k in range(1, warmup + 1):
        fn(k)
    wall, cpu = [], []
    for k in range(warmup + 1, warmup + steps + 1):
        start, cpu_start = Event(device, timing=True).record(), time.process_time()
        result = fn(k)
        end = Event(device, timing=True).record()
        wall.append(start.elapsed_ms(end))
        cpu.append(1000 * (time.process_time() - cpu_start))
    extra = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with OpCount() as ops:
        result = fn(warmup + steps + 1)
    if device.type == "cuda":
        extra = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return {
        "ms": statistics.median(wall),
        "cpu_ms": statistics.median(cpu),
        "ops": ops.count,
        "extra_mib": extra,
        "result": result,
    }


def gap(new: torch.Tensor, old: torch.Tensor) -> float:
    return float((new.float() - old.float()).abs().max() / old.float().abs().max().clamp_min(1e-30))


def exact_sum_of_squares(pieces: list[torch.Tensor], slice_elems: int = 1 << 24) -> float:
    return sum(
        float(t[s : s + slice_elems].double().square().sum()) for t in pieces for s in range(0, t.numel(), slice_elems)
    )


def measure(args, device, sizes, decays) -> dict:
    """Every (kind, side): its rounds' timings; and the agreement figures, from the last round (each
    precision's partitions are dropped before the next are made: at 1.3B one is ~23 GB)."""
    rounds: dict[tuple[str, str], list[dict]] = {}
    agreement: dict[str, float] = {}
    for index in range(args.rounds):
        last = index == args.rounds - 1
        for mode in ("fp32", "bf16 weights"):
            parts = {}
            for side, make in adam_sides(device).items():
                part = Partition(sizes, decays, args.bucket_size, device, bf16_copy=mode != "fp32")
                rounds.setdefault((f"adam, {mode}", side), []).append(
                    timed(device, make(part), args.warmup, args.steps)
                )
                parts[side] = part if last and side in ("reference", "fused") else None
            if last:
                new, old = parts["fused"], parts["reference"]
                for kind in ("param", "exp_avg", "exp_avg_sq"):
                    agreement[f"adam {mode}: {kind}"] = gap(getattr(new, kind), getattr(old, kind))
                if new.copy is not None:
                    agreement[f"adam {mode}: copy vs param rounded"] = gap(new.copy, new.param.to(new.copy.dtype))
            del parts
        gen = torch.Generator(device=device).manual_seed(1)
        grads = torch.randn(sum(sizes), generator=gen, device=device) * 1e-3
        pieces = [grads[lo:hi] for lo, hi in partition_runs(sizes, decays, args.bucket_size)[1]]
        for side, fn in NORM_SIDES.items():
            rounds.setdefault(("norm", side), []).append(
                timed(device, lambda k, fn=fn: fn(pieces), args.warmup, args.steps)
            )
    exact = exact_sum_of_squares(pieces)
    norms = {side: float(rs[-1]["result"]) for (kind, side), rs in rounds.items() if kind == "norm"}
    agreement["norm: foreach vs reference"] = abs(norms["foreach"] - norms["reference"]) / norms["reference"]
    agreement["norm: foreach vs exact"] = abs(norms["foreach"] - exact) / exact
    agreement["norm: reference vs exact"] = abs(norms["reference"] - exact) / exact
    return {"rounds": rounds, "agreement": agreement}


def summarize(rounds: dict) -> dict:
    return {
        key: {
            "ms": statistics.median(r["ms"] for r in rs),
            "best": min(r["ms"] for r in rs),
            "cpu_ms": statistics.median(r["cpu_ms"] for r in rs),
            "ops": rs[-1]["ops"],
            "extra_mib": rs[-1]["extra_mib"],
        }
        for key, rs in rounds.items()
    }


def report(table: dict, agreement: dict, device) -> None:
    print("\n| step | side | ms/step | fastest round | cpu ms | ops | extra MiB | x before | x before (cpu) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (kind, side), r in table.items():
        old = table[(kind, "reference")]
        extra = "-" if r["extra_mib"] is None else f"{r['extra_mib']:.1f}"
        cpu = f"{r['cpu_ms']:.2f}" if device.type == "cpu" else "-"
        cpu_x = f"{old['cpu_ms'] / r['cpu_ms']:.2f}" if device.type == "cpu" else "-"
        ops = "-" if side == "C++ kernel" else r["ops"]  # called outside the dispatcher
        print(
            f"| {kind} | {side} | {r['ms']:.2f} | {r['best']:.2f} | {cpu} | {ops} | {extra} | "
            f"{old['ms'] / r['ms']:.2f} | {cpu_x} |"
        )
    print("\nagreement (max |new - old| / max |old| after the same steps; norms: relative gap)")
    for name, value in agreement.items():
        print(f"  {name}: {value:.2e}")


def figures(table: dict, agreement: dict) -> dict:
    """bench/gpu_check.py's figures: the gaps bounded, times and op counts reported."""

    def figure(value, ok, bound, note=""):
        return {"value": value, "ok": bool(ok), "bound": bound, "note": note}

    out = {}
    for name, value in agreement.items():
        key = name.replace(": ", "_").replace(" ", "_")
        if name == "norm: reference vs exact":
            out[key] = figure(value, math.isfinite(value), "reported (the old fp32 dots' error)")
        elif name.startswith("norm"):
            out[key] = figure(
                value,
                value <= EXACT_BOUND if "exact" in name else value <= 1e-5,
                f"<= {EXACT_BOUND:g}" if "exact" in name else "<= 1e-05",
            )
        else:
            out[key] = figure(value, value <= GAP_BOUND, f"<= {GAP_BOUND:g} of the largest value")
    for (kind, side), r in table.items():
        if side == "reference":
            continue
        old = table[(kind, "reference")]
        key = kind.replace(", ", "_").replace(" ", "_")
        ratio = old["ms"] / r["ms"]
        out[f"{key}_{side}_speedup"] = figure(
            ratio, ratio > 0, "reported (old time / new time)", f"{r['ms']:.2f} ms vs {old['ms']:.2f} ms before"
        )
        out[f"{key}_{side}_ops"] = figure(
            r["ops"], True, "reported", f"{old['ops']} before; extra MiB {r['extra_mib']} vs {old['extra_mib']} before"
        )
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden-size", type=int, default=None, help="default: 384 on CPU, 2048 on a GPU")
    p.add_argument("--num-layers", type=int, default=None, help="default: 4 on CPU, 24 on a GPU")
    p.add_argument("--num-attention-heads", type=int, default=None, help="default: 6 on CPU, 16 on a GPU")
    p.add_argument("--vocab-size", type=int, default=None, help="default: 8192 on CPU, 50304 on a GPU")
    p.add_argument("--bucket-size", type=int, default=int(5e8), help="elements per bucket (reduce_bucket_size)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per side and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the figures here (bench/gpu_check.py's step format)")
    return p.parse_args(argv)


def model_sizes(args, device) -> tuple[list[int], list[float], GPTConfig]:
    """The GPT's parameter sizes in order and their weight decays (built on the meta device)."""
    shape = dict(SHAPES["cuda" if device.type == "cuda" else "cpu"])
    for key in ("hidden_size", "num_layers", "num_attention_heads", "vocab_size"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    cfg = GPTConfig(seq_length=128, hidden_dropout=0.0, attention_dropout=0.0, **shape)
    with torch.device("meta"):
        params = list(GPT(cfg).parameters())
    return (
        [p.numel() for p in params],
        [CONFIG.weight_decay if uses_weight_decay(p.shape) else 0.0 for p in params],
        cfg,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(args.threads)
    sizes, decays, cfg = model_sizes(args, device)
    runs, norm_runs = partition_runs(sizes, decays, args.bucket_size)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"GPT hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}: {sum(sizes) / 1e6:.1f}M "
        f"parameters, {len(runs)} Adam runs, {len(norm_runs)} norm runs; device {device}; "
        f"{args.threads} thread(s); {args.warmup} warm-up + {args.steps} timed steps x {args.rounds} rounds; "
        f"torch {torch.__version__}; load average {load:.1f}",
        flush=True,
    )
    result = measure(args, device, sizes, decays)
    table = summarize(result["rounds"])
    report(table, result["agreement"], device)
    if hasattr(os, "getloadavg"):
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    figs = figures(table, result["agreement"])
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"step": "adam_norm", "figures": figs}, out, indent=1)
    failed = [name for name, f in figs.items() if not f["ok"]]
    for name in failed:
        print(f"FAIL {name} = {figs[name]['value']} ({figs[name]['bound']})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
