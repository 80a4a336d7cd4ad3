"""ZeRO configuration: DeepSpeed's `zero_optimization` block, with its key names, aliases and defaults.

Owns parsing and validation of the ZeRO keys only (the whole-DeepSpeed-config reader lives in
megazero.config.deepspeed_json). No key is silently ignored: each one either sets a ZeroConfig field, or is
accepted with a note where megazero's design fixes its behaviour, or fails (unknown keys with the
nearest valid key; keys of features that have not landed as "not supported yet" unless they hold
their do-nothing value; the tables of such keys are config_keys.py's). Notes are returned as data;
the driver logs them once.
"""

from __future__ import annotations

import difflib
import json
import sys
from typing import Any, Literal, Optional

import pydantic
from pydantic import ConfigDict, Field

from megazero.core.errors import UsageError
from megazero.core.records import Record
from .config_blocks import (  # noqa: F401
    LeafModuleConfig,
    OffloadConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZenFlowConfig,
)
from .config_keys import (
    FIXED_BY_DESIGN,
    LEGACY_OFFLOAD_KEYS,
    NOT_SUPPORTED_WHY,
    NOT_SUPPORTED_YET,
    SAVING_NOT_SUPPORTED_YET,
    STAGE_SCOPED,
)

DType = Literal["fp32", "bf16", "fp16"]
StateDType = Literal["fp32", "bf16"]


class PrecisionConfig(Record):
    """The precision settings of a run: the flags --bf16/--fp16 and their fp16 loss scaling, DeepSpeed's
    fp16 / bf16 / data_types / communication_data_type keys. The engine makes its Precision (the
    dtypes) and its LossScaler from it."""

    bf16: bool = False
    fp16: bool = False
    loss_scale: float = 0.0  # fp16: 0 means dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False
    """fp16 dynamic scaling: refill the hysteresis on every step without overflow, not only when the
    scale grows (DeepSpeed's fp16.consecutive_hysteresis)."""
    grad_accum_dtype: DType = "fp32"
    """dtype the gradients accumulate in across microbatches (DeepSpeed's data_types.grad_accum_dtype).
    A 16-bit value equals the parameter dtype (checked at the edge); fp32 with 16-bit parameters means
    separate fp32 gradient buffers."""
    reduce_dtype: DType = "fp32"
    """dtype gradients are reduced in across data-parallel ranks (DeepSpeed's communication_data_type,
    Megatron's --grad-reduce-in-bf16). A 16-bit value equals the parameter dtype."""
    gradient_accumulation_fusion: bool = True
    """16-bit weights with fp32 accumulation: the layers sum each weight gradient in fp32 for the fp32
    buffers instead of autograd rounding it to 16 bits first (Megatron-LM's gradient-accumulation
    fusion; --no-gradient-accumulation-fusion turns it off). Not inside --compile'd layers."""
    exp_avg_dtype: StateDType = "fp32"
    """dtype Adam's first moment is stored in (Megatron-LM's --exp-avg-dtype with
    --use-precision-aware-optimizer; DeepSpeed's bf16.bf16_optimizer_states). The step computes in
    fp32 and stores it rounded to nearest even."""
    exp_avg_sq_dtype: StateDType = "fp32"
    """dtype Adam's second moment is stored in (--exp-avg-sq-dtype), as exp_avg_dtype."""


class ZeroConfig(Record):
    """The ZeRO optimizer's settings; names and defaults follow DeepSpeed's `zero_optimization`."""

    model_config = ConfigDict(populate_by_name=True)

    stage: int = Field(0, ge=0, le=3)
    """0: plain data parallel; 1: optimizer states; 2: + gradients; 3: + parameters partitioned."""
    reduce_scatter: bool = True
    """Stages 1-3: reduce gradients with reduce-scatter; False all-reduces each bucket and keeps this
    rank's chunk (twice the bytes, but faster where a backend's reduce-scatter is slow, e.g. gloo).
    Stage 0 always all-reduces."""
    reduce_bucket_size: int = Field(int(5e8), gt=0)
    """Elements per gradient reduce-scatter (all-reduce at stage 0)."""
    allgather_bucket_size: int = Field(int(5e8), gt=0)
    """Stages 1-3: elements per all-gather of updated parameters after the step (at stage 3, of the
    persistent parameters)."""
    overlap_comm: Optional[bool] = None
    """Overlap gradient reduction with backward; None means True at every stage. (DeepSpeed's
    None means stage 3 only: its stage 1/2 overlap holds extra bucket buffers. Ours reduces stage
    0/1 buckets in place and keeps at most two staged stage-2 buckets in flight, so overlapping
    costs at most one bucket of memory.) False issues stage 0/1 reductions when backward is done
    and waits for every bucket on the compute stream as it is issued."""
    prefetch_bucket_size: int = Field(int(5e7), ge=0, alias="stage3_prefetch_bucket_size")
    """Stage 3: parameter elements fetched ahead of use."""
    param_persistence_threshold: int = Field(int(1e5), ge=0, alias="stage3_param_persistence_threshold")
    """Stage 3: parameters with fewer elements stay unpartitioned during forward/backward."""
    max_live_parameters: int = Field(int(1e9), ge=0, alias="stage3_max_live_parameters")
    """Stage 3: bound on gathered parameter elements held at once (prefetch stops there)."""
    max_reuse_distance: int = Field(int(1e9), ge=0, alias="stage3_max_reuse_distance")
    """Stage 3: keep a gathered parameter if it is used again within this many elements of fetches."""
    mics_shard_size: int = -1
    """MiCS: partition within blocks of this many DP ranks and replicate across blocks (-1: off)."""
    keep_params_gathered_across_microbatches: bool = False
    """Stage 3 with gradient accumulation or pipelining: gather each parameter once per step and keep
    it until the step ends (memory: the whole stage's parameters, unpartitioned) instead of gathering
    per microbatch (memory: bounded by max_live_parameters; comm: 2 gathers per microbatch)."""

    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    """Stages 1-3: optimizer states in host memory or on disk, stepped on the CPU (ZeRO-Offload)."""
    offload_param: Optional[OffloadParamConfig] = None
    """Stage 3: parameter partitions in host memory or on disk (ZeRO-Infinity)."""
    sub_group_size: int = Field(int(1e9), gt=0)
    """Elements of optimizer state stepped (and, offloaded to nvme, swapped) at a time."""
    cpu_optimizer_threads: Optional[int] = Field(None, ge=1)
    """megazero's own: threads of the offloaded optimizer's CPU Adam (None: torch's thread count;
    the launch fills it in: --cpu-optimizer-threads, MEGAZERO_CPU_OPTIMIZER_THREADS, else the
    node's cores per local rank, whatever OMP_NUM_THREADS torchrun set for the training)."""
    zero_hpz_partition_size: int = Field(1, ge=1)
    """Stage 3 (hpZ): >1 keeps a secondary copy of each gathered unit partitioned over this many ranks
    of a node, so the backward gather stays inside the node."""
    zero_quantized_weights: bool = False
    """Stage 3 (qwZ): the forward all-gather moves int8 block-quantized weights."""
    zero_quantized_gradients: bool = False
    """Stage 3 (qgZ): gradients are reduced by all-to-all of quantized chunks, node first."""
    mics_hierarchical_params_gather: bool = False
    """Stage 3: an all-gather in a shard group spanning nodes goes inter-node first, then intra-node."""
    stage3_granularity: Literal["module", "layer"] = "module"
    """Stage 3 units: each module's own parameters, or one unit per transformer layer (FSDP-style:
    the leaf_module case classes ["TransformerLayer"])."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Stage 3: modules that are one unit each, gathered whole when entered, never traced inside."""
    adaptive_prefetch_bucket_size: bool = Field(False, alias="stage3_adaptive_prefetch_bucket_size")
    """Stage 3: grow or shrink the prefetch budget between the min and max sizes with the measured
    time the compute waited for gathers (coordinator.py, AdaptivePrefetch)."""
    adaptive_prefetch_min_size: int = Field(int(1e7), ge=0, alias="stage3_adaptive_prefetch_min_size")
    adaptive_prefetch_max_size: int = Field(int(5e8), ge=0, alias="stage3_adaptive_prefetch_max_size")
    zenflow: Optional[ZenFlowConfig] = None
    """With offload_optimizer: important gradient columns updated on the device every step, the
    rest by the CPU Adam every update_interval steps (zero/zenflow/optimizer.py)."""
    compute_grad_norm: bool = True
    """Stages 1-2: DeepSpeed may skip the global norm when nothing reads it; here the norm's
    all-reduce is also the non-finite check of every step, so it is always computed."""
    parameter_alignment: bool = False
    """Stages 1-2: each parameter starts 16-byte aligned in the flat buffers (padding between)."""

    @property
    def overlap(self) -> bool:
        return True if self.overlap_comm is None else self.overlap_comm

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer is not None and self.offload_optimizer.device != "none"

    @property
    def offloads_params(self) -> bool:
        return self.offload_param is not None and self.offload_param.device != "none"


def _key_names() -> set[str]:
    names = set()
    for name, field in ZeroConfig.model_fields.items():
        names.add(name)
        if field.alias:
            names.add(field.alias)
    return (
        names | set(NOT_SUPPORTED_YET) | set(SAVING_NOT_SUPPORTED_YET) | set(FIXED_BY_DESIGN) | set(LEGACY_OFFLOAD_KEYS)
    )


def unknown_key_error(key: str, valid: set[str], where: str) -> UsageError:
    near = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys: {', '.join(sorted(valid))}"
    return UsageError(f"unknown key {key!r} in {where}{hint}")


def as_json(value) -> str:
    """A value spelled as JSON spells it (false, null), for messages about JSON keys."""
    return json.dumps(value)


def parse_zero_config(block: dict[str, Any], where: str = "zero_optimization") -> ZeroConfig:
    """Builds a ZeroConfig from a DeepSpeed `zero_optimization` dict (JSON numbers like 5e8 allowed).
    `where` names the block in errors, e.g. "ds.json: zero_optimization"."""
    if not isinstance(block, dict):
        raise UsageError(f"{where} must be a JSON object, got {type(block).__name__}")
    valid = _key_names()
    values = {}
    for key, value in block.items():
        if key not in valid:
            raise unknown_key_error(key, valid, where)
        if key in NOT_SUPPORTED_YET:
            # An offload block with device "none" (as Trainer configs write it) offloads nothing.
            off = isinstance(value, dict) and value.get("device") == "none"
            if value != NOT_SUPPORTED_YET[key] and value not in ({}, None) and not off:
                why = f" ({NOT_SUPPORTED_WHY[key]})" if key in NOT_SUPPORTED_WHY else ""
                raise UsageError(
                    f"{where}.{key} = {as_json(value)} is not supported yet{why}; remove "
                    f"it or set it to {as_json(NOT_SUPPORTED_YET[key])}"
                )
        elif key in SAVING_NOT_SUPPORTED_YET:
            if value != SAVING_NOT_SUPPORTED_YET[key]:
                raise UsageError(
                    f"{where}.{key} = {as_json(value)} is not supported yet: megazero's "
                    f"checkpoints are sharded (--save), and tools/convert_checkpoint.py "
                    f"consolidate writes the full model; remove it or set it to "
                    f"{as_json(SAVING_NOT_SUPPORTED_YET[key])}"
                )
        elif key in FIXED_BY_DESIGN:
            _check_type(value, FIXED_BY_DESIGN[key][0], f"{where}.{key}")
        else:
            values[key] = value
    _apply_legacy_offload_keys(values, where)
    _check_alias_conflicts(values, where)
    try:
        config = ZeroConfig(**{k: _integral(v) for k, v in values.items()})
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise UsageError(f"{where}.{key}: {message} (got {first.get('input')!r})") from None
    if config.stage == 0 and config.mics_shard_size not in (-1, 0):
        raise UsageError(f"{where}.mics_shard_size needs ZeRO stage 1-3, got stage 0")
    check_stage_features(config, where)
    return config


def check_stage_features(config: ZeroConfig, where: str = "zero_optimization", spelled=None) -> None:
    """Features that act only at some stages are errors elsewhere: asking for offload or ZeRO++ and
    silently getting none would be worse. `spelled` maps a key to how the user wrote it (a flag)."""
    spelled = spelled or {}
    name = lambda key: spelled.get(key, f"{where}.{key}")  # noqa: E731
    if config.offloads_optimizer and config.stage == 0:
        raise UsageError(
            f"{name('offload_optimizer')} needs ZeRO stage 1-3 (there is no partitioned "
            f"optimizer state at stage 0); set the stage to 1-3 or remove it"
        )
    stage3_only = {
        "offload_param": config.offloads_params,
        "zero_hpz_partition_size": config.zero_hpz_partition_size > 1,
        "zero_quantized_weights": config.zero_quantized_weights,
        "zero_quantized_gradients": config.zero_quantized_gradients,
        "mics_hierarchical_params_gather": config.mics_hierarchical_params_gather,
        "stage3_granularity": config.stage3_granularity != "module",
    }
    for key, asked in stage3_only.items():
        if asked and config.stage != 3:
            raise UsageError(
                f"{name(key)} acts on partitioned parameters, which only ZeRO stage 3 "
                f"has; set stage 3 or remove it (got stage {config.stage})"
            )
    if config.leaf_module.customised() and config.stage != 3:
        raise UsageError(
            f"{name('leaf_module')} acts on stage 3's units; set stage 3 or remove it (got stage {config.stage})"
        )
    if not config.compute_grad_norm and config.stage not in (1, 2):
        raise UsageError(
            f"{name('compute_grad_norm')} = false is supported only at ZeRO stage 1 or 2 "
            f"(as in DeepSpeed); remove it (got stage {config.stage})"
        )
    if config.adaptive_prefetch_min_size > config.adaptive_prefetch_max_size:
        raise UsageError(
            f"{where}.stage3_adaptive_prefetch_min_size ({config.adaptive_prefetch_min_size}) "
            f"exceeds stage3_adaptive_prefetch_max_size ({config.adaptive_prefetch_max_size}); "
            f"swap them"
        )
    _check_offload(config, where, name)
    for key in ("offload_optimizer", "offload_param"):
        block = getattr(config, key)
        if block is not None and block.device == "nvme" and not block.nvme_path and key in spelled:
            raise UsageError(f"{spelled[key]} needs --zero-nvme-path DIR, the directory for the swap files")
        if block is not None and block.device == "nvme" and not block.nvme_path:
            raise UsageError(
                f'{name(key)}.device "nvme" needs nvme_path, the directory for the '
                f'swap files; add "nvme_path": "/local/disk/dir"'
            )


def _check_offload(config: ZeroConfig, where: str, name) -> None:
    """Partial offload is stage 3's; ZenFlow steps host-memory states, all of them."""
    ratio = config.offload_optimizer.ratio if config.offloads_optimizer else 1.0
    if ratio != 1.0 and config.stage != 3:
        raise UsageError(
            f"{where}.offload_optimizer.ratio = {ratio}: partial offload splits stage 3's "
            f"sub-groups (as DeepSpeed's does) and needs ZeRO stage 3; set ratio 1.0 or "
            f"stage 3 (got stage {config.stage})"
        )
    zenflow = config.zenflow
    if zenflow is None:
        return
    if not config.offloads_optimizer or config.offload_optimizer.device != "cpu":
        raise UsageError(
            f"{where}.zenflow works on optimizer offload to host memory; add "
            f'"offload_optimizer": {{"device": "cpu"}} (or --zero-offload-optimizer cpu)'
        )
    if ratio != 1.0:
        raise UsageError(
            f"{where}.zenflow with offload_optimizer.ratio = {ratio}: ZenFlow takes every "
            f"optimizer state to host memory; set ratio 1.0 or remove zenflow"
        )
    fixed = zenflow.update_interval
    every = zenflow.select_every()
    if fixed != "auto" and 0 < every < fixed:
        raise UsageError(
            f"{where}.zenflow: columns are selected every {every} steps but updated every "
            f"{fixed}; select_interval must be at least update_interval"
        )


def _apply_legacy_offload_keys(values: dict, where: str) -> None:
    """DeepSpeed's old booleans become the offload blocks they stand for (cpu, host memory)."""
    pin = values.pop("cpu_offload_use_pin_memory", None)
    for key in ("cpu_offload", "cpu_offload_param"):
        if key not in values:
            continue
        on = values.pop(key)
        _check_type(on, False, f"{where}.{key}")
        target = LEGACY_OFFLOAD_KEYS[key]
        if on and target in values and values[target] not in (None, {}):
            raise UsageError(f"{where} sets both {key} and {target}; keep {target}")
        if on:
            values[target] = {"device": "cpu", **({"pin_memory": bool(pin)} if pin is not None else {})}


def design_notes(block: dict[str, Any], where: str = "zero_optimization") -> list[str]:
    """Notes for the keys of `block` (already parsed) whose value megazero's design overrides."""
    notes = []
    for key, value in block.items():
        if key in FIXED_BY_DESIGN:
            fixed, why = FIXED_BY_DESIGN[key]
            if _integral(value) != fixed:
                notes.append(f"{where}.{key} = {as_json(value)} has no effect: {why}")
    if block.get("compute_grad_norm") is False:
        notes.append(
            f"{where}.compute_grad_norm = false has no effect: the norm's all-reduce is also "
            f"the step's non-finite check, so the norm is computed anyway"
        )
    offload = block.get("offload_optimizer")
    if isinstance(offload, dict) and offload.get("fast_init"):
        notes.append(
            f"{where}.offload_optimizer.fast_init = true has no effect: the states are written "
            f"to their swap files once, when the engine starts"
        )
    return notes


def stage_notes(config: ZeroConfig, where: str = "zero_optimization") -> list[str]:
    """Notes for settings the user gave that do nothing at the configured stage."""
    notes = []
    for name, stages in STAGE_SCOPED.items():
        if name in config.model_fields_set and config.stage not in stages:
            acts = "stage 3" if stages == (3,) else "stages 1-3"
            key = ZeroConfig.model_fields[name].alias or name  # DeepSpeed's usual spelling
            notes.append(f"{where}.{key} has no effect at ZeRO stage {config.stage}: it acts at {acts} only")
    return notes


def _check_alias_conflicts(values: dict, where: str) -> None:
    for name, field in ZeroConfig.model_fields.items():
        if field.alias and name in values and field.alias in values and values[name] != values[field.alias]:
            raise UsageError(
                f"{where} sets both {name!r}={values[name]!r} and its alias "
                f"{field.alias!r}={values[field.alias]!r}; keep one"
            )
        if field.alias and name in values and field.alias in values:
            values.pop(field.alias)


def _check_type(value, like, name: str) -> None:
    if isinstance(like, bool) and not isinstance(value, bool):
        raise UsageError(f"{name} must be true or false, got {as_json(value)}")
    if not isinstance(like, bool) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise UsageError(f"{name} must be a number, got {as_json(value)}")


def _integral(value):
    """JSON writes big sizes as 5e8 (a float); accept floats that are whole numbers for int keys."""
    if isinstance(value, float) and value.is_integer() and abs(value) < sys.maxsize:
        return int(value)
    return value
