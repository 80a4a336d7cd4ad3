"""Pipeline parallelism composed with TP and every ZeRO stage reproduces the single-process run.

Grid: pp {2, 4} x tp {1, 2} x dp {1, 2} (world <= 8: 7 layouts) x ZeRO stage {0..3} x GPipe, 1F1B
and interleaved 1F1B with 2 virtual stages, on an 8-layer GPT with tied embeddings (so the first and
last stage each hold the word embedding and sum its gradients over the embedding group). Each
(schedule, stage) cell runs 3 of the 7 layouts, chosen so that every layout meets every stage and
every schedule (pairwise cover, 36 of the 84 runs). Each run is 4 steps of a 16-sample global
batch in microbatches of 2 (the first step at the warmup's lr 0, then 3 updates): a wrong
gradient, a stale weight or a misrouted activation shows in the loss from the second step on, and
in the final parameters at 1e-5.
"""

import pytest

from tests.layouts import assert_matches_reference, layout_worker, reference_fixture, small_config
from megazero.parallel.pipeline.split import stage_layer_ranges

LAYERS = 8
GRID = [(pp, tp, dp) for pp in (2, 4) for tp in (1, 2) for dp in (1, 2) if pp * tp * dp <= 8]
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # schedule -> virtual stages
STEPS = 4

reference = reference_fixture(layers=LAYERS, steps=STEPS)


def cell_layouts(stage: int, schedule: int) -> list[tuple[int, int, int]]:
    """Cell c = 3 stage + schedule runs GRID[3c .. 3c+2] (mod 7): a stage's 3 cells take 9
    consecutive layouts, a schedule's 4 cells start 9 apart; either way all 7 are covered."""
    c = 3 * stage + schedule
    return [GRID[(3 * c + i) % len(GRID)] for i in range(3)]


def test_the_cells_cover_every_layout_with_every_stage_and_schedule():
    assert len(GRID) == 7
    for stage in range(4):
        assert {g for k in range(3) for g in cell_layouts(stage, k)} == set(GRID), stage
    for k in range(3):
        assert {g for stage in range(4) for g in cell_layouts(stage, k)} == set(GRID), k


def check(pool, reference, dp, what, **config):
    results = pool.run(layout_worker, small_config(layers=LAYERS, steps=STEPS, **config), dp)
    assert_matches_reference(results, reference, what)
    return results


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pipeline_grid_matches_single_process(dist_pool, reference, schedule, stage):
    pool = dist_pool(8)
    for pp, tp, dp in cell_layouts(stage, sorted(SCHEDULES).index(schedule)):
        what = f"{schedule} pp {pp} tp {tp} dp {dp} stage {stage}"
        results = check(
            pool, reference, dp, what, pp=pp, tp=tp, stage=stage, schedule=schedule, virtual=SCHEDULES[schedule]
        )
        microbatches = 16 // (2 * dp)
        for r in results:
            if r is None:
                continue
            p = r["coords"][2]
            if schedule == "gpipe":
                assert r["in_flight"] == microbatches, f"{what}: GPipe holds every microbatch"
            elif schedule == "1f1b":
                assert r["in_flight"] == min(pp - p, microbatches) <= pp, (
                    f"{what}: stage {p} held {r['in_flight']} microbatches, 1F1B allows {pp - p}"
                )


def test_uneven_split_and_stage3_gather_once_per_step(dist_pool, reference):
    pool = dist_pool(8)
    check(pool, reference, 2, "uneven split 3+5", pp=2, stage=2, layer_split=[3, 5])
    check(
        pool,
        reference,
        2,
        "stage 3 keeps params gathered across microbatches",
        pp=2,
        tp=2,
        stage=3,
        zero_extra={"keep_params_gathered_across_microbatches": True},
    )


def test_stage_layer_ranges_interleave_chunks():
    # chunk c = v * pp + p: stage 0 runs layers 0-1 and 4-5, stage 1 runs 2-3 and 6-7
    assert stage_layer_ranges(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layer_ranges(8, 2, 1, [3, 5]) == [range(0, 3), range(3, 8)]


def freed_outputs(ctx, schedule):
    import torch
    from megazero.parallel.pipeline.p2p import PipelineP2P, backward_from_freed
    from megazero.parallel.pipeline.schedules import PipelineJob, get_schedule
    from megazero.parallel.topology import Topology

    groups = ctx.groups(Topology(world_size=2, pp=2))
    stage = groups.coords.pp
    w = torch.nn.Parameter(torch.full((3,), 1.0 + stage))
    sent = []

    def forward(chunk, x, mb):
        out = (x if x is not None else torch.ones(2, 3)) * w
        if stage == 1:
            return out.sum()
        sent.append(out)
        return out

    def backward(output, grad, last):
        output.backward() if grad is None else backward_from_freed([output], [grad])

    job = PipelineJob(
        num_microbatches=4,
        num_chunks=1,
        stage=stage,
        num_stages=2,
        forward=forward,
        backward=backward,
        p2p=PipelineP2P(groups.pp, (2, 3), torch.float32, "cpu"),
    )
    get_schedule(schedule, 2, 1)(job)
    return [t.numel() for t in sent], w.grad.tolist()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_outputs_are_freed_once_sent(dist_pool, schedule):
    (freed, grad0), (_, grad1) = dist_pool(2).run(freed_outputs, schedule)
    assert freed == [1, 1, 1, 1], "every sent activation keeps only a 1-element placeholder"
    # loss = sum over 4 microbatches of sum(ones(2,3) * w0 * w1), w0 = 1, w1 = 2
    assert grad0 == [16.0] * 3 and grad1 == [8.0] * 3
