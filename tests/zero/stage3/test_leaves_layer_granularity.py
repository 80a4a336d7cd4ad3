"""Stage-3 units per transformer layer (`stage3_granularity: "layer"`), in fp32 against the
single-process run, and the gathers they cost against per-module units.

A layer unit holds every non-persistent parameter of one transformer block (the leaf_module case
classes ["TransformerLayer"]; the embeddings, the final norm and the head stay units of their
own), gathered once before the block runs and released after it: the same bytes as per-module
units, in fewer, larger all-gathers.
"""

import pytest

from tests.layouts import (
    assert_matches_reference,
    layout_worker,
    reference_fixture,
    setup_training,
    small_config,
    with_padded_vocab,
)
from megazero.parallel.process_groups import ProcessGroups
from megazero.training import train_step
from megazero.zero.stage3.units import ParamStatus
from megazero.models.param_info import param_info

STEPS = 3
LAYER = {"stage3_granularity": "layer", "prefetch_bucket_size": 20000}


class CountingContext:
    """A pool context whose groups' comm log also keeps each step's call counts (its end_step
    clears them), so a test can read the stage-3 gathers of the last step."""

    def __init__(self, ctx):
        self.ctx, self.calls = ctx, []

    def groups(self, topology):
        groups = self.ctx.groups(topology)
        if groups is not None:
            log, end_step = groups.log, groups.log.end_step

            def end_step_keeping_calls():
                self.calls.append(dict(log.step_calls))
                return end_step()

            log.end_step = end_step_keeping_calls
        return groups


def counting_worker(ctx, layouts):
    """Pool entry: trains each (config, dp); each result also carries the last step's stage-3
    parameter all-gathers (on the shard-gather communicator): calls and bytes per rank."""
    out = []
    for cfg, dp in layouts:
        counting = CountingContext(ctx)
        result = layout_worker(counting, cfg, dp)
        if result is not None:
            gathers = {k: v for k, v in result["comm"].items() if k[0] == "all_gather" and "gather" in k[1]}
            result["gather_bytes"] = sum(gathers.values())
            result["gather_calls"] = sum(counting.calls[-1][k] for k in gathers)
        out.append(result)
    return out


reference = reference_fixture(steps=STEPS)


FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def test_layer_units_match_the_single_process_run_with_fewer_larger_gathers(dist_pool, reference):
    layouts = {
        "layer units dp 2": (small_config(stage=3, steps=STEPS, zero_extra=LAYER), 2),
        "module units dp 2": (small_config(stage=3, steps=STEPS), 2),
        "layer units dp 4, MiCS 2": (small_config(stage=3, steps=STEPS, mics=2, zero_extra=LAYER), 4),
        "layer units tp 2 x dp 2, recompute": (
            small_config(tp=2, stage=3, steps=STEPS, zero_extra=LAYER, model_extra=FULL_RECOMPUTE),
            2,
        ),
        "layer units pp 2 x dp 2": (small_config(pp=2, stage=3, steps=STEPS, zero_extra=LAYER), 2),
    }
    per_rank = dist_pool(4).run(counting_worker, list(layouts.values()))
    results = dict(zip(layouts, (list(r) for r in zip(*per_rank))))
    for what, got in results.items():
        assert_matches_reference(got, reference, what)

    layer, module = results["layer units dp 2"][0], results["module units dp 2"][0]
    # Per layer, per-module units gather attention qkv/proj and mlp fc1/fc2 apart (4 gathers), a
    # layer unit all at once; the bytes differ only by each unit's padding to the shard count. Over
    # the 4 layers, with the word and the position embedding units of their own either way (the
    # tied output head uses the word embedding's unit; norms and biases are persistent): 4 + 2
    # all-gathers per step against 4 x 4 + 2 (the figure docs/zero.md quotes).
    calls = (layer["gather_calls"], module["gather_calls"])
    assert calls == (6, 18), calls
    assert layer["gather_bytes"] == pytest.approx(module["gather_bytes"], rel=0.01)
    per_call = [r["gather_bytes"] / r["gather_calls"] for r in (layer, module)]
    assert per_call[0] > 2 * per_call[1], per_call


def test_a_layer_unit_is_gathered_before_the_layer_and_released_after_it():
    """One process: the hooks sit on the blocks, a layer's submodules all run on its one gathered
    unit, and with no reuse the unit is gone as soon as the layer's forward returns."""
    cfg = with_padded_vocab(
        small_config(stage=3, steps=1, global_batch=4, zero_extra={**LAYER, "max_reuse_distance": 0})
    )
    state, source = setup_training(cfg, ProcessGroups.single())
    gather = state.engine.gather
    hooked = {gather.module_name(m) for m in gather.module_units}
    assert hooked == {"embedding.word", "embedding.position", "output_head", *(f"layers.{i}" for i in range(4))}, hooked
    layer = state.chunks[0].layers["1"]
    unit = param_info(layer.attention.qkv.weight).zero_unit
    assert {param_info(p).zero_unit for p in layer.parameters() if param_info(p).zero_unit is not None} == {unit}
    statuses = []
    for sub in (layer.input_norm, layer.attention.qkv, layer.mlp.fc2):
        sub.register_forward_pre_hook(lambda m, args: statuses.append(unit.status))
    layer.register_forward_hook(lambda m, args, out: statuses.append(unit.status))
    train_step(state, source.batch(0), 1e-3)
    during, after = ParamStatus.AVAILABLE, ParamStatus.NOT_AVAILABLE
    assert statuses == [during, during, during, after] * source.num_microbatches, statuses
