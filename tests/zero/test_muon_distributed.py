"""Muon under ZeRO 1-3, tensor, pipeline and expert parallelism and an offloaded optimizer (half in host
memory; swapped to nvme files) reproduces the single-process Muon run (fp32 Newton-Schulz, split QKV,
quintic coefficients, Nesterov) over 10 steps: loss curve, gradient norms and final parameters at
rtol 1e-5 (tests/layouts.py's bars).

Each layout also reports which parameters Muon steps and how often: the same names as the one
process (DeepSpeed's first bug: Muon silently off for a zero.Init-built model, whose stage-3
parameters report an empty shape) and exactly one Muon step per optimizer step whatever the
gradient accumulation (its second: once per microbatch). And the all-to-alls Muon adds, measured
by the comm log on every rank, equal the count docs/zero.md gives from the owners' plan.

Kills (planted, one at a time): Newton-Schulz on the owner's partition only (the other ranks' pieces
zeroed) and each TP rank orthogonalising its own shard (both: zero 1 tp 2 dp 2's loss curve); the
matrices chosen from `param.shape` instead of the storage's shape (DeepSpeed's zero.Init bug: zero 3
tp 2 dp 2's loss curve, 4.2e-2 relative at step 9).
"""

from __future__ import annotations

import pytest

from megazero.ops.muon_config import MuonConfig
from megazero.parallel.process_groups import ProcessGroups
from tests.layouts import (
    VOCAB,
    assemble_params,
    assert_matches_reference,
    layout_worker,
    per_layout,
    run_training,
    small_config,
    strip_padding,
)
from tests.parallel.test_expert_parallel import MOE, check

MUON = MuonConfig(momentum=0.9, nesterov=True, matmul_precision="high")  # fp32: layout-invariant
DENSE = dict(layers=2, lr=1e-2)
SMALL_MOE = dict(layers=2, lr=1e-2, global_batch=8, model_extra=MOE)


def with_muon(cfg):
    cfg.optimizer.muon = MUON
    return cfg


def expected_all_to_all_bytes(engine) -> dict[str, int]:
    """What this rank sends in Muon's all-to-alls per step, by group name, from the plan (the count
    docs/zero.md gives): to the shard owner, the pieces of the matrices others own, and back, the
    pieces of the ones it owns that others hold; over TP, its tensor of a split matrix owned by
    another TP rank, and back, the other TP ranks' tensors of the ones it owns."""
    out: dict[str, int] = {}
    for part in engine.muon.parts:
        me, shard = part.me, part.storage.shard
        sent = sum(e.lengths[me] for e in part.entries if e.owner != me)
        sent += sum(sum(e.lengths) - e.lengths[me] for e in part.mine)
        if sent:
            out[shard.name] = out.get(shard.name, 0) + 4 * sent
        if part.tensor is not None:
            size = 1
            for e in part.mine:
                if e.owner_tp is None:
                    continue
                size = 1
                for n in e.local_shape:
                    size *= n
                out[part.tensor.name] = out.get(part.tensor.name, 0) + 4 * size * (
                    (e.owner_tp != part.tp_rank) + (part.tensor.size - 1) * (e.owner_tp == part.tp_rank)
                )
    return out


def observer(seen: dict):
    """An on_setup that records into `seen` Muon's parameter names, its step count and the expected
    all-to-all bytes."""

    def on_setup(state):
        engine = state.engine
        seen["names"] = sorted(engine.names[i] for i in engine.muon.params)
        seen["expected"] = expected_all_to_all_bytes(engine)
        seen["steps"], step = 0, engine.muon.step

        def counted(lr, coef):
            seen["steps"] += 1
            return step(lr, coef)

        engine.muon.step = counted

    return on_setup


def muon_worker(ctx, layouts):
    """Each (config, dp): run_training's result plus what `observer` saw (None off the layout)."""
    out = []
    for cfg, dp in layouts:
        seen = {}
        result = layout_worker(ctx, cfg, dp, observer(seen))
        out.append(None if result is None else {**result, **seen})
    return out


def reference_of(config):
    seen = {}
    result = run_training(with_muon(small_config(**config)), ProcessGroups.single(), observer(seen))
    return {**result, **seen}, strip_padding(assemble_params([result]), VOCAB)


# (what, dp, config) on 4 ranks
DENSE_LAYOUTS = [
    ("zero 1 tp 2 dp 2", 2, dict(stage=1, tp=2)),
    ("zero 2 tp 2 dp 2", 2, dict(stage=2, tp=2)),
    ("zero 3 tp 2 dp 2", 2, dict(stage=3, tp=2)),
    ("zero 3 dp 4", 4, dict(stage=3)),
    ("zero 1 pp 2 tp 2", 1, dict(stage=1, pp=2, tp=2)),
    # the optimizer half on the device, half in host memory (a piece may cross the split)
    (
        "zero 3 dp 4 half offloaded",
        4,
        dict(stage=3, zero_extra={"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "sub_group_size": 300}),
    ),
    ("zero 3 tp 2 nvme", 2, dict(stage=3, tp=2, zero_extra={"sub_group_size": 300})),  # + the swap folder
]
MOE_LAYOUTS = [
    ("ep 2 zero 1 dp 4", 4, dict(ep=2, stage=1)),
    ("ep 2 tp 2 zero 3", 2, dict(ep=2, tp=2, stage=3)),
]


def check_bookkeeping(results, reference, what, dense: bool):
    ref = reference[0]
    for r in results:
        if r is None:
            continue
        steps = len(ref["losses"])
        assert r["steps"] == steps, f"{what}: Muon stepped {r['steps']} times in {steps} steps"
        if not dense:  # the expert dispatch's all-to-alls share the key
            continue
        muon_traffic = {g: b for (op, g, _), b in r["comm"].items() if op == "all_to_allv"}
        assert muon_traffic == r["expected"], f"{what}: Muon's all-to-alls {muon_traffic} vs planned {r['expected']}"
    names = sorted({n for r in results if r is not None for n in r["names"]})
    assert names == ref["names"], f"{what}: Muon steps {names}, the one process {ref['names']}"


@pytest.fixture(scope="module")
def references():
    return {key: reference_of(config) for key, config in (("dense", DENSE), ("moe", SMALL_MOE))}


def with_swap_folder(what: str, config: dict, folder) -> dict:
    """An nvme layout's config with its swap folder under `folder`; other layouts as they are."""
    if "nvme" not in what:
        return config
    extra = dict(config["zero_extra"], offload_optimizer={"device": "nvme", "nvme_path": str(folder)})
    return dict(config, zero_extra=extra)


def test_distributed_muon_matches_single_process(dist_pool, references, tmp_path):
    layouts = [
        (with_muon(small_config(**DENSE, **with_swap_folder(what, config, tmp_path))), dp)
        for what, dp, config in DENSE_LAYOUTS
    ]
    layouts += [(with_muon(small_config(**SMALL_MOE, **config)), dp) for _, dp, config in MOE_LAYOUTS]
    results = per_layout(dist_pool(4).run(muon_worker, layouts))
    for (what, dp, config), result in zip(DENSE_LAYOUTS, results):
        assert_matches_reference(result, references["dense"], what)
        check_bookkeeping(result, references["dense"], what, dense=True)
    for (what, dp, config), result in zip(MOE_LAYOUTS, results[len(DENSE_LAYOUTS) :]):
        check(result, references["moe"], what)
        check_bookkeeping(result, references["moe"], what, dense=False)
