"""ZeRO configuration: DeepSpeed's `zero_optimization` block, with its key names, aliases and defaults.

Owns parsing and validation of the ZeRO keys only (the whole-DeepSpeed-config reader lives in
megazero.ds_config). Unknown keys fail with the nearest valid key; keys of features that have not
landed yet fail as "not supported yet" unless they hold their do-nothing default.
"""
from __future__ import annotations

import difflib
import sys
from typing import Any, Optional

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from megazero.errors import UsageError

# Keys DeepSpeed accepts whose features have not landed here; each maps to its do-nothing value.
NOT_SUPPORTED_YET = {
    "offload_param": None, "offload_optimizer": None, "cpu_offload": None, "cpu_offload_param": None,
    "cpu_offload_use_pin_memory": None, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False,
    "zeropp_loco_param": None, "mics_hierarchical_params_gather": False, "zenflow": None,
}

# DeepSpeed keys that only tune DeepSpeed's own implementation choices; accepted and ignored
# because our implementation has a single behaviour for them (named so that nothing is silent).
ACCEPTED_NO_EFFECT = {
    "use_multi_rank_bucket_allreduce", "allgather_partitions", "elastic_checkpoint",
    "legacy_stage1", "round_robin_gradients", "sub_group_size", "memory_efficient_linear",
    "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
    "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
    "module_granularity_threshold", "stage3_module_granularity_threshold", "load_from_fp32_weights",
    "ignore_unused_parameters", "pipeline_loading_checkpoint", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "allgather_sequential", "stage3_allgather_sequential",
}


class ZeroConfig(BaseModel):
    """The ZeRO optimizer's settings; names and defaults follow DeepSpeed's `zero_optimization`."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    stage: int = Field(0, ge=0, le=3)
    """0: plain data parallel; 1: optimizer states; 2: + gradients; 3: + parameters partitioned."""
    contiguous_gradients: bool = True
    """Stage 2/3: gradients are copied into contiguous buckets as they are produced."""
    reduce_scatter: bool = True
    """Stages 1/2: reduce gradients with reduce-scatter; False all-reduces each bucket and keeps this
    rank's chunk (twice the bytes, but faster where a backend's reduce-scatter is slow, e.g. gloo)."""
    reduce_bucket_size: int = Field(int(5e8), gt=0)
    """Elements per gradient reduce-scatter (all-reduce at stage 0)."""
    allgather_bucket_size: int = Field(int(5e8), gt=0)
    """Stages 1/2: elements per all-gather of updated parameters after the step."""
    overlap_comm: Optional[bool] = None
    """Overlap gradient reduction with backward; None means True at stage 3, else False."""
    prefetch_bucket_size: int = Field(int(5e7), ge=0, alias="stage3_prefetch_bucket_size")
    """Stage 3: parameter elements fetched ahead of use."""
    param_persistence_threshold: int = Field(int(1e5), ge=0, alias="stage3_param_persistence_threshold")
    """Stage 3: parameters with fewer elements stay unpartitioned during forward/backward."""
    max_live_parameters: int = Field(int(1e9), ge=0, alias="stage3_max_live_parameters")
    """Stage 3: bound on gathered parameter elements held at once (prefetch stops there)."""
    max_reuse_distance: int = Field(int(1e9), ge=0, alias="stage3_max_reuse_distance")
    """Stage 3: keep a gathered parameter if it is used again within this many elements of fetches."""
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    """Stage 3: consolidate 16-bit weights when saving a model."""
    mics_shard_size: int = -1
    """MiCS: partition within blocks of this many DP ranks and replicate across blocks (-1: off)."""
    keep_params_gathered_across_microbatches: bool = False
    """Stage 3 with gradient accumulation or pipelining: gather each parameter once per step and keep
    it until the step ends (memory: the whole stage's parameters, unpartitioned) instead of gathering
    per microbatch (memory: bounded by max_live_parameters; comm: 2 gathers per microbatch)."""

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


def _key_names() -> set[str]:
    names = set()
    for name, field in ZeroConfig.model_fields.items():
        names.add(name)
        if field.alias:
            names.add(field.alias)
    return names | set(NOT_SUPPORTED_YET) | ACCEPTED_NO_EFFECT | {"stage3_gather_fp16_weights_on_model_save"}


def unknown_key_error(key: str, valid: set[str], where: str) -> UsageError:
    near = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys: {', '.join(sorted(valid))}"
    return UsageError(f"unknown key {key!r} in {where}{hint}")


def parse_zero_config(block: dict[str, Any], where: str = "zero_optimization") -> ZeroConfig:
    """Builds a ZeroConfig from a DeepSpeed `zero_optimization` dict (JSON numbers like 5e8 allowed)."""
    if not isinstance(block, dict):
        raise UsageError(f"{where} must be a JSON object, got {type(block).__name__}")
    valid = _key_names()
    values = {}
    for key, value in block.items():
        if key not in valid:
            raise unknown_key_error(key, valid, where)
        if key in NOT_SUPPORTED_YET:
            if value != NOT_SUPPORTED_YET[key] and value not in ({}, None):
                raise UsageError(f"{where}.{key} = {value!r} is not supported yet; remove it or set it "
                                 f"to {NOT_SUPPORTED_YET[key]!r}")
            continue
        if key in ACCEPTED_NO_EFFECT:
            continue
        if key == "stage3_gather_fp16_weights_on_model_save":   # DeepSpeed's deprecated spelling
            key = "gather_16bit_weights_on_model_save"
        values[key] = value
    _check_alias_conflicts(values, where)
    try:
        config = ZeroConfig(**{k: _integral(v) for k, v in values.items()})
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise UsageError(f"{where}.{key}: {first['msg']} (got {first.get('input')!r})") from None
    if config.stage == 0 and config.mics_shard_size not in (-1, 0):
        raise UsageError(f"{where}.mics_shard_size needs ZeRO stage 1-3, got stage 0")
    return config


def _check_alias_conflicts(values: dict, where: str) -> None:
    for name, field in ZeroConfig.model_fields.items():
        if field.alias and name in values and field.alias in values and values[name] != values[field.alias]:
            raise UsageError(f"{where} sets both {name!r}={values[name]!r} and its alias "
                             f"{field.alias!r}={values[field.alias]!r}; keep one")
        if field.alias and name in values and field.alias in values:
            values.pop(field.alias)


def _integral(value):
    """JSON writes big sizes as 5e8 (a float); accept floats that are whole numbers for int keys."""
    if isinstance(value, float) and value.is_integer() and abs(value) < sys.maxsize:
        return int(value)
    return value
