"""Reading a DeepSpeed JSON config: either a whole DeepSpeed config or just its `zero_optimization`
block. Key names, aliases and defaults are DeepSpeed's; unknown keys fail naming the nearest valid
key; keys of features that have not landed here fail as "not supported yet".

Returns the settings found, each with the key it came from, so the driver can merge them with
command-line flags and reject contradictions; it never reads flags itself.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megazero.errors import UsageError
from megazero.zero.config import ZeroConfig, parse_zero_config, unknown_key_error

TOP_LEVEL = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "optimizer", "fp16", "bf16", "zero_optimization", "steps_per_print",
             "wall_clock_breakdown", "zero_allow_untested_optimizer", "prescale_gradients",
             "gradient_predivide_factor", "communication_data_type", "seed"}
# Top-level keys accepted only at their do-nothing value.
TOP_LEVEL_DEFAULTS = {"prescale_gradients": False, "gradient_predivide_factor": 1.0,
                      "communication_data_type": None}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "min_loss_scale", "auto_cast", "consecutive_hysteresis"}
OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction"}


@dataclasses.dataclass
class DeepSpeedSettings:
    """What a DeepSpeed config set: name -> (value, the JSON key it came from)."""
    zero: ZeroConfig
    values: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)

    def get(self, name: str, default=None):
        return self.values[name][0] if name in self.values else default

    def source(self, name: str) -> str:
        return self.values[name][1]


def load_deepspeed_config(path: str) -> DeepSpeedSettings:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--zero-config {path}: no such file; give a DeepSpeed JSON config")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"--zero-config {path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--zero-config {path}: expected a JSON object")
    return parse_deepspeed_config(data, str(path))


def parse_deepspeed_config(data: dict, where: str = "config") -> DeepSpeedSettings:
    # A bare zero_optimization block is recognised by its "stage" key.
    if "zero_optimization" not in data and "stage" in data:
        return DeepSpeedSettings(zero=parse_zero_config(data, f"{where}"))
    for key in data:
        if key not in TOP_LEVEL:
            raise unknown_key_error(key, TOP_LEVEL, where)
    for key, default in TOP_LEVEL_DEFAULTS.items():
        if key in data and data[key] != default:
            raise UsageError(f"{where}: {key} = {data[key]!r} is not supported yet; remove it")
    settings = DeepSpeedSettings(zero=parse_zero_config(data.get("zero_optimization", {}),
                                                        f"{where}: zero_optimization"))
    put = settings.values
    for key, name in (("train_micro_batch_size_per_gpu", "micro_batch_size"),
                      ("gradient_accumulation_steps", "gradient_accumulation_steps"),
                      ("train_batch_size", "global_batch_size"), ("gradient_clipping", "clip_grad"),
                      ("steps_per_print", "log_interval"), ("seed", "seed")):
        if key in data:
            put[name] = (_number(data[key], key, where), key)
    _read_precision(data, where, put)
    _read_optimizer(data.get("optimizer"), where, put)
    return settings


def _number(value, key: str, where: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{where}: {key} must be a number, got {value!r}")
    return int(value) if isinstance(value, float) and value.is_integer() and key != "gradient_clipping" else value


def _read_precision(data: dict, where: str, put: dict) -> None:
    fp16, bf16 = data.get("fp16", {}), data.get("bf16", {})
    for block, name in ((fp16, "fp16"), (bf16, "bf16")):
        if not isinstance(block, dict):
            raise UsageError(f"{where}: {name} must be an object like {{\"enabled\": true}}")
    for key in fp16:
        if key not in FP16_KEYS:
            raise unknown_key_error(key, FP16_KEYS, f"{where}: fp16")
    for key in bf16:
        if key != "enabled":
            raise unknown_key_error(key, {"enabled"}, f"{where}: bf16")
    if fp16.get("enabled") and bf16.get("enabled"):
        raise UsageError(f"{where}: fp16 and bf16 are both enabled; enable one")
    if fp16.get("enabled"):
        put["fp16"] = (True, "fp16.enabled")
        for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            if key in fp16:
                put[key] = (_number(fp16[key], f"fp16.{key}", where), f"fp16.{key}")
    if bf16.get("enabled"):
        put["bf16"] = (True, "bf16.enabled")


def _read_optimizer(block, where: str, put: dict) -> None:
    if block is None:
        return
    kind = str(block.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise UsageError(f"{where}: optimizer type {block.get('type')!r} is not supported; use Adam or AdamW")
    params = block.get("params", {})
    for key in params:
        if key not in OPTIMIZER_PARAMS:
            raise unknown_key_error(key, OPTIMIZER_PARAMS, f"{where}: optimizer.params")
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
    put["decoupled_weight_decay"] = (kind == "adamw" or params.get("adam_w_mode", True), "optimizer.type")
    for key, name in (("lr", "lr"), ("eps", "adam_eps"), ("weight_decay", "weight_decay")):
        if key in params:
            put[name] = (float(params[key]), f"optimizer.params.{key}")
    if "betas" in params:
        betas = params["betas"]
        if not (isinstance(betas, list) and len(betas) == 2):
            raise UsageError(f"{where}: optimizer.params.betas must be a list of two numbers")
        put["adam_beta1"] = (float(betas[0]), "optimizer.params.betas")
        put["adam_beta2"] = (float(betas[1]), "optimizer.params.betas")
