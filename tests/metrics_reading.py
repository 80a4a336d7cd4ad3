"""Reading a run's metrics.jsonl in a test: the records in order, one split's losses, the curve by
iteration. Owns only the reading; what a record holds is megazero/training/metrics.py's (a record
without "split" is a training one, evaluations say "split": "valid")."""

from __future__ import annotations

import json
from pathlib import Path


def metrics_records(path: Path, *, missing_ok: bool = False) -> list[dict]:
    """Every record of a metrics file, in order; `path` is the file or a run folder (its
    metrics.jsonl). `missing_ok`: a file not written yet reads as no records (for polling a launch)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if missing_ok and not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def split_records(path: Path, split: str = "train", *, with_loss: bool = True) -> list[dict]:
    """The records of one split, in order; `with_loss`: only those holding a loss."""
    return [r for r in metrics_records(path) if r.get("split", "train") == split and (not with_loss or "loss" in r)]


def loss_curve(path: Path, *, missing_ok: bool = False) -> dict[int, float]:
    """Iteration -> training loss, the last record of each iteration winning (a restarted attempt
    repeats some)."""
    return {
        r["iteration"]: r["loss"]
        for r in metrics_records(path, missing_ok=missing_ok)
        if "loss" in r and r.get("split", "train") == "train"
    }
