"""The wandb and TensorBoard flags as a `MonitorConfig`, checked at the edge before any process group:
a flag that needs another, a monitor whose package is missing (one line naming the extra that installs
it), a save directory that cannot be written. The writers themselves are megazero.training.monitor's.
"""

from __future__ import annotations

from megazero.config.train_config import MonitorConfig
from megazero.core.errors import UsageError, check_writable_dir

_EXTRAS = {"wandb": ("wandb", "--wandb-project"), "tensorboard": ("tensorboard", "--tensorboard-dir")}


def add_monitor_flags(g, add) -> None:
    """The flags of this module, added to argument group `g` with `add` (flags._add)."""
    add(g, "--wandb-project", default=None, help="Weights & Biases project to log to", shown="none: no wandb")
    add(g, "--wandb-exp-name", default=None, help="wandb run name", shown="chosen by wandb")
    add(g, "--wandb-save-dir", default=None, help="folder wandb writes its wandb/ run folders into", shown="--run-dir")
    add(g, "--wandb-entity", default=None, help="wandb team or user", shown="the account's default")
    add(g, "--tensorboard-dir", default=None, help="folder for TensorBoard event files", shown="none: no TensorBoard")


def check_monitors_installed(cfg: MonitorConfig) -> None:
    """A monitor asked for without its package is one line naming the extra that installs it."""
    wanted = [name for name, on in (("wandb", cfg.wandb_project), ("tensorboard", cfg.tensorboard_dir)) if on]
    for name in wanted:
        try:
            __import__(name)
        except ImportError:
            extra, flag = _EXTRAS[name]
            raise UsageError(
                f"{flag} needs the {name} package; install it with pip install -e '.[{extra}]' (or pip install {name})"
            ) from None


def monitor_config(args, run_dir: str) -> MonitorConfig:
    """The wandb/TensorBoard flags as a MonitorConfig; a monitor whose package is missing fails here,
    at the edge, before any process group exists."""
    if args.wandb_project is None:
        for flag, value in (
            ("--wandb-exp-name", args.wandb_exp_name),
            ("--wandb-save-dir", args.wandb_save_dir),
            ("--wandb-entity", args.wandb_entity),
        ):
            if value is not None:
                raise UsageError(f"{flag} needs --wandb-project NAME (the project the run logs to)")
    monitor = MonitorConfig(
        wandb_project=args.wandb_project,
        wandb_exp_name=args.wandb_exp_name,
        wandb_entity=args.wandb_entity,
        wandb_save_dir=(args.wandb_save_dir or run_dir) if args.wandb_project else None,
        tensorboard_dir=args.tensorboard_dir,
    )
    check_monitors_installed(monitor)
    for flag, folder in (("--wandb-save-dir", monitor.wandb_save_dir), ("--tensorboard-dir", monitor.tensorboard_dir)):
        if folder is not None:
            check_writable_dir(folder, f"{flag} {folder}", f"pass {flag} DIR in a writable place")
    return monitor
