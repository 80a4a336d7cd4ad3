"""Stage 3's adaptive prefetch budget (`stage3_adaptive_prefetch_bucket_size`, the min/max sizes):
the rule of megazero/zero/stage3/adaptive_prefetch.py on measured waits, the shard group's
agreement, and training with it on.

- The budget starts at prefetch_bucket_size clamped to [min, max] and capped by max_live_parameters,
  grows by 1.25 when the compute waited more than 10% of a measured pass, shrinks by 0.9 below 2%,
  stays in between, only every 10th pass, and never leaves its bounds.
- Two ranks measuring different waits move to the same budget (the largest ratio wins); a rank with
  no measurement makes both skip the update.
- Training with it on gives the run without it, bit for bit (prefetching changes when weights are
  gathered, never what they are), on every rank the same budget.

Planted: agreeing on the mean instead of the largest ratio fails the two-rank test; skipping the
agreement (each rank its own ratio) fails it too, as the ranks' budgets differ.
"""

import contextlib
import types

import pytest
import torch

from tests.layouts import setup_training, small_config
from megazero.core import comm
from megazero.parallel.topology import Topology
from megazero.zero.config import ZeroConfig
from megazero.zero.stage3.adaptive_prefetch import ADAPT_EVERY, AdaptivePrefetch


def _alone():
    return comm.Group("solo", (0,), 0, None, True, comm.CommLog(), torch.device("cpu"))


def _adaptive(group=None, **zero):
    config = ZeroConfig(stage=3, adaptive_prefetch_bucket_size=True, **zero)
    return AdaptivePrefetch(config, group or _alone(), "cpu")


@contextlib.contextmanager
def _manual_clock():
    """The CPU timing events read this clock, which only `_passes` moves: sleeping instead made a
    6 ms wait in a 100 ms pass look like more than 10% on a loaded machine."""
    from megazero.core import streams

    now = [0.0]
    real, streams.time = streams.time, types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        yield now
    finally:
        streams.time = real


def _passes(adaptive, waited_fraction, count=ADAPT_EVERY, traced=True, length=0.1):
    """`count` passes; the measured ones wait `waited_fraction` of `length` seconds (none at all for 0)."""
    with _manual_clock() as now:
        for _ in range(count):
            adaptive.begin_pass(traced)
            if adaptive.sampling:
                wait = length * waited_fraction
                if wait:
                    started = adaptive.before_wait()
                    now[0] += wait
                    adaptive.after_wait(started)
                now[0] += length - wait
            adaptive.end_pass()


def test_the_budget_follows_the_waits_within_its_bounds():
    assert _adaptive(prefetch_bucket_size=0).budget == int(1e7)  # clamped up to the min
    assert _adaptive(prefetch_bucket_size=int(1e9)).budget == int(5e8)  # and down to the max
    assert _adaptive(max_live_parameters=100).budget == 100  # never above live params
    adaptive = _adaptive()
    _passes(adaptive, 0.5, count=ADAPT_EVERY - 1)
    assert adaptive.budget == int(5e7)  # only every 10th pass
    _passes(adaptive, 0.5, count=1)
    assert adaptive.budget == int(5e7 * 1.25) and adaptive.ratios[-1] == pytest.approx(0.5)
    _passes(adaptive, 0.0)
    assert adaptive.budget == int(int(5e7 * 1.25) * 0.9)
    _passes(adaptive, 0.06)  # between: stays
    assert adaptive.budget == int(int(5e7 * 1.25) * 0.9)
    _passes(adaptive, 0.0, traced=False)  # nothing measured
    assert adaptive.budget == int(int(5e7 * 1.25) * 0.9)
    small = _adaptive(prefetch_bucket_size=0, adaptive_prefetch_min_size=0, adaptive_prefetch_max_size=3)
    for _ in range(5):
        _passes(small, 0.6)
    assert small.budget == 3  # grows from 0, to the max


def agreement_worker(ctx):
    group = ctx.groups(Topology(world_size=2)).dp
    budgets = []
    adaptive = _adaptive(group)
    _passes(adaptive, 0.0 if ctx.rank == 0 else 0.16)  # rank 1 stalls: both grow
    budgets.append(adaptive.budget)
    _passes(adaptive, 0.6, traced=ctx.rank == 0)  # rank 1 measured nothing
    budgets.append(adaptive.budget)
    return budgets


def test_the_shard_group_agrees_on_the_largest_wait(dist_pool):
    grown = int(5e7 * 1.25)
    assert dist_pool(2).run(agreement_worker) == [[grown, grown], [grown, grown]]


def budget_worker(ctx, configs):
    """Trains each config on 2 ranks: losses, grad norms, and the adaptive budget and ratios."""
    from megazero.training import train_step

    groups = ctx.groups(Topology(world_size=2))
    out = []
    for cfg in configs:
        state, source = setup_training(cfg, groups)
        steps = [train_step(state, source.batch(it), 1e-3) for it in range(cfg.train_iters)]
        adaptive = state.engine.gather.adaptive
        out.append(
            {
                "losses": [s.loss for s in steps],
                "norms": [s.grad_norm for s in steps],
                "budget": adaptive and adaptive.budget,
                "ratios": adaptive and adaptive.ratios,
            }
        )
    return out


def test_training_with_an_adaptive_budget_is_the_same_run(dist_pool):
    tiny = {
        "prefetch_bucket_size": 64,
        "adaptive_prefetch_min_size": 8,
        "adaptive_prefetch_max_size": 5000,
        "max_reuse_distance": 0,
    }
    configs = [
        small_config(stage=3, steps=ADAPT_EVERY + 2, layers=2, global_batch=4, zero_extra=extra)
        for extra in (tiny, {**tiny, "adaptive_prefetch_bucket_size": True})
    ]
    (plain0, adaptive0), (_, adaptive1) = dist_pool(2).run(budget_worker, configs)
    assert plain0["losses"] == adaptive0["losses"] and plain0["norms"] == adaptive0["norms"]
    assert adaptive0["budget"] == adaptive1["budget"] and 8 <= adaptive0["budget"] <= 5000
    assert len(adaptive0["ratios"]) == 1 and adaptive0["ratios"] == adaptive1["ratios"]
