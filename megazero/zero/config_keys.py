"""The tables of DeepSpeed `zero_optimization` keys that set no ZeroConfig field of their own (which
megazero.zero.config reads them by): features that have not landed, with their do-nothing values;
DeepSpeed's older offload spellings; keys whose choice megazero's design fixes, with why; and the
fields that act only at some stages. Data only: the parse, its checks and its notes are config.py's.
"""

from __future__ import annotations

import sys

# Keys DeepSpeed accepts whose features have not landed here; each maps to its do-nothing value.
NOT_SUPPORTED_YET = {
    "zero_quantized_nontrainable_weights": False,
    "zeropp_loco_param": None,
}
# Why, where a reason helps the user more than the key's name does.
NOT_SUPPORTED_WHY: dict[str, str] = {}

# DeepSpeed's older spellings of the offload blocks: key -> (what it maps to, its value when on).
LEGACY_OFFLOAD_KEYS = {
    "cpu_offload": "offload_optimizer",
    "cpu_offload_param": "offload_param",
    "cpu_offload_use_pin_memory": "pin_memory",
}

# Keys about saving or loading models and checkpoints, which megazero cannot do yet (--save and
# --load are rejected too); each maps to the value that asks for nothing.
SAVING_NOT_SUPPORTED_YET = {"pipeline_loading_checkpoint": False}
_SIXTEEN_BIT_SAVE = (
    False,
    "megazero saves sharded checkpoints (--save); tools/convert_checkpoint.py "
    "consolidate writes the full model as one file",
)

_ONE_AT_A_TIME = (
    "parameters are initialised one at a time on the host and each rank keeps only its "
    "piece; no device ever holds a whole parameter it does not own"
)

# DeepSpeed keys that choose between implementations where megazero has a single one. Each maps to
# (the value megazero always behaves as, why); any other value is accepted with a note saying so.
FIXED_BY_DESIGN = {
    "contiguous_gradients": (True, "gradients always go into contiguous buckets here"),
    "elastic_checkpoint": (True, "megazero checkpoints always load at any other layout"),
    "gather_16bit_weights_on_model_save": _SIXTEEN_BIT_SAVE,
    "stage3_gather_16bit_weights_on_model_save": _SIXTEEN_BIT_SAVE,
    "stage3_gather_fp16_weights_on_model_save": _SIXTEEN_BIT_SAVE,
    "load_from_fp32_weights": (True, "checkpoints always restore the fp32 master weights"),
    "allgather_partitions": (
        True,
        "updated partitions are always all-gathered, never broadcast one by one (same result)",
    ),
    "use_multi_rank_bucket_allreduce": (
        True,
        "with reduce_scatter false each bucket is all-reduced whole (same result)",
    ),
    "legacy_stage1": (False, "there is one stage-1 implementation (same partitioned optimizer states)"),
    "round_robin_gradients": (
        False,
        "gradients are laid out in parameter order (round robin only "
        "changes which rank copies which gradients to the host)",
    ),
    "ignore_unused_parameters": (True, "unused parameters are always accepted; their gradient is zero"),
    "memory_efficient_linear": (
        False,
        "torch's linear is never patched; stage 3 releases gathered weights through its own hooks",
    ),
    "override_module_apply": (False, "Module.apply is never patched"),
    "log_trace_cache_warnings": (False, "there are no trace-cache warnings to log"),
    "enable_sanity_checks": (False, "there are no optional sanity checks"),
    "use_all_reduce_for_fetch_params": (False, "parameters are always fetched with all-gather"),
    "stage3_use_all_reduce_for_fetch_params": (False, "parameters are always fetched with all-gather"),
    "module_granularity_threshold": (0, "stage 3 gathers per module, never coalescing leaf modules"),
    "stage3_module_granularity_threshold": (0, "stage 3 gathers per module, never coalescing leaf modules"),
    "model_persistence_threshold": (
        sys.maxsize,
        "every parameter under param_persistence_threshold persists; there is no bound on their total",
    ),
    "stage3_model_persistence_threshold": (
        sys.maxsize,
        "every parameter under param_persistence_threshold persists; there is no bound on their total",
    ),
    "allgather_sequential": (False, "parameter all-gathers are never serialised"),
    "stage3_allgather_sequential": (False, "parameter all-gathers are never serialised"),
    "partition_stream_chunk_size": (0, _ONE_AT_A_TIME),
    "stage3_partition_stream_chunk_size": (0, _ONE_AT_A_TIME),
    "save_muon_momentum_buffer_in_memory": (
        False,
        "Muon's momentum lives in the slot of Adam's first moment "
        "and moves with the other optimizer states (to NVMe too)",
    ),
}

# ZeroConfig fields that act only at some stages: field -> those stages.
STAGE_SCOPED = {
    "reduce_scatter": (1, 2, 3),
    "allgather_bucket_size": (1, 2, 3),
    "prefetch_bucket_size": (3,),
    "param_persistence_threshold": (3,),
    "max_live_parameters": (3,),
    "max_reuse_distance": (3,),
    "keep_params_gathered_across_microbatches": (3,),
    "parameter_alignment": (1, 2),
    "adaptive_prefetch_bucket_size": (3,),
    "adaptive_prefetch_min_size": (3,),
    "adaptive_prefetch_max_size": (3,),
}
