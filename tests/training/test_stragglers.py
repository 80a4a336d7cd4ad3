"""--straggler-threshold: at each log line the rank whose forward + backward + step time over the
interval is over the median by more than the threshold is named, in the log line and in the logged
record of metrics.jsonl. Two gloo ranks train a small GPT; one of them sleeps in every forward
(0.4 s, many times its work even when a loaded machine slows that work tenfold: with two ranks the
median is their mean, so the slowed rank is named only when it takes over 3x the other's time): it
is named, with its phases; an unslowed run names nobody. The pick itself is checked on times written by hand.
Planted: comparing each rank's compute with the median of the comm waits (the wrong field) fails
the hand-written cases, the TP case and the unslowed run (a rank named); leaving the watch out of
the forward's timers names nobody in the slowed runs."""

import io
import time

import pytest

from megazero.config.flags import parse_args
from megazero.config.train_flags import config_from_args
from megazero.core.errors import UsageError
from megazero.training.stragglers import describe, find_stragglers
from tests.metrics_reading import metrics_records

SLEEP_S = 0.4  # per forward, on the slowed rank: 0.05 s was hidden once at load 22 (work ~80 ms)
STEPS, INTERVAL = 10, 5


def _times(compute, waits=None):
    waits = waits or [0.0] * len(compute)
    return [
        {"rank": r, "forward": c / 2, "backward": c / 4, "step": c / 4, "comm_wait": w, "compute": c}
        for r, (c, w) in enumerate(zip(compute, waits))
    ]


def test_the_slowest_rank_over_the_median_is_named():
    # median of 1.0, 1.1, 1.9 is 1.1: 1.9 / 1.1 = 1.73 is over 1.2, 1.1 is not
    found = find_stragglers(_times([1.0, 1.1, 1.9], waits=[0.9, 0.8, 0.0]), 0.2, 10)
    assert found["rank"] == 2 and found["ranks"] == [2]
    assert found["ratio"] == pytest.approx(1.9 / 1.1) and found["median_seconds"] == pytest.approx(1.1)
    assert (found["forward"], found["backward"], found["comm_wait"]) == (0.95, 0.475, 0.0)
    assert find_stragglers(_times([1.0, 1.1, 1.3], waits=[0.3, 0.2, 0.0]), 0.2, 10) is None  # 1.18x
    two = find_stragglers(_times([1.0, 1.0, 1.0, 2.0, 3.0]), 0.5, 10)
    assert (two["rank"], two["ranks"]) == (4, [3, 4])
    line = describe(two)
    assert line.startswith(
        " straggler: rank 4 took 3.00 s in the last 10 iterations, 3.0x the median 1.00 s "
        "(forward 1.50 s, backward 0.75 s, step 0.75 s, comm wait 0.00 s)"
    ), line
    assert line.endswith("also over the threshold: ranks 3")


def _train(ctx, tp: int, pp: int, slow_rank: int | None):
    from megazero import training
    from megazero.training.metrics import MetricsLogger
    from megazero.parallel.topology import Topology
    from tests.layouts import setup_training, small_config, with_padded_vocab

    cfg = with_padded_vocab(small_config(tp=tp, pp=pp, steps=STEPS, global_batch=4, micro=2, layers=2))
    cfg.log_interval, cfg.run.straggler_threshold = INTERVAL, 0.5
    groups = ctx.groups(Topology(world_size=2, tp=tp, pp=pp))
    state, source = setup_training(cfg, groups)
    if groups.rank == slow_rank:
        for chunk in state.chunks:
            forward = chunk.forward

            def slowed(*args, _forward=forward, **kwargs):
                time.sleep(SLEEP_S)
                return _forward(*args, **kwargs)

            chunk.forward = slowed
    out = io.StringIO()
    path = ctx.tmp / f"metrics-{tp}-{pp}-{slow_rank}.jsonl"
    metrics = MetricsLogger(str(path), enabled=groups.rank == 0, stream=out, total_iters=STEPS)
    training.train(state, source, None, lambda it, _samples: 1e-3, metrics)
    if groups.rank != 0:
        return None
    return out.getvalue(), metrics_records(path)


@pytest.mark.parametrize("tp,pp,slow_rank", [(1, 1, 1), (2, 1, 0), (1, 2, 1)])
def test_a_slowed_rank_is_named(dist_pool, tmp_path, tp, pp, slow_rank):
    """Over DP (rank 1 slowed), over TP (rank 0, the logging rank itself, slowed) and over PP (the
    last stage slowed: the first stage waits for it in the pipeline's receives, outside its phases)."""
    text, records = _run(dist_pool, tmp_path, tp, pp, slow_rank)
    named = [r for r in records if "straggler" in r]
    assert [r["iteration"] for r in named] == [5, 10], text
    for r in named:
        s = r["straggler"]
        assert s["rank"] == slow_rank and s["ratio"] > 1.5, s
        # the first interval drops the run's first step (warm-up); every step sleeps once per microbatch
        assert s["iterations"] == (INTERVAL - 1 if r["iteration"] == INTERVAL else INTERVAL), s
        assert s["forward"] >= s["iterations"] * SLEEP_S and s["forward"] > s["backward"] + s["step"], s
    lines = [line for line in text.splitlines() if line.startswith(" straggler:")]
    assert len(lines) == 2 and all(f"straggler: rank {slow_rank} took " in line for line in lines), text
    assert "in the last 4 iterations" in lines[0] and "in the last 5 iterations" in lines[1] and "comm wait" in lines[0]


def test_an_unslowed_run_names_nobody(dist_pool, tmp_path):
    text, records = _run(dist_pool, tmp_path, 1, 1, None)
    assert [r["iteration"] for r in records] == [1, 5, 10]
    assert not any("straggler" in r for r in records) and "straggler" not in text, text


def _run(dist_pool, tmp_path, tp, pp, slow_rank):
    pool = dist_pool(2)
    results = pool.run(_with_tmp, tmp_path, tp, pp, slow_rank)
    return results[0]


def _with_tmp(ctx, tmp_path, tp, pp, slow_rank):
    ctx.tmp = tmp_path
    return _train(ctx, tp, pp, slow_rank)


@pytest.mark.parametrize("value", ["-0.1", "nan", "inf"])
def test_bad_straggler_threshold_is_one_line(value):
    with pytest.raises(UsageError, match=f"--straggler-threshold must be a fraction >= 0 .*got {value}"):
        config_from_args(parse_args(["--straggler-threshold", value]), world_size=2)


def test_straggler_threshold_default_and_off():
    assert config_from_args(parse_args([]), world_size=2).run.straggler_threshold == 0.2
    assert config_from_args(parse_args(["--straggler-threshold", "0"]), world_size=2).run.straggler_threshold == 0
