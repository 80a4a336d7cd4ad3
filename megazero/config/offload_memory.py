"""The memory planner's offloaded states of one rank: what offload_optimizer and offload_param move
off the device into host memory or files (OFFLOAD_CATEGORIES, which memory_estimate re-exports), and
the share of the optimizer states stage 3's partial offload keeps on the device.
"""

from __future__ import annotations

import math

from megazero.config.train_config import TrainConfig
from megazero.zero.offload import resident_sub_groups

# Off the device (the engine's memory.report() keys too): offload_param moves stage 3's partitioned
# weights, offload_optimizer the fp32 master and Adam moments (a master of their own even in fp32
# runs) plus host staging for one sub-group's gradients and updated 16-bit weights.
OFFLOAD_CATEGORIES = (
    "host_params",
    "nvme_params",
    "host_master",
    "host_optimizer_states",
    "nvme_master",
    "nvme_optimizer_states",
    "host_offload_buffers",
    "host_activations",
)


def resident_fraction(zero, partition: float) -> float:
    """The fraction of a partition whose optimizer states stay on the device under offload_optimizer:
    none, or with stage 3's partial offload (`ratio`) the first sub-groups DeepSpeed's rule keeps."""
    if not zero.offloads_optimizer or zero.offload_optimizer.ratio == 1.0 or partition <= 0:
        return 0.0
    count = max(1, math.ceil(partition / zero.sub_group_size))
    return min(partition, resident_sub_groups(count, zero.offload_optimizer.ratio) * zero.sub_group_size) / partition


def offloaded_bytes(cfg: TrainConfig, r) -> dict[str, float]:
    """OFFLOAD_CATEGORIES (zero where nothing is offloaded). The optimizer's host staging holds one
    sub-group (at most `sub_group_size` elements) of gradients and, in 16-bit runs, weights; nvme
    adds `buffer_count` sub-groups of the three states (fp32 master, the moments) in host buffers.
    `r`: the memory_estimate.RankLayout of the largest stage."""
    z = cfg.zero
    out = dict.fromkeys(OFFLOAD_CATEGORIES, 0.0)
    partition = r.rank_parameters / r.shards  # optimizer-state elements on this rank
    if z.offloads_optimizer:
        where = "host" if z.offload_optimizer.device == "cpu" else "nvme"
        away = partition * (1 - resident_fraction(z, partition))
        out[f"{where}_master"], out[f"{where}_optimizer_states"] = 4 * away, r.state_bytes * away
        group = min(z.sub_group_size, partition)
        out["host_offload_buffers"] = group * (r.grad_bytes + (r.weight_bytes if r.weight_bytes == 2 else 0))
        if where == "nvme":
            sub_groups = math.ceil(partition / z.sub_group_size)
            out["host_offload_buffers"] += (
                min(z.offload_optimizer.buffer_count, sub_groups) * (4 + r.state_bytes) * group
            )
        if z.zenflow is not None:  # the accumulator(s), the gradients' copy, the CPU Adam's output
            accumulators = 2 if z.zenflow.overlap_step else 1
            out["host_offload_buffers"] += partition * (
                4 * accumulators + r.grad_bytes + (r.weight_bytes if r.weight_bytes == 2 else 0)
            )
    if z.stage == 3 and z.offloads_params:
        moved = (r.rank_parameters - r.persistent_parameters) / r.shards * r.weight_bytes
        out["host_params" if z.offload_param.device == "cpu" else "nvme_params"] = moved
    return out
