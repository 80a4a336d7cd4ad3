"""The CPU grid: the small GPT and the layouts bench/cpu_layouts.py measures and predicts, and how one
layout is launched and timed (torchrun, the median step). bench/calibrate_cpu_step.py times the same
model on one rank to fit the host's cost per op; both import it from here, so neither imports the
other's script."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
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


def steady_step_ms(metrics_path: Path, skip: int = 2) -> float:
    """Median ms_per_iter of the training records after the first `skip` iterations."""
    times = []
    for line in Path(metrics_path).read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train" and record["iteration"] > skip:
            times.append(record["ms_per_iter"])
    if not times:
        raise ValueError(f"{metrics_path}: no training iteration after the first {skip}")
    return statistics.median(times)


def measure_layout(ranks: int, argv: list[str], folder: Path) -> float:
    """Launches the layout with torchrun in `folder`; its steady-state ms per step."""
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
    proc = subprocess.run(
        cmd, cwd=folder, capture_output=True, text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(argv)}\n{proc.stderr[-3000:]}")
    return steady_step_ms(folder / "run" / "metrics.jsonl")
