"""Partial optimizer offload (`offload_optimizer.ratio`, stage 3): the last `ratio` of each
partition's sub-groups have their states in host memory (or swap files) and step on the CPU, the
first keep theirs on the device and step there. fp32 runs of ratio 0.5 and 0.25 on 2 and 4 ranks
follow the run without offload (rtol 1e-5); the memory report's device part is (1 - ratio) of the
partition, the host part the rest; the planner shows the same split.

Planted: stepping the resident part without writing its weights back (`param_copy` dropped) fails
the curve; offloading the first `ratio` of the sub-groups instead of the last (DeepSpeed's order)
fails the bytes.
"""

import pytest

from tests.layouts import (
    assemble_params,
    assert_close,
    assert_params_match,
    setup_training,
    small_config,
    with_padded_vocab,
)

STEPS = 4


def train(ctx, cfg, dp):
    """Trains cfg on the first dp ranks: (loss curve, full parameters, memory report, the unit
    store's partition size, where the states are)."""
    from megazero.training.lr_schedule import learning_rate
    from megazero.parallel.topology import Topology
    from megazero.training import train_step
    from megazero.zero.state_access import safe_get_full_fp32_param

    groups = ctx.groups(Topology(world_size=dp))
    if groups is None:
        return None
    state, source = setup_training(cfg, groups)
    curve = [
        train_step(state, source.batch(it), learning_rate(cfg.optimizer, it + 1, STEPS)).loss for it in range(STEPS)
    ]
    params = {n: (safe_get_full_fp32_param(p), None) for n, p in state.chunks[0].named_parameters()}
    return {
        "coords": tuple(groups.coords),
        "curve": curve,
        "params": params,
        "memory": state.engine.memory.report(),
        "partition": state.engine.unit_storage.partition_size,
        "where": state.engine.memory.locations(),
    }


def ratio_worker(ctx, dp, ratios, nvme_dir):
    """The plain stage-3 run, then one per ratio with sub-groups a quarter of the unit partition."""
    plain = train(ctx, small_config(stage=3, steps=STEPS, layers=2), dp)
    if plain is None:
        return None
    quarter = plain["partition"] // 4
    runs = {}
    for ratio, device in ratios:
        block = {"device": device, "ratio": ratio}
        if device == "nvme":
            block.update(nvme_path=nvme_dir, pipeline_read=True)
        extra = {"offload_optimizer": block, "sub_group_size": quarter}
        runs[(ratio, device)] = train(ctx, small_config(stage=3, steps=STEPS, layers=2, zero_extra=extra), dp)
    return plain, runs


@pytest.mark.parametrize("dp", [2, 4])
def test_partial_offload_follows_the_device_run_and_reports_the_split(dist_pool, tmp_path, dp):
    ratios = [(0.5, "cpu"), (0.25, "cpu")] + ([(0.5, "nvme")] if dp == 2 else [])
    results = [r for r in dist_pool(4).run(ratio_worker, dp, ratios, str(tmp_path / "swap")) if r is not None]
    plain = results[0][0]
    assert plain["partition"] % 4 == 0  # quarters: sub-groups of equal size
    for key in ratios:
        ratio, device = key
        name = f"dp {dp} ratio {ratio} {device}"
        got = [runs[key] for _, runs in results]
        assert_close(got[0]["curve"], plain["curve"], name)
        assert_params_match(assemble_params(got), assemble_params([r for r, _ in results]), name)
        tier = "host" if device == "cpu" else "nvme"
        for rank, r in enumerate(got):
            memory, partition = r["memory"], r["partition"]
            assert partition == plain["partition"], name
            # The unit store's device part: exactly (1 - ratio) of its partition (12 bytes per element:
            # fp32 master and two moments); the persistent parameters' small groups are one
            # sub-group each, wholly offloaded by DeepSpeed's rule.
            resident = int((1 - ratio) * partition)
            assert memory["master"] == 4 * resident and memory["optimizer_states"] == 8 * resident, name
            offloaded = memory[f"{tier}_master"]
            assert offloaded >= 4 * (partition - resident) and memory[f"{tier}_optimizer_states"] == 2 * offloaded
            assert r["where"]["master"] != device or device == "cpu", name
            assert r["where"][f"{tier}_master"] == device, name


def test_the_planner_splits_the_states_as_the_engine_does():
    from megazero.config.memory_estimate import plan_bytes

    full = with_padded_vocab(
        small_config(
            stage=3,
            layers=2,
            zero_extra={
                "offload_optimizer": {"device": "cpu"},
                "sub_group_size": 1000,
                "param_persistence_threshold": 0,
            },
        )
    )
    half = with_padded_vocab(
        small_config(
            stage=3,
            layers=2,
            zero_extra={
                "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                "sub_group_size": 1000,
                "param_persistence_threshold": 0,
            },
        )
    )
    a, b = plan_bytes(full, 2), plan_bytes(half, 2)
    assert a["master"] == a["optimizer_states"] == 0 and a["host_master"] > 0
    assert b["master"] + b["host_master"] == pytest.approx(a["host_master"])
    assert b["master"] == pytest.approx(a["host_master"] / 2, rel=0.1)
    assert b["optimizer_states"] == 2 * b["master"] and b["host_optimizer_states"] == 2 * b["host_master"]
