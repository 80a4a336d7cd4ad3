"""The CPU grid: the small GPT and the layouts bench/cpu_layouts.py measures and predicts, and how one
layout is launched and timed (torchrun, the median step). bench/calibrate_cpu_step.py times the same
model on one rank to fit the host's cost per op; both import it from here, so neither imports the
other's script."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
]
ZERO3_OFFLOAD = ["--zero-stage", "3", "--zero-offload-optimizer", "cpu", "--zero-offload-param", "cpu"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]

# (name, ranks, the flags after MODEL): the one list the measurements and the predictions share.
LAYOUTS = [
    ("dp2-zero0", 2, ["--zero-stage", "0"]),
    ("dp2-zero1", 2, ["--zero-stage", "1"]),
    ("dp2-zero2", 2, ["--zero-stage", "2"]),
    ("dp2-zero3", 2, ["--zero-stage", "3"]),
    ("dp2-zero3-offload", 2, ZERO3_OFFLOAD),
    ("tp2", 2, ["--tensor-model-parallel-size", "2"]),
    ("tp2-sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2-1f1b", 2, ["--pipeline-model-parallel-size", "2"]),
    ("pp2-interleaved", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    ("cp2", 2, ["--context-parallel-size", "2"]),
    ("moe-ep2", 2, MOE + ["--expert-model-parallel-size", "2"]),
    ("tp2-dp2-zero1", 4, ["--tensor-model-parallel-size", "2", "--zero-stage", "1"]),
    ("pp2-dp2-zero2", 4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "2"]),
    ("tp2-pp2", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ("cp2-dp2-zero3", 4, ["--context-parallel-size", "2", "--zero-stage", "3"]),
    (
        "moe-ep2-tp2-sp",
        4,
        MOE + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ),
    (
        "tp2-pp2-dp2-zero1",
        8,
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"],
    ),
]


def layout_argv(extra: list[str], steps: int) -> list[str]:
    """pretrain_gpt.py's flags of a layout (without --run-dir)."""
    return MODEL + ["--train-iters", str(steps)] + extra


def step_times(metrics_path: Path, skip: int = 2) -> list[float]:
    """ms_per_iter of the training records after the first `skip` iterations, in order."""
    times = []
    for line in Path(metrics_path).read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train" and record["iteration"] > skip:
            times.append(record["ms_per_iter"])
    if not times:
        raise ValueError(f"{metrics_path}: no training iteration after the first {skip}")
    return times


def steady_step_ms(metrics_path: Path, skip: int = 2) -> float:
    """Median ms_per_iter of the training records after the first `skip` iterations."""
    return statistics.median(step_times(metrics_path, skip))


def launch_layout(ranks: int, argv: list[str], folder: Path) -> dict:
    """Launches the layout with torchrun in `folder`: {"steps_ms": its steady steps, "wall_s"}."""
    from megazero.testing import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-port",
        str(free_port()),
        str(REPO / "pretrain_gpt.py"),
        *argv,
        "--run-dir",
        "run",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=folder, capture_output=True, text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(argv)}\n{proc.stderr[-3000:]}")
    return {"steps_ms": step_times(folder / "run" / "metrics.jsonl"), "wall_s": time.perf_counter() - t0}


def measure_layout(ranks: int, argv: list[str], folder: Path) -> float:
    """Launches the layout with torchrun in `folder`; its steady-state ms per step."""
    return statistics.median(launch_layout(ranks, argv, folder)["steps_ms"])


def round_orders(names: list[str], repeats: int) -> list[list[str]]:
    """The order of each round: every name once, round r walking the list with a stride coprime to
    its length (1, -1, 2, -2, ...) from a start moved by r, so a layout follows a different
    neighbour from round to round (a rotation alone keeps every neighbour: the machine's state one
    launch leaves, its page cache, its load, would always fall on the same next layout)."""
    n = len(names)
    strides = [s for k in range(1, n + 1) for s in (k, -k) if math.gcd(k, n) == 1] or [1]
    orders = []
    for r in range(repeats):
        stride = strides[r % len(strides)]
        orders.append([names[(r + i * stride) % n] for i in range(n)] if n else [])
    return orders


def run_rounds(layouts, repeats: int, launch, probe, reference_us: float, retry_over: float, log=print) -> list[dict]:
    """Every layout of `layouts` ((name, ranks, argv)) launched once a round, `repeats` rounds in
    round_orders. Before each launch `probe()` (the host's cost per op, us) against `reference_us`
    (the calibration's): a launch whose probe reads more than `retry_over` slower is launched again
    once, and the one with the smaller probe is kept. `launch(name, ranks, argv)` -> launch_layout's
    dict. Returns a record per launch: name, round, position, probe_us, load (1-minute load average
    as it ended), steps_ms, median_ms, wall_s, retry (the second try of a slow probe) and kept."""
    by_name = {name: (ranks, argv) for name, ranks, argv in layouts}
    records = []
    for r, order in enumerate(round_orders(list(by_name), repeats)):
        for position, name in enumerate(order):
            tries = []
            for retry in (False, True):
                probe_us = probe()
                found = launch(name, *by_name[name])
                tries.append(
                    dict(
                        found,
                        name=name,
                        round=r,
                        position=position,
                        probe_us=probe_us,
                        load=os.getloadavg()[0],
                        median_ms=statistics.median(found["steps_ms"]),
                        retry=retry,
                        kept=False,
                    )
                )
                log(
                    f"round {r + 1}/{repeats} {name:<20} {tries[-1]['median_ms']:8.1f} ms/step | probe "
                    f"{probe_us:.2f} us/op ({probe_us / reference_us:.2f}x the calibration's) | load "
                    f"{tries[-1]['load']:.1f} | {found['wall_s']:.1f} s{' (retry)' if retry else ''}"
                )
                if probe_us <= reference_us * (1 + retry_over):
                    break
            min(tries, key=lambda t: t["probe_us"])["kept"] = True
            records += tries
    return records


def per_layout(records: list[dict]) -> dict:
    """{name: {"measured": median over rounds of the kept launches' medians, "low", "high" (their
    min and max), "medians", "probes_us", "loads", "retries"}}, in the order names first appear."""
    out = {}
    for rec in records:
        entry = out.setdefault(rec["name"], dict(medians=[], probes_us=[], loads=[], retries=0))
        entry["retries"] += rec["retry"]
        if rec["kept"]:
            entry["medians"].append(rec["median_ms"])
            entry["probes_us"].append(rec["probe_us"])
            entry["loads"].append(rec["load"])
    for entry in out.values():
        entry.update(
            measured=statistics.median(entry["medians"]), low=min(entry["medians"]), high=max(entry["medians"])
        )
    return out
