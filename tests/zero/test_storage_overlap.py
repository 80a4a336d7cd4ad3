"""Gradient reductions overlapped with backward (overlap_comm, on by default at every stage) train bit
for bit as the waiting ones (overlap_comm false): the same collectives on the same buffers, only
issued as buckets fill and waited where the step reads them.

- Stages 0, 1 (fp32: reduce-scatter in place; bf16 weights with an fp32 buffer reduced in bf16:
  staged wire copies) and 2 (fp32 and bf16), DP 2 with gradient accumulation and DP 4 with MiCS
  shards of 2: losses, gradient norms and final parameters are equal, bitwise.
- The overlapped queue holds the stage-1 buckets in flight until the step (the compute stream did
  not wait on each push); the waiting one never holds any. Planted: `push` waiting every time
  whatever `overlap` says fails that check.
- The stream sanitizer runs these layouts too (tests/core/test_stream_check.py's grid).
"""

import torch

from tests.layouts import layout_worker, small_config
from megazero.zero.config import ZeroConfig
from megazero.zero.storage import ReductionQueue

LAYOUTS = [
    ("stage 0 dp 2", dict(stage=0), 2),
    ("stage 1 dp 2", dict(stage=1), 2),
    ("stage 1 dp 2 bf16, reduce in bf16", dict(stage=1, bf16=True, reduce="bf16"), 2),
    ("stage 2 dp 2", dict(stage=2), 2),
    ("stage 2 dp 4 MiCS 2 bf16", dict(stage=2, mics=2, bf16=True), 4),
    ("stage 1 dp 4 MiCS 2", dict(stage=1, mics=2), 4),
]


def test_overlap_is_the_default_at_every_stage():
    assert all(ZeroConfig(stage=s).overlap for s in range(4))
    assert not ZeroConfig(stage=2, overlap_comm=False).overlap


def _config(overlap: bool, stage: int, bf16=False, reduce="fp32", mics=-1):
    cfg = small_config(stage=stage, steps=3, global_batch=8, bf16=bf16, mics=mics, zero_extra={"overlap_comm": overlap})
    cfg.precision.reduce_dtype = reduce
    return cfg


def overlap_worker(ctx, layouts):
    held = []
    push = ReductionQueue.push

    def recording_push(queue, handle, staging=None):
        push(queue, handle, staging)
        held.append((queue.overlap, len(queue._items)))

    ReductionQueue.push = recording_push
    try:
        out = []
        for _, kw, dp in layouts:
            runs = [layout_worker(ctx, _config(overlap, **kw), dp) for overlap in (True, False)]
            out.append(None if runs[0] is None else runs)
    finally:
        ReductionQueue.push = push
    return out, held


def test_overlapped_reductions_train_bitwise_as_the_waiting_ones(dist_pool):
    per_rank = dist_pool(4).run(overlap_worker, LAYOUTS)
    for k, (name, _, _) in enumerate(LAYOUTS):
        for results, _ in per_rank:
            if results[k] is None:
                continue
            overlapped, waiting = results[k]
            assert overlapped["losses"] == waiting["losses"], f"{name}: losses differ"
            assert overlapped["norms"] == waiting["norms"], f"{name}: gradient norms differ"
            for pname, (value, _) in waiting["params"].items():
                assert torch.equal(overlapped["params"][pname][0], value), f"{name}: {pname} differs"
    held = per_rank[0][1]
    assert max(n for overlap, n in held if overlap) > 2, "the overlapped queue never held buckets in flight"
    assert all(n == 0 for overlap, n in held if not overlap), "the waiting queue kept a reduction in flight"
