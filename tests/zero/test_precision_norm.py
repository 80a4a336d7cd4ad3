"""The gradient norm's sum of squares: one foreach norm per storage (megazero.zero.precision
.sum_of_squares_many) against the slice-by-slice dot products the engine used before.

- On tensors: fp32 norms of the CPU's 64K-element slices are within 2e-6 of the exact sum, closer
  than the old fp32 dots on 1M slices (~3e-6); bf16 tensors are normed in fp32 (within 5e-6).
  Planted: 1M-element slices on the CPU (2.4e-5 off) and bf16 norms (6e-4 off) each fail. On
  model-sized tensors the two agree to 1e-6. Uncounted tensors add nothing when finite and make
  the sum non-finite when not (the norm doubles as the overflow check).
- In the engine, over layouts where the per-parameter 0/1 weights and the reductions of the squared
  norm matter (TP 2: replicated norms counted on one TP rank; PP 2 with the tied embedding on two
  stages; MiCS shards of 2 with replicas; stage 3), every storage's sum of squares at every step
  equals the old one to 1e-6 (both computed in one run). Planted: counting the uncounted runs (drop
  `* 0.0`) fails TP 2.
- A step takes one foreach norm call per storage, whatever the number of slices (the old path
  took three kernels per 1M elements).
"""

import pytest
import torch

from tests.layouts import layout_worker, run_training, small_config
from megazero.parallel.process_groups import ProcessGroups
from megazero.zero.precision import sum_of_squares, sum_of_squares_many
from megazero.zero.storage import PartitionedStorage


def _exact(tensors) -> float:
    return sum(float((t.double() ** 2).sum()) for t in tensors)


def test_fp32_norms_of_short_slices_are_closer_to_the_exact_sum_than_the_old_dots():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) * s for n, s in ((3_000_001, 1e-3), (17, 1.0), (1 << 20, 5.0))]
    exact = _exact(tensors)
    new = float(sum_of_squares_many(tensors, device="cpu"))
    old = float(sum(sum_of_squares(t) for t in tensors))
    assert abs(new - exact) <= 2e-6 * exact
    assert abs(new - exact) < abs(old - exact) <= 1e-5 * exact  # the old path's own error on 1M slices
    bf16 = [t.bfloat16() for t in tensors]
    assert abs(float(sum_of_squares_many(bf16, device="cpu")) - _exact(bf16)) <= 5e-6 * _exact(bf16)


def test_model_sized_tensors_agree_with_the_old_sum_within_1e6():
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=gen) for n in (1, 7, 1000, 4099, 30000)]
    old = float(sum(sum_of_squares(t, slice_elems=1000) for t in tensors))
    new = float(sum_of_squares_many(tensors, device="cpu", slice_elems=1000))
    assert abs(new - old) <= 1e-6 * old


def test_uncounted_tensors_add_nothing_unless_non_finite():
    counted, uncounted = [torch.full((5,), 2.0)], [torch.full((3,), 7.0)]
    total = sum_of_squares_many(counted, uncounted, device="cpu")
    assert float(total) == pytest.approx(20.0, rel=1e-6)  # the fp32 norm, squared
    for bad in (float("inf"), float("nan")):
        assert not torch.isfinite(sum_of_squares_many(counted, [torch.tensor([1.0, bad])], device="cpu"))
        assert not torch.isfinite(sum_of_squares_many([torch.tensor([bad])], uncounted, device="cpu"))
    empty = sum_of_squares_many([], [], device="cpu")
    assert empty.dtype == torch.float64 and float(empty) == 0.0


def old_grad_sumsq(storage) -> torch.Tensor:
    """The engine's sum of squares before the foreach norm: per norm run, dot by dot."""
    total = torch.zeros((), dtype=torch.float64, device=storage.device)
    for b, lo, hi, counted in storage.norm_runs:
        part = sum_of_squares(storage.grad_chunk(b)[lo:hi])
        total += part if counted else part * 0.0
    return total


LAYOUTS = [
    ("tp2 dp2 stage 2", dict(tp=2, stage=2), 2),
    ("pp2 dp2 stage 1, tied embedding on two stages", dict(pp=2, stage=1, schedule="1f1b"), 2),
    ("dp4 MiCS 2 stage 3", dict(stage=3, mics=2), 4),
    ("dp4 stage 2 bf16", dict(stage=2, bf16=True), 4),
]


def norms_worker(ctx, layouts):
    """Every storage's (new, old) sum of squares at every step of each layout, from one run."""
    current = PartitionedStorage.grad_sumsq
    pairs = []

    def both(storage):
        new = current(storage)
        pairs.append((float(new), float(old_grad_sumsq(storage))))
        return new

    PartitionedStorage.grad_sumsq = both
    try:
        out = []
        for _, kw, dp in layouts:
            pairs.clear()
            result = layout_worker(ctx, small_config(steps=3, **kw), dp)
            out.append(None if result is None else list(pairs))
    finally:
        PartitionedStorage.grad_sumsq = current
    return out


def test_engine_norms_equal_the_old_ones_across_layouts(dist_pool):
    per_rank = dist_pool(4).run(norms_worker, LAYOUTS)
    for k, (name, _, _) in enumerate(LAYOUTS):
        ran = [result[k] for result in per_rank if result[k] is not None]
        assert ran and all(ran), f"{name}: no norm was computed"
        for pairs in ran:
            for new, old in pairs:
                assert abs(new - old) <= 1e-6 * abs(old), f"{name}: {new} vs {old}"


@pytest.mark.parametrize("stage", [1, 3])
def test_one_foreach_norm_call_per_storage(monkeypatch, stage):
    calls = []
    foreach_norm = torch._foreach_norm

    def counting(tensors, *args, **kw):
        calls.append(len(tensors))
        return foreach_norm(tensors, *args, **kw)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    from megazero.training import setup

    cfg = small_config(stage=stage, steps=2)
    result = run_training(cfg, ProcessGroups.single())
    storages = len(setup(small_config(stage=stage), ProcessGroups.single()).engine.storages())
    assert len(calls) == 2 * storages and all(result["norms"])
    assert sum(calls) > len(calls) or stage == 1  # stage 3: many units' runs, still one call
