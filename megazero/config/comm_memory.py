"""The memory planner's communication and transient buffers of one rank (memory_estimate's
"comm_buffers" category); memory_estimate.plan_bytes adds them to the model states and activations.

Communication and transient buffers ("comm_buffers": what the peak holds beside model states and
activations), from the buffers the engine makes: stage 3's gathered (live) weights, this stage's
whole unpartitioned shard while max_reuse_distance and max_live_parameters allow keeping them
(DeepSpeed's defaults, for models of this size), otherwise about the largest module plus one
prefetch bucket; plus the largest of the step's phases. Backward: stage 3 stages two gradient
buckets (a unit's) in the reduction dtype, stage 2 the bucket filling beside the reductions its queue
still holds (config/staging_memory.py: the previous microbatch's whole-stage bucket, under a
pipeline or gradient accumulation), and autograd hands each parameter's gradient over as a tensor of
its own (the largest one counts), beside the activations. Reduction: the staged buckets plus, on
gloo, a copy of the reduce-scatter's input (and stage 1's chunk temporary; stage 2: a copy per
reduction in flight, and the reduced chunk of each after the step's first), beside the activations
of the other microbatches a pipeline holds; stage 0/1 reduce the full gradient buffer in place.
Weight gather after a stage 1/2 step: gloo's copy of an allgather_bucket_size bucket. Set-up: one parameter's full fp32 initial value and its slice.
(bench/plan_memory_table.py compares the planned total with the processes' measured peak.)
"""

from __future__ import annotations

import math

from megazero.config.activation_memory import cp_transient_bytes, output_layer_bytes
from megazero.config.moe_memory import moe_transient_bytes
from megazero.config.parameter_counts import largest_module_params, largest_param
from megazero.config.staging_memory import stage2_staging_bytes
from megazero.config.train_config import TrainConfig


def comm_buffer_bytes(cfg: TrainConfig, r, activations: float) -> float:
    """What the rank's peak holds beside its model states and activations (see the module notes):
    stage 3's gathered weights, plus the largest of: the backward's buffers (gradient staging and
    one parameter's fresh gradient, beside the activations), the reduction's (after a microbatch's
    backward: only the other microbatches' activations are left) or the weight gather's (after the
    step), and set-up's (one parameter's full fp32 initial value and its tensor-parallel slice).
    `r`: the memory_estimate.RankLayout of the largest stage."""
    z, par = cfg.zero, cfg.parallel
    reduce_bytes = 2 if cfg.precision.reduce_dtype != "fp32" else 4
    bucket = min(z.reduce_bucket_size, r.rank_parameters)
    if z.stage == 3:  # a unit's gradients are one bucket
        bucket = min(bucket, math.ceil(largest_module_params(cfg.model) / par.tensor_parallel))
    # Stage 0/1 reduce the full gradient buffer where it lies (a temporary only to change dtype);
    # stage 3 stages a unit's bucket while the previous one is reduced.
    in_place = z.stage <= 1 and reduce_bytes == r.grad_bytes
    staging = 0 if in_place else min(2 * bucket, r.rank_parameters) * reduce_bytes
    fresh_grad = largest_param(cfg.model, par.tensor_parallel) * r.weight_bytes
    live = 0
    if z.stage == 3:
        if z.max_reuse_distance >= r.rank_parameters and z.max_live_parameters >= r.rank_parameters:
            live = r.rank_parameters - r.persistent_parameters
        else:
            largest = math.ceil(largest_module_params(cfg.model) / par.tensor_parallel)
            live = min(r.rank_parameters, largest + z.prefetch_bucket_size)
    # gloo runs a reduce-scatter on a copy of its input and an all-gather into a copy of its output
    # (NCCL works in place); stage 1's in-place reduce-scatter also goes through a chunk temporary.
    reduction, gather = staging, 0
    if par.distributed_backend == "gloo" and z.stage > 0 and r.shards > 1:
        reduction += bucket * reduce_bytes * (1 + (1 / r.shards if z.stage == 1 else 0))
        if z.stage in (1, 2):
            gather = min(z.allgather_bucket_size, r.rank_parameters) * r.weight_bytes
    if z.stage == 3:  # reduced after every microbatch, while a pipeline holds the others'
        reduction += activations * (r.in_flight - 1) / r.in_flight
    elif z.stage == 2:  # the reductions the queue holds, whole-stage buckets of earlier microbatches
        staging, reduction = stage2_staging_bytes(cfg, r, reduce_bytes, activations)  # included
    initial = largest_param(cfg.model, 1) * 4 * (1 + 1 / par.tensor_parallel)
    head = output_layer_bytes(
        cfg.model.seq_length * cfg.micro_batch_size // par.context_parallel,
        cfg.model,
        par.tensor_parallel,
        r.weight_bytes,
        r.in_flight,
    )
    # a MoE layer's dispatch buffers run in the backward while the staged buckets fill: the larger counts
    moe = moe_transient_bytes(cfg, r.weight_bytes, head)
    peak = max(activations + max(staging, moe) + fresh_grad + cp_transient_bytes(cfg), reduction, gather, initial)
    return float(live * r.weight_bytes + peak - activations)
