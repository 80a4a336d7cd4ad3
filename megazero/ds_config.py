"""Reading a DeepSpeed JSON config: either a whole DeepSpeed config or just its `zero_optimization`
block. Key names, aliases and defaults are DeepSpeed's. No key is silently ignored: unknown keys fail
naming the nearest valid key, keys of features that have not landed here fail as "not supported yet",
and keys whose behaviour megazero's design fixes are accepted with a note (returned as data; the
driver logs them once).

Returns the settings found, each with the key it came from, so the driver can merge them with
command-line flags and reject contradictions; it never reads flags itself.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megazero.errors import UsageError
from megazero.zero.config import (ZeroConfig, as_json, design_notes, parse_zero_config,
                                  unknown_key_error)

TOP_LEVEL = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "optimizer", "fp16", "bf16", "zero_optimization", "steps_per_print",
             "wall_clock_breakdown", "zero_allow_untested_optimizer", "prescale_gradients",
             "gradient_predivide_factor", "communication_data_type", "data_types", "seed"}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "min_loss_scale", "auto_cast", "consecutive_hysteresis"}
DATA_TYPES_KEYS = {"grad_accum_dtype"}
OPTIMIZER_KEYS = {"type", "params"}
OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction"}
DTYPES = ("fp32", "bf16", "fp16")

# The loss is divided by the global batch's token count before backward, so gradients are always
# reduced already divided: DeepSpeed's choice of where to divide has no effect here.
_DIVIDED_BEFORE = "the loss is divided by the global batch's token count before backward, so " \
                  "gradients are always reduced already divided"
# Top-level keys megazero's design fixes: key -> (the value megazero behaves as, or None when every
# value gets the note; why).
TOP_LEVEL_BY_DESIGN = {
    "prescale_gradients": (True, _DIVIDED_BEFORE),
    "gradient_predivide_factor": (None, _DIVIDED_BEFORE),
    "zero_allow_untested_optimizer": (False, "megazero's ZeRO runs only its own Adam/AdamW"),
}


@dataclasses.dataclass
class DeepSpeedSettings:
    """What a DeepSpeed config set: name -> (value, the JSON key it came from), and the notes on
    keys accepted without effect."""
    zero: ZeroConfig
    values: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

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
    zero_where = f"{where}: zero_optimization"
    # A bare zero_optimization block is recognised by its "stage" key.
    if "zero_optimization" not in data and "stage" in data:
        return DeepSpeedSettings(zero=parse_zero_config(data, zero_where), notes=design_notes(data, zero_where))
    for key in data:
        if key not in TOP_LEVEL:
            raise unknown_key_error(key, TOP_LEVEL, where)
    block = data.get("zero_optimization", {})
    settings = DeepSpeedSettings(zero=parse_zero_config(block, zero_where), notes=design_notes(block, zero_where))
    put = settings.values
    for key, name in (("train_micro_batch_size_per_gpu", "micro_batch_size"),
                      ("gradient_accumulation_steps", "gradient_accumulation_steps"),
                      ("train_batch_size", "global_batch_size"), ("gradient_clipping", "clip_grad"),
                      ("steps_per_print", "log_interval"), ("seed", "seed")):
        if key in data:
            put[name] = (_number(data[key], key, where), key)
    if "wall_clock_breakdown" in data:
        put["wall_clock_breakdown"] = (_bool(data["wall_clock_breakdown"], "wall_clock_breakdown", where),
                                       "wall_clock_breakdown")
    for key, (fixed, why) in TOP_LEVEL_BY_DESIGN.items():
        if key in data:
            check = _bool if isinstance(fixed, bool) else _number
            value = check(data[key], key, where)
            if fixed is None or value != fixed:
                settings.notes.append(f"{where}: {key} = {as_json(value)} has no effect: {why}")
    _read_dtypes(data, where, put)
    _read_precision(data, where, settings)
    _read_optimizer(data.get("optimizer"), where, settings)
    return settings


def _number(value, key: str, where: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{where}: {key} must be a number, got {as_json(value)}")
    return int(value) if isinstance(value, float) and value.is_integer() and key != "gradient_clipping" else value


def _bool(value, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{where}: {key} must be true or false, got {as_json(value)}")
    return value


def _dtype(value, key: str, where: str) -> str:
    name = value.lower() if isinstance(value, str) else value
    if name not in DTYPES:
        raise UsageError(f"{where}: {key} = {as_json(value)} is not a data type here; use "
                         f"{', '.join(map(repr, DTYPES))} (or null for the default, fp32)")
    return name


def _read_dtypes(data: dict, where: str, put: dict) -> None:
    """DeepSpeed's `communication_data_type` and `data_types.grad_accum_dtype`; null is the default."""
    if data.get("communication_data_type") is not None:
        put["reduce_dtype"] = (_dtype(data["communication_data_type"], "communication_data_type", where),
                               "communication_data_type")
    types = data.get("data_types", {})
    if not isinstance(types, dict):
        raise UsageError(f"{where}: data_types must be an object like {{\"grad_accum_dtype\": \"fp32\"}}")
    for key in types:
        if key not in DATA_TYPES_KEYS:
            raise unknown_key_error(key, DATA_TYPES_KEYS, f"{where}: data_types")
    if types.get("grad_accum_dtype") is not None:
        key = "data_types.grad_accum_dtype"
        put["grad_accum_dtype"] = (_dtype(types["grad_accum_dtype"], key, where), key)


def _read_precision(data: dict, where: str, settings: DeepSpeedSettings) -> None:
    fp16, bf16, put = data.get("fp16", {}), data.get("bf16", {}), settings.values
    for block, name in ((fp16, "fp16"), (bf16, "bf16")):
        if not isinstance(block, dict):
            raise UsageError(f"{where}: {name} must be an object like {{\"enabled\": true}}")
    for key in fp16:
        if key not in FP16_KEYS:
            raise unknown_key_error(key, FP16_KEYS, f"{where}: fp16")
    for key in bf16:
        if key != "enabled":
            raise unknown_key_error(key, {"enabled"}, f"{where}: bf16")
    # Both blocks' "enabled" are recorded, false included, so that a flag they contradict is reported.
    for block, name in ((fp16, "fp16"), (bf16, "bf16")):
        if "enabled" in block:
            put[name] = (_bool(block["enabled"], f"{name}.enabled", where), f"{name}.enabled")
    if put.get("fp16", (False,))[0] and put.get("bf16", (False,))[0]:
        raise UsageError(f"{where}: fp16 and bf16 are both enabled; enable one")
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        if key in fp16:
            put[key] = (_number(fp16[key], f"fp16.{key}", where), f"fp16.{key}")
    if "consecutive_hysteresis" in fp16:
        key = "fp16.consecutive_hysteresis"
        put["consecutive_hysteresis"] = (_bool(fp16["consecutive_hysteresis"], key, where), key)
    if _bool(fp16.get("auto_cast", False), "fp16.auto_cast", where):
        settings.notes.append(f"{where}: fp16.auto_cast = true has no effect: the model's inputs are "
                              f"token ids and it computes in its parameter dtype")


def _read_optimizer(block, where: str, settings: DeepSpeedSettings) -> None:
    if block is None:
        return
    if not isinstance(block, dict):
        raise UsageError(f"{where}: optimizer must be an object like {{\"type\": \"AdamW\", \"params\": {{}}}}")
    for key in block:
        if key not in OPTIMIZER_KEYS:
            raise unknown_key_error(key, OPTIMIZER_KEYS, f"{where}: optimizer")
    kind = str(block.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise UsageError(f"{where}: optimizer type {block.get('type')!r} is not supported; use Adam or AdamW")
    params, put = block.get("params", {}), settings.values
    if not isinstance(params, dict):
        raise UsageError(f"{where}: optimizer.params must be an object like {{\"lr\": 0.001}}")
    for key in params:
        if key not in OPTIMIZER_PARAMS:
            raise unknown_key_error(key, OPTIMIZER_PARAMS, f"{where}: optimizer.params")
    w_mode = _bool(params.get("adam_w_mode", True), "optimizer.params.adam_w_mode", where)
    if kind == "adamw" and not w_mode:
        raise UsageError(f"{where}: optimizer type AdamW always decouples weight decay, but "
                         f"optimizer.params.adam_w_mode = false; use type Adam for L2 weight decay")
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
    put["decoupled_weight_decay"] = (w_mode, "optimizer.type")
    if not _bool(params.get("bias_correction", True), "optimizer.params.bias_correction", where):
        raise UsageError(f"{where}: optimizer.params.bias_correction = false is not supported (Adam "
                         f"without bias correction is a different algorithm); remove it or set it to true")
    if _bool(params.get("torch_adam", False), "optimizer.params.torch_adam", where):
        settings.notes.append(f"{where}: optimizer.params.torch_adam = true has no effect: megazero "
                              f"steps with its own Adam kernel (the math of torch.optim.Adam/AdamW)")
    for key, name in (("lr", "lr"), ("eps", "adam_eps"), ("weight_decay", "weight_decay")):
        if key in params:
            put[name] = (float(_number(params[key], f"optimizer.params.{key}", where)), f"optimizer.params.{key}")
    if "betas" in params:
        betas = params["betas"]
        if not (isinstance(betas, list) and len(betas) == 2):
            raise UsageError(f"{where}: optimizer.params.betas must be a list of two numbers")
        put["adam_beta1"] = (float(_number(betas[0], "optimizer.params.betas", where)), "optimizer.params.betas")
        put["adam_beta2"] = (float(_number(betas[1], "optimizer.params.betas", where)), "optimizer.params.betas")
