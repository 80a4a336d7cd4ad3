"""Expert parallelism (parallel/moe.py) and ZeRO over experts (zero/experts.py) against one process.

A 2-layer GPT whose both layers are mixtures of 4 experts (top-2, aux loss and z-loss on, a shared
expert with its sigmoid gate), 10 steps with accumulation and clipping: each layout's loss curve, gradient norms, aux and
z losses per step, and final parameters (experts gathered from their expert-parallel ranks) match
the single-process run (fp32, rtol 1e-5): ep 2, ep 4, the all-gather dispatcher, ep 2 with ZeRO-1/2/3
(and ZeRO-3 with the optimizer offloaded), ep 2 x tp 2 (sequence parallel), ep 2 x pp 2 (1F1B and
interleaved), ep 2 x cp 2, ep 2 with full recomputation (the dispatch runs again in the
backward; the routing statistics are not counted twice). The 4-rank layouts (the interleaved schedule on a
4-layer model of its own) run in one pool call; tp 2 x pp 2 x
ep 2 ZeRO-3 on 8 ranks. At ep 2 with ZeRO-1/2/3 the memory planner's model-state bytes equal the
engine's report (experts 1/ep per rank, their states over the expert-data-parallel ranks). The
skewed-routing check: every token of one rank goes to one expert (the
others get no rows there), under ZeRO-3 at ep 2; it must finish (no hang) and match one process.
Whole experts (expert tensor-parallel size 1, the EP groups spanning TP ranks): tp 2 x ep 2 with and
without sequence parallelism, tp 2 x ep 4 x dp 2 ZeRO-1 and ZeRO-3 (SP), tp 2 x ep 1 x dp 2 ZeRO-2;
MiCS with experts at ZeRO-3: ep 2 and ep 4 with shard groups of 2, ep 2 x cp 2 x dp 4 with groups of
4 (expert states over 2 edp ranks); the planner's expert counts for each.
"""

from __future__ import annotations

import pytest
import torch

from tests.layouts import (
    assert_close,
    assert_params_match,
    last_stage_result,
    layout_worker,
    per_layout,
    run_layouts,
    single_process_reference,
    small_config,
    strip_padding,
    with_padded_vocab,
    VOCAB,
)
from megazero.config.memory_estimate import plan_bytes, rank_layout
from megazero.parallel.topology import Topology
from megazero.training.moe_stats import moe_layers
from megazero.parallel.moe import ExpertShard

# Mixtral's linears have no biases: with them the attention key bias (a true gradient of zero, which
# Adam turns into noise of the order of lr) differs from the one process's by ~1.7 relative in cp 2
# and sequence-parallel layouts with or without experts, over the per-tensor bound for qkv.bias.
MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_aux_loss_coeff=0.01,
    moe_z_loss_coeff=0.001,
    moe_shared_expert_intermediate_size=16,
    moe_shared_expert_gate=True,
    add_bias_linear=False,
)
SMALL = dict(steps=10, layers=2, global_batch=8, model_extra=MOE)


def assemble(results) -> dict[str, torch.Tensor]:
    """Full parameters: dense ones from dp rank 0's TP pieces, experts from every expert-parallel
    rank of the first expert-data-parallel replica."""
    pieces: dict[str, dict] = {}
    for r in results:
        if r is None:
            continue
        tp, dp, pp = r["coords"]
        for name, (value, shard) in r["params"].items():
            if isinstance(shard, ExpertShard):
                if r["edp_rank"] == 0:
                    pieces.setdefault(name, {})[(shard.ep_rank, tp)] = (value, shard)
            elif dp == 0 and r["cp_rank"] == 0:
                pieces.setdefault(name, {})[(0, tp)] = (value, shard)
    full = {}
    for name, parts in pieces.items():
        value, shard = parts[min(parts)]
        if shard is None:
            full[name] = value
            continue
        inner = shard.tp if isinstance(shard, ExpertShard) else shard
        eps = sorted({e for e, _ in parts})
        per_ep = []
        for e in eps:
            tps = [parts[(e, t)][0] for t in sorted(t for ee, t in parts if ee == e)]
            per_ep.append(inner.full_from_locals(tps) if inner is not None else tps[0])
        full[name] = torch.cat(per_ep) if isinstance(shard, ExpertShard) else per_ep[0]
    return strip_padding(full, VOCAB)


def check(results, reference, what):
    ref, _ = reference
    got = last_stage_result(results)
    assert_close(got["losses"], ref["losses"], f"{what}: loss curve")
    assert_close(got["norms"], ref["norms"], f"{what}: grad norms")
    for key in ("aux", "z"):
        assert_close([m[key] for m in got["moe"]], [m[key] for m in ref["moe"]], f"{what}: {key} loss")
    assert got["moe"][-1]["load"] == ref["moe"][-1]["load"], f"{what}: expert loads"
    ref_params = strip_padding(assemble([ref]), VOCAB)
    assert_params_match(assemble(results), ref_params, what)


@pytest.fixture(scope="module")
def reference():
    return single_process_reference(**SMALL)


# (what, dp, config) on 4 ranks
LAYOUTS_4 = [
    ("ep 2", 2, dict(ep=2)),
    ("ep 4", 4, dict(ep=4)),
    ("ep 2 allgather", 2, dict(ep=2, moe_dispatcher="allgather")),
    ("ep 2 zero 1", 4, dict(ep=2, stage=1)),
    ("ep 2 zero 2", 4, dict(ep=2, stage=2)),
    ("ep 2 zero 3", 4, dict(ep=2, stage=3)),
    (
        "ep 2 zero 3 offloaded optimizer",
        4,
        dict(ep=2, stage=3, zero_extra={"offload_optimizer": {"device": "cpu"}, "sub_group_size": 2000}),
    ),
    ("ep 2 tp 2 sequence parallel", 2, dict(ep=2, tp=2, sequence_parallel=True)),
    ("ep 2 pp 2", 2, dict(ep=2, pp=2, stage=1)),
    ("ep 2 cp 2", 2, dict(ep=2, cp=2)),
    ("ep 2 full recomputation", 2, dict(ep=2)),
]
# the same run with every layer recomputed in the backward (the dispatch collectives run again there)
RECOMPUTE = dict(
    SMALL, model_extra=dict(MOE, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
)
# The interleaved schedule needs layers divisible by pp x virtual stages: a 4-layer model of its own.
INTERLEAVED = dict(SMALL, layers=4)


def test_expert_parallel_layouts_match_single_process(dist_pool, reference):
    layouts = [
        (small_config(**(RECOMPUTE if "recomputation" in what else SMALL), **config), dp)
        for what, dp, config in LAYOUTS_4
    ]
    layouts.append((small_config(**INTERLEAVED, ep=2, pp=2, virtual=2, stage=2), 2))
    results = per_layout(dist_pool(4).run(run_layouts, layouts))
    for (what, dp, config), result in zip(LAYOUTS_4, results):
        check(result, reference, what)
        if what in ("ep 2 zero 1", "ep 2 zero 2", "ep 2 zero 3"):  # the planner's model states, experts over edp
            _check_plan(result, config, dp, what)
    check(results[-1], single_process_reference(**INTERLEAVED), "ep 2 pp 2 interleaved zero 2")


# Whole experts (expert tensor-parallel size 1): the EP groups span the TP ranks
WHOLE_EXPERTS = [
    ("tp 2 ep 2 etp 1", 1, dict(tp=2, ep=2, etp=1)),
    ("tp 2 ep 2 etp 1 sequence parallel", 1, dict(tp=2, ep=2, etp=1, sequence_parallel=True)),
    ("tp 2 ep 4 etp 1 dp 2 zero 1", 2, dict(tp=2, ep=4, etp=1, stage=1)),
    ("tp 2 ep 4 etp 1 dp 2 zero 3 sequence parallel", 2, dict(tp=2, ep=4, etp=1, stage=3, sequence_parallel=True)),
    ("tp 2 ep 1 etp 1 dp 2 zero 2", 2, dict(tp=2, ep=1, etp=1, stage=2)),
]


def test_whole_experts_under_tensor_parallelism_match_single_process(dist_pool, reference):
    layouts = [(small_config(**SMALL, **config), dp) for _, dp, config in WHOLE_EXPERTS]
    for (what, dp, config), result in zip(WHOLE_EXPERTS, per_layout(dist_pool(4).run(run_layouts, layouts))):
        check(result, reference, what)
        _check_plan(result, config, dp, what)


def _check_plan(result, config, dp, what):
    """The planner's model-state bytes equal the engine's report on every rank; under TP (where the
    planner splits the TP-replicated weights too) its expert counts equal the rank's experts and
    their ZeRO partitions."""
    cfg = with_padded_vocab(small_config(**SMALL, **config))
    par = cfg.parallel
    world = par.tensor_parallel * par.context_parallel * par.pipeline_parallel * dp
    if par.tensor_parallel > 1:
        layout = rank_layout(cfg, world)
        topo = Topology(
            world_size=world,
            tp=par.tensor_parallel,
            ep=par.expert_parallel,
            etp=par.expert_tensor_parallel,
            mics_shard_size=cfg.zero.mics_shard_size,
        )
        for r in filter(None, result):
            experts = sum(v.numel() for name, (v, _) in r["params"].items() if ".mlp.experts." in name)
            assert layout.expert_parameters == experts, (what, layout.expert_parameters, experts)
        assert layout.expert_shards == topo.expert_shard_size, (what, layout.expert_shards)
        return
    plan = plan_bytes(cfg, world)
    for kind in ("params", "grads", "master", "optimizer_states"):
        assert all(r["memory"][kind] == round(plan[kind]) for r in result if r is not None), (what, kind, plan[kind])


# MiCS: dense states shard over the MiCS shard group, expert states over the edp ranks inside it
MICS_4 = [
    ("ep 2 zero 3 mics 2 (experts replicated over edp)", 4, dict(ep=2, stage=3, mics=2)),
    ("ep 4 zero 3 mics 2", 4, dict(ep=4, stage=3, mics=2)),
]


def test_mics_with_expert_parallelism_matches_single_process(dist_pool, reference):
    layouts = [(small_config(**SMALL, **config), dp) for _, dp, config in MICS_4]
    for (what, dp, config), result in zip(MICS_4, per_layout(dist_pool(4).run(run_layouts, layouts))):
        check(result, reference, what)
        _check_plan(result, config, dp, what)


def test_tp_pp_ep_zero3_on_8_ranks_matches_single_process(dist_pool, reference):
    """Also on 8 ranks: MiCS shard groups of 4 of the dp x cp ranks at ep 2, so the expert states
    shard over 2 expert-data-parallel ranks and replicate over the other 2."""
    layouts = [
        (small_config(**SMALL, ep=2, tp=2, pp=2, stage=3, sequence_parallel=True), 2),
        (small_config(**SMALL, ep=2, cp=2, stage=3, mics=4), 4),
    ]
    eight, mics = per_layout(dist_pool(8).run(run_layouts, layouts))
    check(eight, reference, "tp 2 x pp 2 x ep 2 zero 3")
    check(mics, reference, "ep 2 x cp 2 x dp 4 zero 3 mics 4")
    # the expert gradients' shards were summed over the expert replicas, not the dense ones
    assert all(any(kind == "expert_replica" and n > 0 for (_, kind, _), n in r["comm"].items()) for r in mics)


def _skew_first_ep_group(state):
    """Ranks 0 and 1 (one expert-parallel group) send every token to expert 3 (both top-2 choices):
    rank 0's experts (0 and 1) get no rows at all, while its expert-data-parallel peer, rank 2,
    routes as usual and its copies of those experts get rows."""
    if state.groups.rank not in (0, 1):
        return

    for _, layer in moe_layers(state.chunks):

        def skewed_top_k(logits, top_k=layer.router.top_k):
            probs, indices = top_k(logits)
            return probs, torch.full_like(indices, 3)

        layer.router.top_k = skewed_top_k


def _skewed(ctx, stages):
    return [
        layout_worker(ctx, small_config(**{**SMALL, "steps": 4}, ep=2, stage=stage), 4, on_setup=_skew_first_ep_group)
        for stage in stages
    ]


def test_skewed_routing_zero3_finishes_and_matches_zero0(dist_pool):
    """ZeRO-3 gathers and reduces every expert unit on every rank whatever the routing: with one
    expert-parallel group's tokens all on one expert it finishes (the pool's timeout would catch a hang) and trains as
    ZeRO-0 does with the same routing (no gathers, one all-reduce per bucket)."""
    zero3, zero0 = per_layout(dist_pool(4).run(_skewed, [3, 0], timeout=300))
    # ranks 0 and 1: one microbatch of 2 samples x 16 tokens x 2 choices each, all on expert 3
    assert zero3[0]["moe"][0]["load"][0][0] >= 128
    for a, b in zip(zero3, zero0):
        assert_close(a["losses"], b["losses"], "skewed zero 3 vs zero 0: losses")
        assert_close(a["norms"], b["norms"], "skewed zero 3 vs zero 0: grad norms")
    assert_params_match(assemble(zero3), assemble(zero0), "skewed zero 3 vs zero 0")
