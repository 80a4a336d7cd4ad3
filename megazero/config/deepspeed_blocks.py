"""What a DeepSpeed config sets (`DeepSpeedSettings`: each value with the JSON key it came from), the
readers its values go through, and the blocks that stand for command-line flags: `scheduler` (the lr
schedule), `activation_checkpointing` (recomputation) and the `wandb` / `tensorboard` / `csv_monitor`
monitors. `flags_from_config` hands those blocks' values to the flags after checking them against
what the command line gave. deepspeed_json.py reads the rest of the config and calls the block readers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from megazero.core.errors import UsageError
from megazero.core.records import Record
from megazero.zero.config import ZeroConfig, as_json, unknown_key_error

# DeepSpeed's lr schedulers with a megazero equivalent -> megazero's decay after warmup.
SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
_WARMUP = {"warmup_num_steps", "warmup_type", "last_batch_iteration"}
SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP | {"warmup_min_lr", "warmup_max_lr"},
    "WarmupDecayLR": _WARMUP | {"warmup_min_lr", "warmup_max_lr", "total_num_steps"},
    "WarmupCosineLR": _WARMUP | {"warmup_min_ratio", "cos_min_ratio", "total_num_steps"},
}
NOT_SUPPORTED_SCHEDULERS = ("OneCycle", "LRRangeTest")
DS_DEFAULT = " (DeepSpeed's default)"  # marks a setting a flag may override without contradiction

# activation_checkpointing keys -> (the value that asks for nothing, why another value has no effect).
# The block asks for DeepSpeed's (and Megatron-DeepSpeed's) recomputation: each transformer layer keeps
# its input and is recomputed whole in backward, i.e. --recompute-granularity full --recompute-method
# uniform --recompute-num-layers 1. cpu_checkpointing moves each checkpoint's input (the only tensor a
# recomputed layer keeps) to host memory: --cpu-offloading over every layer.
ACTIVATION_KEYS = {
    "partition_activations": (
        False,
        "each layer's saved input is not split across tensor-parallel "
        "ranks (--sequence-parallel splits it along the sequence)",
    ),
    "contiguous_memory_optimization": (False, "saved layer inputs live in torch's caching allocator"),
    "number_checkpoints": (None, "every transformer layer is a checkpoint"),
    "synchronize_checkpoint_boundary": (False, "recomputation never synchronises the device"),
    "profile": (False, "wall_clock_breakdown times forward and backward"),
    "cpu_checkpointing": (False, None),  # None: read below (activation offload)
}
MONITOR_KEYS = {
    "wandb": {"enabled", "project", "team", "group"},
    "tensorboard": {"enabled", "output_path", "job_name"},
    "csv_monitor": {"enabled", "output_path", "job_name"},
}

# Settings a config may give for flags outside megazero.config.flags.MERGED: args attribute -> flag.
FLAG_SETTINGS = {
    "recompute_granularity": "--recompute-granularity",
    "recompute_method": "--recompute-method",
    "recompute_num_layers": "--recompute-num-layers",
    "lr_warmup_iters": "--lr-warmup-iters",
    "lr_decay_iters": "--lr-decay-iters",
    "lr_decay_style": "--lr-decay-style",
    "min_lr": "--min-lr",
    "wandb_project": "--wandb-project",
    "wandb_entity": "--wandb-entity",
    "tensorboard_dir": "--tensorboard-dir",
    "cpu_offloading": "--cpu-offloading",
}
# Where the monitors write: about the console and the dashboards, not the training, so a flag that
# says otherwise wins (with a note) instead of contradicting the config.
COSMETIC_SETTINGS = {"wandb_project", "wandb_entity", "tensorboard_dir"}
# Flags that give the same setting another way: args attribute -> their args attributes.
SAME_SETTING = {"lr_warmup_iters": ("lr_warmup_fraction", "lr_warmup_samples"), "lr_decay_iters": ("lr_decay_samples",)}
# Parser defaults that are not None: a flag at this value counts as not given.
FLAG_DEFAULTS = {"lr_decay_style": "cosine", "cpu_offloading": False}


class DeepSpeedSettings(Record):
    """What a DeepSpeed config set: name -> (value, the JSON key it came from), and the notes on
    keys accepted without effect."""

    zero: ZeroConfig
    values: dict[str, tuple[Any, str]] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    auto: set[str] = Field(default_factory=set)
    """Dotted keys whose value was "auto" (dropped: the flags give them)."""

    def get(self, name: str, default=None):
        return self.values[name][0] if name in self.values else default

    def source(self, name: str) -> str:
        return self.values[name][1]


def setting_origin(
    args, ds: DeepSpeedSettings | None, name: str, flag: str | None, attr: str = "", with_file: bool = True
) -> str | None:
    """Where a setting came from, as the user wrote it: its flag (args attribute `attr`, else
    `name`), else its DeepSpeed key (and file); None when neither set it."""
    if flag and getattr(args, attr or name, None) is not None:
        return flag
    if ds and name in ds.values:
        return f"{ds.source(name)} in {args.zero_config}" if with_file else ds.source(name)
    return None


def as_number(value, key: str, where: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{where}: {key} must be a number, got {as_json(value)}")
    return int(value) if isinstance(value, float) and value.is_integer() and key != "gradient_clipping" else value


def as_bool(value, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{where}: {key} must be true or false, got {as_json(value)}")
    return value


def as_block(value, name: str, where: str, keys: set[str]) -> dict:
    """A config block checked to be an object of known keys."""
    if not isinstance(value, dict):
        raise UsageError(f"{where}: {name} must be a JSON object, got {as_json(value)}")
    for key in value:
        if key not in keys:
            raise unknown_key_error(key, keys, f"{where}: {name}")
    return value


def flags_from_config(settings: DeepSpeedSettings, flags: dict[str, Any], lr: float, path: str) -> dict[str, Any]:
    """The values the config gives for flags outside megazero.config.flags.MERGED (recomputation, the lr
    schedule, monitors), as args attributes, for the driver to set before it reads those flags.

    `flags` maps args attributes to the values parsed from the command line (None, or a parser default
    in FLAG_DEFAULTS: not given); a flag given with another value than the config's is an error naming
    both, except against a DeepSpeed default the user did not write, which the flag overrides. `lr` is
    the run's peak rate (WarmupCosineLR's floor is a ratio of it)."""
    values = dict(settings.values)
    if "min_lr_ratio" in values:
        ratio, source = values.pop("min_lr_ratio")
        values["min_lr"] = (lr * ratio, source)
    out = {}
    for name, flag in FLAG_SETTINGS.items():
        if name not in values:
            continue
        value, source = values[name]
        if name not in flags:
            raise UsageError(f"{source} in {path} is not supported yet (this build has no {flag}); remove it")
        given = flags[name]
        given = None if given == FLAG_DEFAULTS.get(name, None) else given
        others = [o for o in SAME_SETTING.get(name, ()) if flags.get(o) is not None]
        if source.endswith(DS_DEFAULT) and (given is not None or others):
            continue
        if given is not None and given != value and name in COSMETIC_SETTINGS:
            settings.notes.append(f"{flag} {given} wins over {source} = {as_json(value)} in {path}")
            continue
        if given is not None and given != value:
            raise UsageError(f"{flag} {given} contradicts {source} = {as_json(value)} in {path}; remove one")
        if others:
            raise UsageError(f"--{others[0].replace('_', '-')} contradicts {source} in {path}; remove one")
        out[name] = value
    if "min_lr" in out and out["min_lr"] > lr:
        raise UsageError(
            f"{values['min_lr'][1]} in {path} gives a final learning rate {out['min_lr']:g} above "
            f"the peak {lr:g}; lower it or raise the peak"
        )
    return out


def read_scheduler(block, where: str, settings: DeepSpeedSettings) -> None:
    """WarmupLR / WarmupDecayLR / WarmupCosineLR onto megazero's schedule (linear warmup from 0, then
    constant / linear / cosine decay to min_lr at decay_iters)."""
    if block is None:
        return
    block = as_block(block, "scheduler", where, {"type", "params"})
    kind = block.get("type")
    if kind in NOT_SUPPORTED_SCHEDULERS:
        raise UsageError(
            f"{where}: scheduler type {kind} is not supported yet; use WarmupLR, WarmupDecayLR "
            f"or WarmupCosineLR (or the --lr-* flags)"
        )
    if kind not in SCHEDULERS:
        what = "needs a type" if kind is None else f"type {as_json(kind)} is not a DeepSpeed scheduler"
        raise UsageError(
            f"{where}: scheduler {what}; use WarmupLR, WarmupDecayLR or WarmupCosineLR (or "
            f"remove the block: the --lr-* flags give the schedule)"
        )
    params = as_block(block.get("params", {}), "scheduler.params", where, SCHEDULER_PARAMS[kind])
    put, auto = settings.values, settings.auto

    def number(key: str, default=None):
        """The key's value and source; a DeepSpeed default (marked) when absent and not "auto"."""
        if key in params:
            return as_number(params[key], f"scheduler.params.{key}", where), f"scheduler.params.{key}"
        if f"scheduler.params.{key}" in auto or default is None:
            return None, None
        return default, f"scheduler.params.{key}{DS_DEFAULT}"

    put["lr_decay_style"] = (SCHEDULERS[kind], "scheduler.type")
    steps, source = number("warmup_num_steps", 1000)
    if steps is not None:
        if steps < 0:
            raise UsageError(f"{where}: scheduler.params.warmup_num_steps must be >= 0, got {steps}")
        put["lr_warmup_iters"] = (int(steps), source)
    total, source = number("total_num_steps")
    if total is not None:
        if total < 1:
            raise UsageError(f"{where}: scheduler.params.total_num_steps must be >= 1, got {total}")
        put["lr_decay_iters"] = (int(total), source)
    if as_number(params.get("last_batch_iteration", -1), "scheduler.params.last_batch_iteration", where) != -1:
        raise UsageError(
            f"{where}: scheduler.params.last_batch_iteration is not supported yet; remove it "
            f"(--load resumes the schedule with the checkpoint)"
        )
    _read_warmup_type(params, where, settings)
    if kind == "WarmupCosineLR":
        _read_cosine_floor(params, where, settings, number)
    else:
        _read_warmup_rates(kind, params, where, settings, number)


def _read_warmup_type(params: dict, where: str, settings: DeepSpeedSettings) -> None:
    kind = params.get("warmup_type", "log")
    if kind not in ("log", "linear"):
        raise UsageError(f'{where}: scheduler.params.warmup_type must be "log" or "linear", got {as_json(kind)}')
    if kind == "log" and "scheduler.params.warmup_type" not in settings.auto:
        default = "" if "warmup_type" in params else DS_DEFAULT
        settings.notes.append(
            f'{where}: scheduler.params.warmup_type = "log"{default} is not implemented: '
            f"the warmup here rises linearly from 0"
        )


def _read_warmup_rates(kind: str, params: dict, where: str, settings: DeepSpeedSettings, number) -> None:
    put = settings.values
    if "warmup_max_lr" in params:
        # DeepSpeed's default peak (0.001) would override the optimizer's lr; here an absent
        # warmup_max_lr leaves the peak to optimizer.params.lr or --lr.
        peak, source = number("warmup_max_lr")
        if "lr" in put and put["lr"][0] != peak:
            raise UsageError(
                f"{where}: {source} = {as_json(peak)} contradicts {put['lr'][1]} = {as_json(put['lr'][0])}; remove one"
            )
        put["lr"] = (float(peak), source)
    floor, source = number("warmup_min_lr", 0.0)
    if floor is not None and floor > 0 and "warmup_min_lr" in params:
        settings.notes.append(
            f"{where}: scheduler.params.warmup_min_lr = {as_json(floor)} is where the "
            f"warmup starts in DeepSpeed; here it starts at 0"
            + (" and the rate decays to it" if kind == "WarmupDecayLR" else "")
        )
    if floor is not None and kind == "WarmupDecayLR":
        put["min_lr"] = (float(floor), source)


def _read_cosine_floor(params: dict, where: str, settings: DeepSpeedSettings, number) -> None:
    ratio, source = number("cos_min_ratio", 0.0001)
    if ratio is not None:
        settings.values["min_lr_ratio"] = (float(ratio), source)
    start = params.get("warmup_min_ratio", 0)
    if as_number(start, "scheduler.params.warmup_min_ratio", where) != 0:
        settings.notes.append(
            f"{where}: scheduler.params.warmup_min_ratio = {as_json(start)} is where the "
            f"warmup starts in DeepSpeed; here it starts at 0"
        )


def read_activation_checkpointing(block, where: str, settings: DeepSpeedSettings) -> None:
    """The block turns full recomputation on: each transformer layer keeps its input and is recomputed
    in backward (full, uniform, one layer per group); settings for DeepSpeed's own implementation are
    noted."""
    if block is None:
        return
    block = as_block(block, "activation_checkpointing", where, set(ACTIVATION_KEYS))
    for name, value in (
        ("recompute_granularity", "full"),
        ("recompute_method", "uniform"),
        ("recompute_num_layers", 1),
    ):
        settings.values[name] = (value, "activation_checkpointing")
    for key, value in block.items():
        nothing, why = ACTIVATION_KEYS[key]
        if value is None or value == nothing:
            continue
        name = f"activation_checkpointing.{key}"
        if key == "cpu_checkpointing":
            settings.values["cpu_offloading"] = (as_bool(value, name, where), name)
            continue
        settings.notes.append(f"{where}: {name} = {as_json(value)} has no effect: {why}")


def read_monitors(data: dict, where: str, settings: DeepSpeedSettings) -> None:
    """DeepSpeed's wandb and tensorboard monitors onto the monitor flags; csv_monitor is noted."""
    put = settings.values
    for name, keys in MONITOR_KEYS.items():
        block = as_block(data.get(name, {}), name, where, keys)
        if not as_bool(block.get("enabled", False), f"{name}.enabled", where):
            continue
        if name == "wandb":
            put["wandb_project"] = (str(block.get("project", "deepspeed")), "wandb.project")
            if "team" in block:
                put["wandb_entity"] = (str(block["team"]), "wandb.team")
            if "group" in block:
                settings.notes.append(
                    f"{where}: wandb.group has no effect: runs are not grouped (--wandb-exp-name names the run)"
                )
        elif name == "tensorboard":
            # DeepSpeed writes under output_path/job_name, with these defaults.
            folder = Path(str(block.get("output_path", ""))) / str(block.get("job_name", "DeepSpeedJobName"))
            put["tensorboard_dir"] = (str(folder), "tensorboard.output_path")
        else:
            settings.notes.append(
                f"{where}: csv_monitor has no effect: every logged record goes to "
                f"metrics.jsonl in the run directory (--metrics-file)"
            )
