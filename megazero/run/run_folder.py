"""A run's folder and its one writer.

- The default run folder is `runs/gpt-<date>-<time>-<6 hex>`: every rank draws a name at the edge
  (megazero.config.train_flags, before any process group), and rank 0's becomes every rank's in the
  broadcast that also agrees on the run id (`agree_identity`), so two jobs started in the same
  second never share one, and a job's ranks never split their files over two.
- The run's metrics file (`<run folder>/metrics.jsonl`, or --metrics-file) is locked for the job by
  rank 0 (`lock_metrics`: `<metrics file>.lock`, megazero.core.writer_lock), as is the --save folder
  (megazero.checkpoint.resume): rank 0 may not be the rank that writes the metrics, but a job ends
  with any of its ranks, so rank 0 holds it as long as anyone writes. A folder a flag named
  (--run-dir, --metrics-file) is locked before the process groups exist, so that a refusal is agreed
  like any mistake, in one line; the default one just after the broadcast, as nobody else can hold it.

Owns the name and the lock; what is written into the folder is megazero.training.metrics's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megazero.config.train_config import TrainConfig
from megazero.core import comm, host_read
from megazero.core.writer_lock import FolderLock

_IDENTITY_BYTES = 128  # a run id (32 hex, or an imported checkpoint's) and the default folder's name


def metrics_named_by_flag(cfg: TrainConfig) -> bool:
    """Whether the metrics file's path is known before the broadcast (a flag named it or its folder)."""
    return not cfg.default_run_dir or cfg.metrics_file != str(Path(cfg.run_dir) / "metrics.jsonl")


def lock_metrics(cfg: TrainConfig, run_id: str) -> FolderLock:
    """Rank 0's lock on the run's metrics file for the job; a UsageError naming the job holding it."""
    what = (
        f"--run-dir {cfg.run_dir}"
        if cfg.metrics_file == str(Path(cfg.run_dir) / "metrics.jsonl")
        else f"--metrics-file {cfg.metrics_file}"
    )
    return FolderLock.take(Path(f"{cfg.metrics_file}.lock"), run_id, what)


def agree_identity(groups, run_id: str, run_dir: str) -> tuple[str, str]:
    """Rank 0's run id and run folder name, on every rank (one broadcast over DP, then over TP x PP:
    together they reach the whole layout)."""
    text = f"{run_id}\n{run_dir}".encode()
    if len(text) > _IDENTITY_BYTES:
        raise ValueError(f"run id and folder name too long to agree on: {text!r}")
    padded = list(text) + [0] * (_IDENTITY_BYTES - len(text))
    value = torch.tensor(padded, dtype=torch.uint8, device=groups.dp.device)
    comm.broadcast(value, 0, groups.dp)
    comm.broadcast(value, 0, groups.mp)
    agreed = bytes(host_read.read(value, "run id", healthy=padded)).rstrip(b"\0").decode()
    agreed_id, _, agreed_dir = agreed.partition("\n")
    return agreed_id, agreed_dir


def with_run_dir(cfg: TrainConfig, run_dir: str) -> TrainConfig:
    """`cfg` with the default run folder `run_dir` (rank 0's), and the paths derived from it."""
    old = cfg.run_dir
    update = {"run_dir": run_dir}
    if cfg.metrics_file == str(Path(old) / "metrics.jsonl"):
        update["metrics_file"] = str(Path(run_dir) / "metrics.jsonl")
    if cfg.monitor.wandb_save_dir == old:
        update["monitor"] = cfg.monitor.replace(wandb_save_dir=run_dir)
    return cfg.replace(**update)
