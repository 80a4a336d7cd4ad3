"""Monitors: Weights & Biases and TensorBoard writers behind one small interface.

MetricsLogger hands every record it appends to metrics.jsonl to each monitor (`log(record)`), so the
monitors see exactly the JSON lines, on the one logging rank, and nothing else. This module owns the
writers and their optional imports; the flags and the check that the packages are installed belong
to the edge (megazero.config.monitor_flags). It must not touch process groups.

Keys are `<split>/<field>` (`train/loss`, `valid/loss`, `train/time_ms/forward`), stepped by the
record's iteration, so a valid loss and the train loss of the same iteration share a step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megazero.config.train_config import MonitorConfig, TrainConfig


def scalars(record: dict) -> dict[str, float]:
    """The numeric fields of a metrics record as `<split>/<field>` keys (nested dicts flattened)."""
    split = record.get("split", "train")
    out: dict[str, float] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}/{key}", inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix] = float(value)

    for key, value in record.items():
        if key not in ("iteration", "split"):
            walk(f"{split}/{key}", value)
    return out


def config_dict(cfg: TrainConfig) -> dict:
    """The run's config as plain JSON values: pydantic records (ZeroConfig) as their fields, other
    objects (dtypes) as their str."""

    def plain(value):
        return value.model_dump(mode="json") if hasattr(value, "model_dump") else str(value)

    return json.loads(json.dumps(cfg.model_dump(), default=plain))


class WandbMonitor:
    """One wandb run. Online when wandb can reach its server with a key; otherwise (no network, no
    key, or WANDB_MODE=offline) an offline run directory that `wandb sync` uploads later."""

    def __init__(self, cfg: MonitorConfig, run_config: dict, say):
        import wandb

        self._wandb, self._say = wandb, say
        save_dir = Path(cfg.wandb_save_dir or ".")
        save_dir.mkdir(parents=True, exist_ok=True)
        # console="off": the log lines already reach stdout; wandb need not capture them a second time
        settings = wandb.Settings(quiet=True, console="off", init_timeout=60)
        kwargs = dict(
            project=cfg.wandb_project,
            name=cfg.wandb_exp_name,
            entity=cfg.wandb_entity,
            dir=str(save_dir),
            config=run_config,
            settings=settings,
        )
        try:
            self.run = wandb.init(**kwargs)
        except Exception as err:  # no network or no API key: keep the history locally
            if os.environ.get("WANDB_MODE") == "offline":
                raise
            say(
                f" wandb: cannot go online ({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                f"logging offline"
            )
            self.run = wandb.init(mode="offline", **kwargs)
        # run.dir is <run directory>/files; the run directory is what `wandb sync` takes
        self.run_dir = Path(self.run.dir).parent
        self.offline = bool(self.run.settings._offline)
        if self.offline:
            say(f" wandb: offline run at {self.run_dir} (upload it with: wandb sync {self.run_dir})")
        else:
            say(f" wandb: logging to {self.run.url}")

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=int(record["iteration"]))

    def close(self) -> None:
        self.run.finish()


class TensorBoardMonitor:
    """An event file in --tensorboard-dir (torch.utils.tensorboard; needs the tensorboard package)."""

    def __init__(self, cfg: MonitorConfig, run_config: dict, say):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=cfg.tensorboard_dir)
        self.writer.add_text("config", "```\n" + json.dumps(run_config, indent=2) + "\n```", 0)
        say(
            f" tensorboard: event files in {cfg.tensorboard_dir} (view with: tensorboard --logdir "
            f"{cfg.tensorboard_dir})"
        )

    def log(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, int(record["iteration"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_monitors(cfg: TrainConfig, say) -> list:
    """The monitors the config asks for; call on the logging rank only, after the process group."""
    monitors: list = []
    run_config = config_dict(cfg)
    if cfg.monitor.wandb_project:
        monitors.append(WandbMonitor(cfg.monitor, run_config, say))
    if cfg.monitor.tensorboard_dir:
        monitors.append(TensorBoardMonitor(cfg.monitor, run_config, say))
    return monitors
