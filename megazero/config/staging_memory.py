"""ZeRO stage 2's gradient reductions in flight, as megazero runs them: the planner's staging term.

A stage-2 group (zero/flat_group.py) copies each gradient into a staging bucket (storage.py
`new_staging`: the whole bucket, reduce_bucket_size elements, or the rank's whole stage when that
is smaller) and, once the bucket is full, issues its reduction and pushes it on the ReductionQueue
(storage.py), which keeps it, and its buffers, until it is waited: with overlap_comm the queue waits
the oldest only past MAX_STAGED_IN_FLIGHT staged reductions or, with more than one, past
reduce_bucket_size staged elements; without overlap_comm at once. Stage 2 reduces after every
microbatch and the queue is waited in full only before the step, so under gradient accumulation or a
pipeline the previous microbatch's bucket is still held while the next one fills. Each reduction
holds its staging bucket (in the reduce dtype); on gloo also the copy of it that torch's gloo
reduce-scatters (the work keeps it until the handle drops it, after the wait; NCCL reduces the input
itself); and this rank's reduced chunk (bucket / shards), except for the step's first reduction of a
bucket when the reduce and accumulation dtypes agree, which lands in the gradient partition itself.
"""

from __future__ import annotations

import math

from megazero.zero.storage import ReductionQueue


def bucket_sizes(rank_parameters: int, bucket_size: int) -> list[int]:
    """One microbatch's staging buckets in the order they fill: zero/flat.py cuts full buckets from
    the last parameter back (the backward's order), the remainder last (parameters taken as small)."""
    if rank_parameters <= 0:
        return []
    full, rest = divmod(rank_parameters, bucket_size)
    return [bucket_size] * full + ([rest] if rest else [])


def queue_held(sizes: list[int], max_staged: int, overlap: bool) -> list[list[int]]:
    """For each staged reduction of `sizes` (elements, in issue order): the indices of the earlier
    ones the ReductionQueue still holds when it is issued (its push policy, replayed)."""
    held: list[int] = []
    out = []
    for i in range(len(sizes)):
        out.append(list(held))
        held.append(i)
        if not overlap:
            held = []
        while len(held) > ReductionQueue.MAX_STAGED_IN_FLIGHT or (
            len(held) > 1 and sum(sizes[j] for j in held) > max_staged
        ):
            held.pop(0)
    return out


def stage2_staging_bytes(cfg, r, reduce_bytes: int, activations: float) -> tuple[float, float]:
    """(backward, reduction) for ZeRO stage 2 on rank layout `r`: the most staged bytes beside a
    backward's activations (the reductions the queue holds and the bucket filling), and the most at a
    reduction's issue (those held, the new one with its copy and chunk, and the activations of the
    microbatches still in flight: `activations` holds r.in_flight of them)."""
    z = cfg.zero
    scatter = r.shards > 1 and z.reduce_scatter  # else an all-reduce in place (or nothing)
    gloo_copy = scatter and cfg.parallel.distributed_backend == "gloo"
    # a fresh chunk reduces straight into the gradient partition when the dtypes agree
    direct = cfg.precision.reduce_dtype == cfg.precision.grad_accum_dtype
    per_step = bucket_sizes(r.rank_parameters, z.reduce_bucket_size)
    sizes = per_step * r.microbatches
    issued = [
        (
            size * (2 if gloo_copy else 1)
            + (math.ceil(size / r.shards) if scatter and not (i < len(per_step) and direct) else 0)
        )
        * reduce_bytes
        for i, size in enumerate(sizes)
    ]
    per_microbatch = activations / max(r.in_flight, 1)
    backward = reduction = 0.0
    for i, held in enumerate(queue_held(sizes, z.reduce_bucket_size, z.overlap)):
        k = i // len(per_step)  # the microbatch
        others = per_microbatch * min(r.in_flight - 1, r.microbatches - 1 - k)
        kept = sum(issued[j] for j in held)
        backward = max(backward, kept + sizes[i] * reduce_bytes)
        reduction = max(reduction, kept + issued[i] + others)
    return backward, reduction
