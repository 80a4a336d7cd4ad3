"""What `megazero.initialize` reads from a DeepSpeed config: the config is parsed by
megazero.config.deepspeed_json (every key mapped or refused there), and this module turns the
settings into the records the engine takes, with DeepSpeed's meaning where it differs from the
command line's: the batch triple resolved as DeepSpeed resolves it, the optimizer block's defaults
(DeepSpeed's Adam/AdamW: lr 1e-3, weight decay 0 on every parameter), the scheduler block stepped
by DeepSpeed's own formulas (schedulers.py), blocks that configure DeepSpeed-only code noted.

Owns no tensors and no process groups: everything here runs before either exists.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megazero.config.deepspeed_blocks import DeepSpeedSettings
from megazero.config.deepspeed_json import load_deepspeed_config, parse_deepspeed_config
from megazero.config.muon_flags import DEEPSPEED_MUON
from megazero.core.errors import UsageError
from megazero.ops.adam_config import AdamConfig
from megazero.ops.muon_config import MuonConfig
from megazero.zero.config import PrecisionConfig, ZeroConfig

# DeepSpeed's FusedAdam defaults (the optimizer block's params it does not give).
ADAM_DEFAULTS = {"lr": 1e-3, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.0}
# Settings the command line's blocks produce that mean nothing for a user's own model, and why.
NOT_FOR_YOUR_MODEL = {
    "recompute_granularity": "activation_checkpointing configures DeepSpeed's own checkpoint function; "
    "for your model call model.gradient_checkpointing_enable() or torch.utils.checkpoint",
    "wandb_project": "monitors are written by pretrain_gpt.py's loop, not by megazero.initialize's engine",
    "tensorboard_dir": "monitors are written by pretrain_gpt.py's loop, not by megazero.initialize's engine",
    "log_interval": "steps_per_print: the engine prints nothing per step; read engine.get_lr() and "
    "engine.get_global_grad_norm()",
    "wall_clock_breakdown": "the engine keeps no phase timers",
}


@dataclasses.dataclass
class ApiSettings:
    """A DeepSpeed config as megazero.initialize's engine uses it."""

    zero: ZeroConfig
    precision: PrecisionConfig
    adam: AdamConfig | None  # None: no optimizer block (the client's or none)
    muon: MuonConfig | None  # an optimizer block of type Muon (Adam steps the rest)
    clip_grad: float
    micro_batch: int
    accumulation: int
    global_batch: int
    scheduler: dict | None  # the raw, checked block (type, params)
    seed: int | None
    notes: list[str]
    where: str


def read_config(config, where: str | None = None) -> tuple[DeepSpeedSettings, dict]:
    """A DeepSpeed config given as a dict or a JSON path: (its parsed settings, the JSON data)."""
    if isinstance(config, (str, Path)):
        settings = load_deepspeed_config(str(config), flag="config")
        return settings, json.loads(Path(config).read_text())
    if not isinstance(config, dict):
        raise UsageError(
            f"config must be a DeepSpeed config as a dict or a JSON file path, got {type(config).__name__}"
        )
    return parse_deepspeed_config(dict(config), where or "config"), config


def api_settings(config, dp: int) -> ApiSettings:
    """The settings of `config` for `dp` data-parallel ranks (the batch triple needs it)."""
    where = str(config) if isinstance(config, (str, Path)) else "config"
    settings, data = read_config(config)
    values = settings.values
    micro, accumulation, global_batch = resolve_batch(
        values.get("micro_batch_size", (None,))[0],
        values.get("gradient_accumulation_steps", (None,))[0],
        values.get("global_batch_size", (None,))[0],
        dp,
        where,
    )
    # The schedulers' notes are about pretrain_gpt.py's schedule; here DeepSpeed's formulas run as written.
    notes = [note for note in settings.notes if "scheduler.params." not in note]
    for name, why in NOT_FOR_YOUR_MODEL.items():
        if name in values:
            notes.append(f"{where}: {values[name][1]} has no effect here: {why}")
    return ApiSettings(
        zero=settings.zero,
        precision=_precision(settings),
        adam=_adam(data, settings),
        muon=_muon(settings, where),
        clip_grad=float(settings.get("clip_grad", 0.0)),
        micro_batch=micro,
        accumulation=accumulation,
        global_batch=global_batch,
        scheduler=data.get("scheduler"),
        seed=settings.get("seed"),
        notes=notes,
        where=where,
    )


def resolve_batch(micro, accumulation, global_batch, dp: int, where: str) -> tuple[int, int, int]:
    """DeepSpeed's rule: train_batch_size = micro batch x accumulation steps x data-parallel ranks,
    any two giving the third (one alone: accumulation 1)."""
    given = {
        k: v
        for k, v in (
            ("train_micro_batch_size_per_gpu", micro),
            ("gradient_accumulation_steps", accumulation),
            ("train_batch_size", global_batch),
        )
        if v is not None
    }
    for key, value in given.items():
        if not isinstance(value, int) or value < 1:
            raise UsageError(f"{where}: {key} must be a positive integer, got {value}")
    if global_batch is None and micro is None:
        raise UsageError(
            f"{where}: give train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed's "
            f"batch = micro batch x gradient_accumulation_steps x {dp} data-parallel ranks)"
        )
    if global_batch is None:
        accumulation = accumulation or 1
        global_batch = micro * accumulation * dp
    elif micro is None:
        accumulation = accumulation or 1
        micro, rest = divmod(global_batch, accumulation * dp)
        if rest or micro == 0:
            raise UsageError(
                f"{where}: train_batch_size {global_batch} is not divisible by "
                f"gradient_accumulation_steps {accumulation} x {dp} data-parallel ranks"
            )
    elif accumulation is None:
        accumulation, rest = divmod(global_batch, micro * dp)
        if rest or accumulation == 0:
            raise UsageError(
                f"{where}: train_batch_size {global_batch} is not divisible by "
                f"train_micro_batch_size_per_gpu {micro} x {dp} data-parallel ranks"
            )
    if micro * accumulation * dp != global_batch:
        raise UsageError(
            f"{where}: train_batch_size {global_batch} != train_micro_batch_size_per_gpu {micro} "
            f"x gradient_accumulation_steps {accumulation} x {dp} data-parallel ranks; "
            f"give two of the three"
        )
    return micro, accumulation, global_batch


def _precision(settings: DeepSpeedSettings) -> PrecisionConfig:
    fields = {}
    for name in (
        "bf16",
        "fp16",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "min_loss_scale",
        "consecutive_hysteresis",
        "grad_accum_dtype",
        "reduce_dtype",
    ):
        if name in settings.values:
            fields[name] = settings.get(name)
    precision = PrecisionConfig(**fields)
    half = "bf16" if precision.bf16 else "fp16" if precision.fp16 else None
    for name in ("grad_accum_dtype", "reduce_dtype"):
        value = getattr(precision, name)
        if value != "fp32" and value != half:
            raise UsageError(
                f'{settings.source(name)} = "{value}" needs {value}.enabled; a 16-bit '
                f"gradient dtype equals the parameter dtype"
            )
    return precision


def _adam(data: dict, settings: DeepSpeedSettings) -> AdamConfig | None:
    if data.get("optimizer") is None:
        return None
    values: dict[str, Any] = {name: settings.get(name, default) for name, default in ADAM_DEFAULTS.items()}
    return AdamConfig(
        lr=float(values["lr"]),
        beta1=values["adam_beta1"],
        beta2=values["adam_beta2"],
        eps=values["adam_eps"],
        weight_decay=values["weight_decay"],
        decoupled_weight_decay=settings.get("decoupled_weight_decay", True),
    )


def _muon(settings: DeepSpeedSettings, where: str) -> MuonConfig | None:
    """DeepSpeed's Muon (an optimizer block of type Muon): its fixed choices, the block's momentum."""
    if settings.get("optimizer") != "muon":
        return None
    if settings.zero.zenflow is not None:
        raise UsageError(
            f"{where}: optimizer.type Muon with zero_optimization.zenflow is not supported "
            f"(ZenFlow selects the columns Adam steps); drop one of them"
        )
    momentum = settings.get("muon_momentum", DEEPSPEED_MUON["momentum"])
    if not 0 <= momentum < 1:
        raise UsageError(f"{where}: optimizer.params.momentum must be in [0, 1), got {momentum}")
    return MuonConfig(**{**DEEPSPEED_MUON, "momentum": momentum})
