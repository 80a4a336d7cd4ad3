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
handed the flag values). The blocks that stand for flags, the settings record and the value readers
live in deepspeed_blocks.py; this module reads the top level, precision, data types and the optimizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from megazero.config.deepspeed_blocks import (
    DeepSpeedSettings,
    as_bool,
    as_number,
    read_activation_checkpointing,
    read_monitors,
    read_scheduler,
)
from megazero.config.muon_flags import DEEPSPEED_PARAMS, read_deepspeed_muon
from megazero.core.errors import UsageError
from megazero.zero.config import as_json, design_notes, parse_zero_config, unknown_key_error

TOP_LEVEL = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "fp16",
    "bf16",
    "zero_optimization",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "data_types",
    "seed",
    "dump_state",
}
FP16_KEYS = {
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
    "auto_cast",
    "consecutive_hysteresis",
}
BF16_KEYS = {"enabled", "bf16_optimizer_states", "bf16_master_weights_and_grads"}
DATA_TYPES_KEYS = {"grad_accum_dtype"}
OPTIMIZER_KEYS = {"type", "params"}
OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction"}
DTYPES = ("fp32", "bf16", "fp16")

# Top-level keys that map onto megazero settings outside the blocks above (read below).
MAPPED_TOP_LEVEL = {"scheduler", "activation_checkpointing", "wandb", "tensorboard", "csv_monitor"}
# DeepSpeed's other top-level keys: features with no megazero equivalent yet -> a hint for the message.
# A value that asks for nothing (false, null, {}, a block with "enabled": false) is accepted.
NOT_SUPPORTED_YET_TOP = {
    "amp": "use --bf16 or --fp16",
    "torch_autocast": "use --bf16 or --fp16",
    "pipeline": "use --pipeline-model-parallel-size and --pipeline-schedule",
    "tensor_parallel": "use --tensor-model-parallel-size",
    "sequence_parallel_size": "",
    "checkpoint": "checkpoints are written with --save and read with --load",
    "flops_profiler": "TFLOP/s per device are logged with every iteration",
    "comms_logger": "",
    "comet": "use --wandb-project or --tensorboard-dir",
    "timers": "wall_clock_breakdown times the phases of each step",
    "memory_breakdown": "every log line carries the memory in use",
    "aio": "it serves NVMe offload, which has not landed",
    "zero_force_ds_cpu_optimizer": "",
    "sparse_attention": "",
    "sparse_gradients": "",
    "autotuning": "",
    "elasticity": "",
    "compression_training": "",
    "data_efficiency": "",
    "curriculum_learning": "",
    "progressive_layer_drop": "",
    "eigenvalue": "",
    "quantize_training": "",
    "weight_quantization": "",
    "graph_harvesting": "",
    "nebula": "",
    "hybrid_engine": "",
    "compile": "",
    "disable_allgather": "",
    "dataloader_drop_last": "",
    "managed_gradient_accumulation": "",
}
# Values beyond false/null/{} that ask for what megazero does anyway.
ASKS_FOR_NOTHING = {
    "managed_gradient_accumulation": True,
    "zero_force_ds_cpu_optimizer": True,
    "sequence_parallel_size": 1,
}
KNOWN_TOP_LEVEL = TOP_LEVEL | MAPPED_TOP_LEVEL | set(NOT_SUPPORTED_YET_TOP)

# The loss is divided by the global batch's token count before backward, so gradients are always
# reduced already divided: DeepSpeed's choice of where to divide has no effect here.
_DIVIDED_BEFORE = (
    "the loss is divided by the global batch's token count before backward, so "
    "gradients are always reduced already divided"
)
# Top-level keys megazero's design fixes: key -> (the value megazero behaves as, or None when every
# value gets the note; why).
TOP_LEVEL_BY_DESIGN = {
    "prescale_gradients": (True, _DIVIDED_BEFORE),
    "gradient_predivide_factor": (None, _DIVIDED_BEFORE),
    "zero_allow_untested_optimizer": (False, "megazero's ZeRO runs only its own Adam/AdamW"),
    # DeepSpeed prints its engine's state once; megazero's first lines give the layout and settings.
    "dump_state": (False, "megazero logs its layout and the settings that differ at start-up"),
}


def load_deepspeed_config(path: str, flag: str = "--zero-config") -> DeepSpeedSettings:
    """The DeepSpeed JSON at `path`, given by `flag` (named, as typed, in its errors)."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{flag} {path}: no such file; give a DeepSpeed JSON config")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(
            f"{flag} {path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{flag} {path}: expected a JSON object")
    return parse_deepspeed_config(data, str(path))


def parse_deepspeed_config(data: dict, where: str = "config") -> DeepSpeedSettings:
    auto: set[str] = set()
    data = drop_auto(data, "", auto)
    zero_where = f"{where}: zero_optimization"
    # A bare zero_optimization block is recognised by its "stage" key.
    if "zero_optimization" not in data and "stage" in data:
        return DeepSpeedSettings(
            zero=parse_zero_config(data, zero_where), notes=design_notes(data, zero_where), auto=auto
        )
    for key in data:
        if key in NOT_SUPPORTED_YET_TOP:
            _check_asks_for_nothing(key, data[key], where)
        elif key not in TOP_LEVEL | MAPPED_TOP_LEVEL:
            raise unknown_key_error(key, KNOWN_TOP_LEVEL, where)
    block = data.get("zero_optimization", {})
    settings = DeepSpeedSettings(
        zero=parse_zero_config(block, zero_where), notes=design_notes(block, zero_where), auto=auto
    )
    put = settings.values
    for key, name in (
        ("train_micro_batch_size_per_gpu", "micro_batch_size"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
        ("train_batch_size", "global_batch_size"),
        ("gradient_clipping", "clip_grad"),
        ("steps_per_print", "log_interval"),
        ("seed", "seed"),
    ):
        if key in data:
            put[name] = (as_number(data[key], key, where), key)
    if "wall_clock_breakdown" in data:
        put["wall_clock_breakdown"] = (
            as_bool(data["wall_clock_breakdown"], "wall_clock_breakdown", where),
            "wall_clock_breakdown",
        )
    for key, (fixed, why) in TOP_LEVEL_BY_DESIGN.items():
        if key in data:
            check = as_bool if isinstance(fixed, bool) else as_number
            value = check(data[key], key, where)
            if fixed is None or value != fixed:
                settings.notes.append(f"{where}: {key} = {as_json(value)} has no effect: {why}")
    _read_dtypes(data, where, put)
    _read_precision(data, where, settings)
    _read_optimizer(data.get("optimizer"), where, settings)
    read_scheduler(data.get("scheduler"), where, settings)
    read_activation_checkpointing(data.get("activation_checkpointing"), where, settings)
    read_monitors(data, where, settings)
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
    nothing = (
        value in (None, False, {})
        or value == ASKS_FOR_NOTHING.get(key, None)
        or (isinstance(value, dict) and value.get("enabled") is False)
    )
    if not nothing:
        hint = NOT_SUPPORTED_YET_TOP[key]
        raise UsageError(
            f"{where}: {key} is not supported yet (megazero has no equivalent of DeepSpeed's "
            f'{key}); remove it or set "enabled": false' + (f"; {hint}" if hint else "")
        )


def _dtype(value, key: str, where: str) -> str:
    name = value.lower() if isinstance(value, str) else value
    if name not in DTYPES:
        raise UsageError(
            f"{where}: {key} = {as_json(value)} is not a data type here; use "
            f"{', '.join(map(repr, DTYPES))} (or null for the default, fp32)"
        )
    return name


def _read_dtypes(data: dict, where: str, put: dict) -> None:
    """DeepSpeed's `communication_data_type` and `data_types.grad_accum_dtype`; null is the default."""
    if data.get("communication_data_type") is not None:
        put["reduce_dtype"] = (
            _dtype(data["communication_data_type"], "communication_data_type", where),
            "communication_data_type",
        )
    types = data.get("data_types", {})
    if not isinstance(types, dict):
        raise UsageError(f'{where}: data_types must be an object like {{"grad_accum_dtype": "fp32"}}')
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
            raise UsageError(f'{where}: {name} must be an object like {{"enabled": true}}')
    for key in fp16:
        if key not in FP16_KEYS:
            raise unknown_key_error(key, FP16_KEYS, f"{where}: fp16")
    for key in bf16:
        if key not in BF16_KEYS:
            raise unknown_key_error(key, BF16_KEYS, f"{where}: bf16")
    _read_bf16_states(bf16, where, put)
    # Both blocks' "enabled" are recorded, false included, so that a flag they contradict is reported.
    for block, name in ((fp16, "fp16"), (bf16, "bf16")):
        if "enabled" in block:
            put[name] = (as_bool(block["enabled"], f"{name}.enabled", where), f"{name}.enabled")
    if put.get("fp16", (False,))[0] and put.get("bf16", (False,))[0]:
        raise UsageError(f"{where}: fp16 and bf16 are both enabled; enable one")
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        if key in fp16:
            put[key] = (as_number(fp16[key], f"fp16.{key}", where), f"fp16.{key}")
    if "consecutive_hysteresis" in fp16:
        key = "fp16.consecutive_hysteresis"
        put["consecutive_hysteresis"] = (as_bool(fp16["consecutive_hysteresis"], key, where), key)
    if as_bool(fp16.get("auto_cast", False), "fp16.auto_cast", where):
        settings.notes.append(
            f"{where}: fp16.auto_cast = true has no effect: the model's inputs are "
            f"token ids and it computes in its parameter dtype"
        )


def _read_bf16_states(bf16: dict, where: str, put: dict) -> None:
    """bf16_optimizer_states: Adam's moments in bf16 (megazero's --exp-avg-dtype / --exp-avg-sq-dtype
    bf16). DeepSpeed pairs it with bf16_master_weights_and_grads (bf16 master weights), which is not
    supported yet: megazero keeps fp32 master weights, and takes bf16_optimizer_states alone."""
    key = "bf16.bf16_master_weights_and_grads"
    if as_bool(bf16.get("bf16_master_weights_and_grads", False), key, where):
        raise UsageError(
            f"{where}: {key} is not supported yet (megazero keeps fp32 master weights); remove "
            f"it (bf16.bf16_optimizer_states works without it here)"
        )
    key = "bf16.bf16_optimizer_states"
    if as_bool(bf16.get("bf16_optimizer_states", False), key, where):
        put["exp_avg_dtype"] = put["exp_avg_sq_dtype"] = ("bf16", key)


def _read_optimizer(block, where: str, settings: DeepSpeedSettings) -> None:
    if block is None:
        return
    if not isinstance(block, dict):
        raise UsageError(f'{where}: optimizer must be an object like {{"type": "AdamW", "params": {{}}}}')
    for key in block:
        if key not in OPTIMIZER_KEYS:
            raise unknown_key_error(key, OPTIMIZER_KEYS, f"{where}: optimizer")
    kind = str(block.get("type", "")).lower()
    if kind not in ("adam", "adamw", "muon"):
        raise UsageError(f"{where}: optimizer type {block.get('type')!r} is not supported; use Adam, AdamW or Muon")
    params, put = block.get("params", {}), settings.values
    if not isinstance(params, dict):
        raise UsageError(f'{where}: optimizer.params must be an object like {{"lr": 0.001}}')
    known = OPTIMIZER_PARAMS | (DEEPSPEED_PARAMS if kind == "muon" else set())
    for key in params:
        if key not in known:
            raise unknown_key_error(key, known, f"{where}: optimizer.params")
    if kind == "muon":  # the Adam keys below serve the parameters Muon leaves to AdamW
        read_deepspeed_muon(params, where, put, settings.notes)
    w_mode = as_bool(params.get("adam_w_mode", True), "optimizer.params.adam_w_mode", where)
    if kind == "adamw" and not w_mode:
        raise UsageError(
            f"{where}: optimizer type AdamW always decouples weight decay, but "
            f"optimizer.params.adam_w_mode = false; use type Adam for L2 weight decay"
        )
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
    put["decoupled_weight_decay"] = (w_mode, "optimizer.type")
    if not as_bool(params.get("bias_correction", True), "optimizer.params.bias_correction", where):
        raise UsageError(
            f"{where}: optimizer.params.bias_correction = false is not supported (Adam "
            f"without bias correction is a different algorithm); remove it or set it to true"
        )
    if as_bool(params.get("torch_adam", False), "optimizer.params.torch_adam", where):
        settings.notes.append(
            f"{where}: optimizer.params.torch_adam = true has no effect: megazero "
            f"steps with its own Adam kernel (the math of torch.optim.Adam/AdamW)"
        )
    for key, name in (("lr", "lr"), ("eps", "adam_eps"), ("weight_decay", "weight_decay")):
        if key in params:
            put[name] = (float(as_number(params[key], f"optimizer.params.{key}", where)), f"optimizer.params.{key}")
    if "betas" in params:
        betas = params["betas"]
        if not (isinstance(betas, list) and len(betas) == 2):
            raise UsageError(f"{where}: optimizer.params.betas must be a list of two numbers")
        put["adam_beta1"] = (float(as_number(betas[0], "optimizer.params.betas", where)), "optimizer.params.betas")
        put["adam_beta2"] = (float(as_number(betas[1], "optimizer.params.betas", where)), "optimizer.params.betas")
