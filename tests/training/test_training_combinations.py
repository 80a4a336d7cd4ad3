"""Features that must compose in one training step, in fp32 against the single-process run.

- activation recompute with ZeRO-3 and with pipelining (and, with dropout on, recompute replays the
  same masks on a pipeline stage as the plain run draws);
- sequence parallelism with pipelining (activations cross stages as sequence shards);
- the interleaved schedule's bound on activations held at once;
- the DP axis's bytes per step with several microbatches, for every ZeRO stage, against the formula.

Each test sends its whole list of layouts to the pool in one call (one worker, many configs).
"""

import torch

from tests.layouts import (
    VOCAB,
    assemble_params,
    assert_matches_reference,
    last_stage_result,
    per_layout,
    reference_fixture,
    run_layouts,
    small_config,
    strip_padding,
    with_padded_vocab,
)
from megazero.models.gpt import GPT

STEPS = 5
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def assert_recompute(results, cfg, dp, what):
    """Every layer's forward ran once per microbatch, twice with recompute."""
    par = cfg.parallel
    microbatches = cfg.global_batch_size // (cfg.micro_batch_size * dp)
    runs = 2 if cfg.model.recompute_granularity == "full" else 1
    expected = runs * cfg.train_iters * microbatches * cfg.model.num_layers // par.pipeline_parallel
    for r in filter(None, results):
        assert r["layer_forwards"] == expected, (
            f"{what}: {r['layer_forwards']} layer forwards on rank {r['coords']}, expected {expected}"
        )


reference = reference_fixture(steps=STEPS)


def test_recompute_and_sequence_parallel_compose_with_zero3_and_pipeline(dist_pool, reference):
    layouts = {
        "recompute x ZeRO-3 dp 2": (small_config(stage=3, steps=STEPS, model_extra=RECOMPUTE), 2),
        "recompute x pp 2 1F1B x ZeRO-1 dp 2": (
            small_config(pp=2, stage=1, schedule="1f1b", steps=STEPS, model_extra=RECOMPUTE),
            2,
        ),
        "sequence parallel tp 2 x pp 2 x ZeRO-2": (
            small_config(tp=2, pp=2, stage=2, sequence_parallel=True, steps=STEPS),
            1,
        ),
    }
    results = per_layout(dist_pool(4).run(run_layouts, list(layouts.values())))
    for (what, (cfg, dp)), got in zip(layouts.items(), results):
        assert_recompute(got, cfg, dp, what)
        assert_matches_reference(got, reference, what)


def test_recompute_replays_dropout_on_a_pipeline_stage(dist_pool):
    """With dropout on, a layout matches itself without recompute only if the recomputed forward
    draws the same masks (the RNG states are restored around it)."""
    dropout = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
    layouts = [
        (small_config(tp=2, pp=2, stage=1, steps=3, model_extra=extra), 1)
        for extra in (dropout, {**dropout, **RECOMPUTE})
    ]
    plain, recomputed = per_layout(dist_pool(4).run(run_layouts, layouts))
    for (cfg, dp), got in zip(layouts, (plain, recomputed)):
        assert_recompute(got, cfg, dp, "tp 2 x pp 2 with dropout")
    expected = (last_stage_result(plain), strip_padding(assemble_params(plain), VOCAB))
    assert_matches_reference(recomputed, expected, "tp 2 x pp 2 recompute with dropout vs without recompute")


def interleaved_in_flight(pp: int, v: int, m: int, stage: int) -> int:
    """Interleaved 1F1B (Narayanan et al. 2021; Megatron's warmup count): stage p runs
    w = 2 (pp - p - 1) + (v - 1) pp warmup forwards, then one more forward before each backward,
    so it holds min(v m, w + 1) model-chunk activations at most (each 1/v of the stage's layers).
    With m == pp every forward runs first, so all v m are held."""
    if m == pp:
        return v * m
    return min(v * m, 2 * (pp - stage - 1) + (v - 1) * pp + 1)


def test_interleaved_schedule_holds_the_theoretical_number_of_activations(dist_pool):
    pp, v = 2, 2
    layouts = [(small_config(pp=pp, virtual=v, schedule="interleaved", global_batch=2 * m, steps=1), 1) for m in (4, 8)]
    for m, results in zip((4, 8), per_layout(dist_pool(4).run(run_layouts, layouts))):
        for r in filter(None, results):
            stage = r["coords"][2]
            expected = interleaved_in_flight(pp, v, m, stage)
            assert r["in_flight"] == expected, (
                f"interleaved pp {pp} v {v} m {m}: stage {stage} held {r['in_flight']}, theory {expected}"
            )
            assert expected < v * m, "the bound must be below GPipe's v m for this check to mean anything"


# --- bytes of the DP axis per step -----------------------------------------------------------

DP, FP32_BYTES = 2, 4
SCALAR_SLACK = 64  # all-reduced float64 scalars (global loss, norm's sum of squares, flags)


def bytes_config(stage: int, microbatches: int, keep_gathered: bool = False):
    """dp 2, tp = pp = 1: every other group has one rank and moves nothing, so the whole log is the
    DP axis. Untied embeddings (a tied weight is also gathered where the head uses it) and no
    persistent parameters. Stage 3 releases every unit after each use (a live-parameter bound of
    0 leaves nothing gathered for reuse or prefetch), so it gathers before each forward and each
    backward; with parameters kept across microbatches the bound stays at its default, since it
    would evict kept units too."""
    zero = {"param_persistence_threshold": 0, "keep_params_gathered_across_microbatches": keep_gathered}
    if not keep_gathered:
        zero.update(max_reuse_distance=0, max_live_parameters=0)
    cfg = small_config(
        stage=stage,
        tied=False,
        micro=2,
        global_batch=2 * DP * microbatches,
        steps=2,
        model_extra={"hidden_size": 64, "ffn_hidden_size": 256},
        zero_extra=zero,
    )
    return with_padded_vocab(cfg)


def model_numel(cfg) -> int:
    with torch.device("meta"):
        sizes = [p.numel() for p in GPT(cfg.model).parameters()]
    # ZeRO pads buckets and units to shards x alignment; sizes that are multiples of 64 need none
    # at dp 2, so the formula below is exact.
    assert all(size % 64 == 0 for size in sizes), "the test's premise: no padding"
    return sum(sizes)


def expected_bytes(stage: int, m: int, keep_gathered: bool, psi: int) -> dict[str, float]:
    """Per rank and step, ring convention: a gather or reduce-scatter of the model moves
    (n-1)/n x 4 psi bytes, an all-reduce twice that.
    Stage 0 all-reduces the accumulated gradients once per step; stage 1 reduce-scatters them once
    per step and all-gathers the updated weights; stage 2 reduce-scatters every microbatch and
    all-gathers the weights once; stage 3 reduce-scatters every microbatch and gathers before each
    microbatch's forward and backward (once per step when kept across microbatches)."""
    once = (DP - 1) / DP * FP32_BYTES * psi
    gathers = {0: 0, 1: 1, 2: 1, 3: 1 if keep_gathered else 2 * m}[stage]
    reduce_scatters = {0: 0, 1: 1, 2: m, 3: m}[stage]
    return {
        "all_reduce": 2 * once if stage == 0 else 0.0,
        "all_gather": gathers * once,
        "reduce_scatter": reduce_scatters * once,
    }


def test_dp_bytes_per_step_with_several_microbatches(dist_pool):
    cases = [(stage, m, False) for stage in range(4) for m in (1, 4)] + [(3, m, True) for m in (1, 4)]
    layouts = [(bytes_config(stage, m, keep), DP) for stage, m, keep in cases]
    psi = model_numel(layouts[0][0])
    results = per_layout(dist_pool(4).run(run_layouts, layouts))
    wrong = []
    for (stage, m, keep), per_rank in zip(cases, results):
        what = f"stage {stage} dp {DP} {m} microbatches{' params kept gathered' if keep else ''}"
        moved: dict[str, float] = {}
        # The second step's log: the first also records stage 3's trace (with its own checks).
        for (op, _, _), nbytes in per_rank[0]["comm"].items():
            moved[op] = moved.get(op, 0.0) + nbytes
        expected = expected_bytes(stage, m, keep, psi)
        for op in ("all_gather", "reduce_scatter"):
            if moved.get(op, 0.0) != expected[op]:
                wrong.append(f"{what}: {op} moved {moved.get(op, 0.0):.0f} bytes, formula {expected[op]:.0f}")
        extra = moved.get("all_reduce", 0.0) - expected["all_reduce"]
        if not 0 <= extra <= SCALAR_SLACK:
            wrong.append(
                f"{what}: all_reduce moved {extra:+.0f} bytes beyond the formula's {expected['all_reduce']:.0f}"
            )
        if not set(moved) <= set(expected):
            wrong.append(f"{what}: unexpected ops {sorted(set(moved) - set(expected))}")
    assert not wrong, f"psi {psi}:\n" + "\n".join(wrong)
