"""The zero-bubble schedules (zb-h1, zbv, interleaved-zb, dualpipev: parallel/pipeline/zero_bubble.py,
run by action_runner.py with the split backward of models/split_backward.py) reproduce the
single-process run: fp32, 10 steps, loss curve, gradient norms and final parameters at rtol 1e-5.

Each schedule at pp 2 and pp 4 (over the ZeRO stages 0-3 and dp 1-2, so that every stage meets a
V-shaped and a looped schedule), then composed: pp 4 x tp 2 (sequence parallel) x ZeRO-3 under the
stream sanitizer (MEGAZERO_STREAM_CHECK's checker: side-stream reductions and stage-3 prefetches
against the new orders), pp 2 x cp 2 x ZeRO-1, pp 2 x ep 2 MoE (ZeRO-2), pp 4 with full
recomputation; 8-layer GPT with tied embeddings (a V holds both copies on stage 0), the MoE one a
4-layer model of its own. All in one pool call per reference (8 gloo ranks).

Where the gradients go: in every run with ZeRO-2/3 each reduction is issued inside a W (or the
step's flush), none inside a B, and every run defers Ws (B before W on the same microbatch).
Planted, each failing here: stage 3 holding a unit per backward instead of per ticket (zbv pp 4
ZeRO-3: a W after a later microbatch's B hands its gradient to a released, empty parameter); the V's
local sum of the tied embedding's two copies dropped (zbv pp 2 ZeRO-1: 8 of the 10 losses off, by up
to 1.2e-3 relative).
"""

import contextlib

import pytest

from megazero.core.stream_check import checking
from tests.layouts import assert_matches_reference, layout_worker, per_layout, single_process_reference, small_config
from tests.parallel.test_expert_parallel import MOE, check as check_moe

STEPS, LAYERS = 10, 8
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
CHUNKS = {"zb-h1": 1, "zbv": 2, "interleaved-zb": 2, "dualpipev": 2}

# (what, config, dp, stream checked); 16 samples a step in microbatches of 2: 8 / dp microbatches
LAYOUTS = [
    ("zb-h1 pp 2 ZeRO-0 dp 2", dict(pp=2, schedule="zb-h1", stage=0), 2, False),
    ("zb-h1 pp 4 ZeRO-2 dp 2", dict(pp=4, schedule="zb-h1", stage=2), 2, False),
    ("zbv pp 2 ZeRO-1 dp 2", dict(pp=2, schedule="zbv", stage=1), 2, False),
    ("zbv pp 4 ZeRO-3", dict(pp=4, schedule="zbv", stage=3), 1, False),
    ("interleaved-zb pp 2 ZeRO-2", dict(pp=2, schedule="interleaved-zb", stage=2), 1, False),
    ("interleaved-zb pp 4 ZeRO-0 dp 2", dict(pp=4, schedule="interleaved-zb", stage=0), 2, False),
    ("dualpipev pp 2 ZeRO-3 dp 2", dict(pp=2, schedule="dualpipev", stage=3), 2, False),
    ("dualpipev pp 4 ZeRO-1", dict(pp=4, schedule="dualpipev", stage=1), 1, False),
    ("zbv pp 4 x tp 2 SP x ZeRO-3", dict(pp=4, tp=2, sequence_parallel=True, schedule="zbv", stage=3), 1, True),
    ("dualpipev pp 2 x cp 2 x ZeRO-1", dict(pp=2, cp=2, schedule="dualpipev", stage=1), 1, False),
    ("zb-h1 pp 4 recompute ZeRO-1", dict(pp=4, schedule="zb-h1", stage=1, model_extra=RECOMPUTE), 1, False),
]
MOE_LAYOUT = (
    "zbv pp 2 x ep 2 MoE ZeRO-2 dp 2",
    dict(pp=2, ep=2, schedule="zbv", stage=2, layers=4, model_extra=MOE),
    2,
    False,
)


def config(options: dict):
    options = {"layers": LAYERS, "steps": STEPS, **options}
    return small_config(virtual=CHUNKS[options["schedule"]], **options)


def watch_reductions(state) -> list:
    """Records, for every gradient reduction the engine issues, whether a B or a W was running."""
    engine, seen, inside = state.engine, [], {"B": False, "W": False}

    def wrap(name, kind):
        run = getattr(engine, name)

        def wrapped(*args, **kwargs):
            inside[kind] = True
            try:
                return run(*args, **kwargs)
            finally:
                inside[kind] = False

        setattr(engine, name, wrapped)

    wrap("backward_input", "B")
    wrap("backward_weight", "W")
    push = engine.queue.push
    engine.queue.push = lambda *a, **k: (seen.append(dict(inside)), push(*a, **k))[1]
    return seen


def run_all(ctx, layouts) -> list:
    """Pool entry: each (what, config, dp, checked) in turn; the stream checker around checked ones."""
    out = []
    for what, options, dp, checked in layouts:
        seen = {}

        def on_setup(state):
            seen["reductions"] = watch_reductions(state)

        with checking() if checked else contextlib.nullcontext():
            result = layout_worker(ctx, config(options), dp, on_setup)
        if result is not None:
            result.update(seen)
        out.append(result)
    return out


@pytest.fixture(scope="module")
def results(dist_pool):
    return per_layout(dist_pool(8).run(run_all, LAYOUTS + [MOE_LAYOUT]))


def assert_deferred_and_reduced_at_w(results, what: str, stage: int) -> None:
    ranks = [r for r in results if r is not None]
    assert all(r["deferred_w"] >= 1 for r in ranks), f"{what}: every stage lets some W wait after its B"
    reductions = [seen for r in ranks for seen in r["reductions"]]
    assert not any(seen["B"] for seen in reductions), f"{what}: a gradient reduction was issued inside a B"
    if stage >= 2:
        assert reductions and all(seen["W"] for seen in reductions), (
            f"{what}: ZeRO-{stage} reduces each microbatch's gradients at its W"
        )


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[what for what, *_ in LAYOUTS])
def test_zero_bubble_layout_matches_single_process(results, index):
    what, options, dp, _ = LAYOUTS[index]
    reference = single_process_reference(layers=LAYERS, steps=STEPS)
    assert_matches_reference(results[index], reference, what)
    assert_deferred_and_reduced_at_w(results[index], what, options["stage"])


def test_zero_bubble_with_experts_matches_single_process(results):
    what, options, dp, _ = MOE_LAYOUT
    reference = single_process_reference(layers=4, steps=STEPS, model_extra=MOE)
    check_moe(results[-1], reference, what)
    assert_deferred_and_reduced_at_w(results[-1], what, options["stage"])
