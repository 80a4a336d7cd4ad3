"""Reading a DeepSpeed JSON config: either a whole DeepSpeed config or just its `zero_optimization`
block. Key names, aliases and defaults are DeepSpeed's. No key is silently ignored: every top-level
key DeepSpeed documents is known here. Keys with a megazero equivalent map onto it (the
`activation_checkpointing` block turns recomputation on, the `WarmupLR`/`WarmupDecayLR`/
`WarmupCosineLR` schedulers become the lr schedule, the `wandb`/`tensorboard` monitors the monitor
flags); keys of features that have not landed here fail as "not supported yet" unless they ask for
nothing; only keys DeepSpeed does not have are "unknown" (naming the nearest valid key); keys whose
behaviour megazero's design fixes are accepted with a note (returned as data; the driver logs them
once). A value "auto", as the Hugging Face Trainer writes its DeepSpeed configs, is dropped, so the
setting comes from the flags (or their default).

Returns the settings found, each with the key it came from, so the driver can merge them with
command-line flags and reject contradictions; it never reads argv itself (`flags_from_config` is
handed the flag values).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megazero.core.errors import UsageError
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

# Top-level keys that map onto megazero settings outside the blocks above (read below).
MAPPED_TOP_LEVEL = {"scheduler", "activation_checkpointing", "wandb", "tensorboard", "csv_monitor"}
# DeepSpeed's other top-level keys: features with no megazero equivalent yet -> a hint for the message.
# A value that asks for nothing (false, null, {}, a block with "enabled": false) is accepted.
NOT_SUPPORTED_YET_TOP = {
    "amp": "use --bf16 or --fp16", "torch_autocast": "use --bf16 or --fp16",
    "pipeline": "use --pipeline-model-parallel-size and --pipeline-schedule",
    "tensor_parallel": "use --tensor-model-parallel-size", "sequence_parallel_size": "",
    "checkpoint": "checkpoints are written with --save and read with --load",
    "flops_profiler": "TFLOP/s per device are logged with every iteration",
    "comms_logger": "", "comet": "use --wandb-project or --tensorboard-dir",
    "timers": "wall_clock_breakdown times the phases of each step",
    "memory_breakdown": "every log line carries the memory in use",
    "aio": "it serves NVMe offload, which has not landed", "zero_force_ds_cpu_optimizer": "",
    "sparse_attention": "", "sparse_gradients": "", "autotuning": "", "elasticity": "",
    "compression_training": "", "data_efficiency": "", "curriculum_learning": "",
    "progressive_layer_drop": "", "eigenvalue": "", "quantize_training": "", "weight_quantization": "",
    "graph_harvesting": "", "dump_state": "", "nebula": "", "hybrid_engine": "", "compile": "",
    "disable_allgather": "", "dataloader_drop_last": "", "managed_gradient_accumulation": "",
}
# Values beyond false/null/{} that ask for what megazero does anyway.
ASKS_FOR_NOTHING = {"managed_gradient_accumulation": True, "zero_force_ds_cpu_optimizer": True,
                    "sequence_parallel_size": 1}
KNOWN_TOP_LEVEL = TOP_LEVEL | MAPPED_TOP_LEVEL | set(NOT_SUPPORTED_YET_TOP)

# DeepSpeed's lr schedulers with a megazero equivalent -> megazero's decay after warmup.
SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
_WARMUP = {"warmup_num_steps", "warmup_type", "last_batch_iteration"}
SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP | {"warmup_min_lr", "warmup_max_lr"},
    "WarmupDecayLR": _WARMUP | {"warmup_min_lr", "warmup_max_lr", "total_num_steps"},
    "WarmupCosineLR": _WARMUP | {"warmup_min_ratio", "cos_min_ratio", "total_num_steps"},
}
NOT_SUPPORTED_SCHEDULERS = ("OneCycle", "LRRangeTest")
DS_DEFAULT = " (DeepSpeed's default)"    # marks a setting a flag may override without contradiction

# activation_checkpointing keys -> (the value that asks for nothing, why another value has no effect).
# Recomputation here keeps each transformer layer's input and recomputes the layer in backward.
ACTIVATION_KEYS = {
    "partition_activations": (False, "each layer's saved input is not split across tensor-parallel "
                                     "ranks (--sequence-parallel splits it along the sequence)"),
    "contiguous_memory_optimization": (False, "saved layer inputs live in torch's caching allocator"),
    "number_checkpoints": (None, "every transformer layer is a checkpoint"),
    "synchronize_checkpoint_boundary": (False, "recomputation never synchronises the device"),
    "profile": (False, "wall_clock_breakdown times forward and backward"),
    "cpu_checkpointing": (False, None),       # None: not supported yet (activation offload)
}
MONITOR_KEYS = {"wandb": {"enabled", "project", "team", "group"},
                "tensorboard": {"enabled", "output_path", "job_name"},
                "csv_monitor": {"enabled", "output_path", "job_name"}}

# Settings a config may give for flags outside megazero.config.flags.MERGED: args attribute -> flag.
FLAG_SETTINGS = {"recompute_activations": "--recompute-activations", "lr_warmup_iters": "--lr-warmup-iters",
                 "lr_decay_iters": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
                 "min_lr": "--min-lr", "wandb_project": "--wandb-project", "wandb_entity": "--wandb-entity",
                 "tensorboard_dir": "--tensorboard-dir"}
# Flags that give the same setting another way: args attribute -> their args attributes.
SAME_SETTING = {"lr_warmup_iters": ("lr_warmup_fraction", "lr_warmup_samples"),
                "lr_decay_iters": ("lr_decay_samples",)}
# Parser defaults that are not None: a flag at this value counts as not given.
FLAG_DEFAULTS = {"lr_decay_style": "cosine", "recompute_activations": False}

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
    auto: set[str] = dataclasses.field(default_factory=set)
    """Dotted keys whose value was "auto" (dropped: the flags give them)."""

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
    auto: set[str] = set()
    data = drop_auto(data, "", auto)
    zero_where = f"{where}: zero_optimization"
    # A bare zero_optimization block is recognised by its "stage" key.
    if "zero_optimization" not in data and "stage" in data:
        return DeepSpeedSettings(zero=parse_zero_config(data, zero_where), notes=design_notes(data, zero_where),
                                 auto=auto)
    for key in data:
        if key in NOT_SUPPORTED_YET_TOP:
            _check_asks_for_nothing(key, data[key], where)
        elif key not in TOP_LEVEL | MAPPED_TOP_LEVEL:
            raise unknown_key_error(key, KNOWN_TOP_LEVEL, where)
    block = data.get("zero_optimization", {})
    settings = DeepSpeedSettings(zero=parse_zero_config(block, zero_where), notes=design_notes(block, zero_where),
                                 auto=auto)
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
    _read_scheduler(data.get("scheduler"), where, settings)
    _read_activation_checkpointing(data.get("activation_checkpointing"), where, settings)
    _read_monitors(data, where, settings)
    return settings


def drop_auto(data, prefix: str, dropped: set[str]):
    """`data` without its "auto" values, at any depth; their dotted keys are added to `dropped`."""
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        if value == "auto":
            dropped.add(prefix + key)
        else:
            out[key] = drop_auto(value, f"{prefix}{key}.", dropped)
    return out


def _check_asks_for_nothing(key: str, value, where: str) -> None:
    nothing = value in (None, False, {}) or value == ASKS_FOR_NOTHING.get(key, None) or \
        (isinstance(value, dict) and value.get("enabled") is False)
    if not nothing:
        hint = NOT_SUPPORTED_YET_TOP[key]
        raise UsageError(f"{where}: {key} is not supported yet (megazero has no equivalent of DeepSpeed's "
                         f"{key}); remove it or set \"enabled\": false" + (f"; {hint}" if hint else ""))


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
        if given is not None and given != value:
            raise UsageError(f"{flag} {given} contradicts {source} = {as_json(value)} in {path}; remove one")
        if others:
            raise UsageError(f"--{others[0].replace('_', '-')} contradicts {source} in {path}; remove one")
        out[name] = value
    if "min_lr" in out and out["min_lr"] > lr:
        raise UsageError(f"{values['min_lr'][1]} in {path} gives a final learning rate {out['min_lr']:g} above "
                         f"the peak {lr:g}; lower it or raise the peak")
    return out


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


def _block(value, name: str, where: str, keys: set[str]) -> dict:
    """A config block checked to be an object of known keys."""
    if not isinstance(value, dict):
        raise UsageError(f"{where}: {name} must be a JSON object, got {as_json(value)}")
    for key in value:
        if key not in keys:
            raise unknown_key_error(key, keys, f"{where}: {name}")
    return value


def _read_scheduler(block, where: str, settings: DeepSpeedSettings) -> None:
    """WarmupLR / WarmupDecayLR / WarmupCosineLR onto megazero's schedule (linear warmup from 0, then
    constant / linear / cosine decay to min_lr at decay_iters)."""
    if block is None:
        return
    block = _block(block, "scheduler", where, {"type", "params"})
    kind = block.get("type")
    if kind in NOT_SUPPORTED_SCHEDULERS:
        raise UsageError(f"{where}: scheduler type {kind} is not supported yet; use WarmupLR, WarmupDecayLR "
                         f"or WarmupCosineLR (or the --lr-* flags)")
    if kind not in SCHEDULERS:
        what = "needs a type" if kind is None else f"type {as_json(kind)} is not a DeepSpeed scheduler"
        raise UsageError(f"{where}: scheduler {what}; use WarmupLR, WarmupDecayLR or WarmupCosineLR (or "
                         f"remove the block: the --lr-* flags give the schedule)")
    params = _block(block.get("params", {}), "scheduler.params", where, SCHEDULER_PARAMS[kind])
    put, auto = settings.values, settings.auto

    def number(key: str, default=None):
        """The key's value and source; a DeepSpeed default (marked) when absent and not "auto"."""
        if key in params:
            return _number(params[key], f"scheduler.params.{key}", where), f"scheduler.params.{key}"
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
    if _number(params.get("last_batch_iteration", -1), "scheduler.params.last_batch_iteration", where) != -1:
        raise UsageError(f"{where}: scheduler.params.last_batch_iteration is not supported yet; remove it "
                         f"(--load resumes the schedule with the checkpoint)")
    _read_warmup_type(params, where, settings)
    if kind == "WarmupCosineLR":
        _read_cosine_floor(params, where, settings, number)
    else:
        _read_warmup_rates(kind, params, where, settings, number)


def _read_warmup_type(params: dict, where: str, settings: DeepSpeedSettings) -> None:
    kind = params.get("warmup_type", "log")
    if kind not in ("log", "linear"):
        raise UsageError(f"{where}: scheduler.params.warmup_type must be \"log\" or \"linear\", got {as_json(kind)}")
    if kind == "log" and "scheduler.params.warmup_type" not in settings.auto:
        default = "" if "warmup_type" in params else DS_DEFAULT
        settings.notes.append(f"{where}: scheduler.params.warmup_type = \"log\"{default} is not implemented: "
                              f"the warmup here rises linearly from 0")


def _read_warmup_rates(kind: str, params: dict, where: str, settings: DeepSpeedSettings, number) -> None:
    put = settings.values
    if "warmup_max_lr" in params:
        # DeepSpeed's default peak (0.001) would override the optimizer's lr; here an absent
        # warmup_max_lr leaves the peak to optimizer.params.lr or --lr.
        peak, source = number("warmup_max_lr")
        if "lr" in put and put["lr"][0] != peak:
            raise UsageError(f"{where}: {source} = {as_json(peak)} contradicts {put['lr'][1]} = "
                             f"{as_json(put['lr'][0])}; remove one")
        put["lr"] = (float(peak), source)
    floor, source = number("warmup_min_lr", 0.0)
    if floor is not None and floor > 0 and "warmup_min_lr" in params:
        settings.notes.append(f"{where}: scheduler.params.warmup_min_lr = {as_json(floor)} is where the "
                              f"warmup starts in DeepSpeed; here it starts at 0"
                              + (" and the rate decays to it" if kind == "WarmupDecayLR" else ""))
    if floor is not None and kind == "WarmupDecayLR":
        put["min_lr"] = (float(floor), source)


def _read_cosine_floor(params: dict, where: str, settings: DeepSpeedSettings, number) -> None:
    ratio, source = number("cos_min_ratio", 0.0001)
    if ratio is not None:
        settings.values["min_lr_ratio"] = (float(ratio), source)
    start = params.get("warmup_min_ratio", 0)
    if _number(start, "scheduler.params.warmup_min_ratio", where) != 0:
        settings.notes.append(f"{where}: scheduler.params.warmup_min_ratio = {as_json(start)} is where the "
                              f"warmup starts in DeepSpeed; here it starts at 0")


def _read_activation_checkpointing(block, where: str, settings: DeepSpeedSettings) -> None:
    """The block turns recomputation on: each transformer layer keeps its input and recomputes in
    backward (megazero's one way); settings for DeepSpeed's own implementation are noted."""
    if block is None:
        return
    block = _block(block, "activation_checkpointing", where, set(ACTIVATION_KEYS))
    settings.values["recompute_activations"] = (True, "activation_checkpointing")
    for key, value in block.items():
        nothing, why = ACTIVATION_KEYS[key]
        if value is None or value == nothing:
            continue
        name = f"activation_checkpointing.{key}"
        if why is None:
            raise UsageError(f"{where}: {name} = {as_json(value)} is not supported yet (activation offload); "
                             f"remove it or set it to {as_json(nothing)}")
        settings.notes.append(f"{where}: {name} = {as_json(value)} has no effect: {why}")


def _read_monitors(data: dict, where: str, settings: DeepSpeedSettings) -> None:
    """DeepSpeed's wandb and tensorboard monitors onto the monitor flags; csv_monitor is noted."""
    put = settings.values
    for name, keys in MONITOR_KEYS.items():
        block = _block(data.get(name, {}), name, where, keys)
        if not _bool(block.get("enabled", False), f"{name}.enabled", where):
            continue
        if name == "wandb":
            put["wandb_project"] = (str(block.get("project", "deepspeed")), "wandb.project")
            if "team" in block:
                put["wandb_entity"] = (str(block["team"]), "wandb.team")
            if "group" in block:
                settings.notes.append(f"{where}: wandb.group has no effect: runs are not grouped "
                                      f"(--wandb-exp-name names the run)")
        elif name == "tensorboard":
            # DeepSpeed writes under output_path/job_name, with these defaults.
            folder = Path(str(block.get("output_path", ""))) / str(block.get("job_name", "DeepSpeedJobName"))
            put["tensorboard_dir"] = (str(folder), "tensorboard.output_path")
        else:
            settings.notes.append(f"{where}: csv_monitor has no effect: every logged record goes to "
                                  f"metrics.jsonl in the run directory (--metrics-file)")
