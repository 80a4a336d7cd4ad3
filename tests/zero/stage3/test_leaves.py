"""Stage 3's leaf modules (`zero_optimization.leaf_module`): a leaf is one unit, gathered whole when
entered, nothing inside it hooked; its gradients are reduced when its backward is done.

- `classes: ["TransformerLayer"]` is the `layer` granularity: the same curve bit for bit, and the
  one-process curve to rtol 1e-5 (dp 2, and tp 2 x dp 2 with recomputation).
- The three selectors (class name, module name, name suffix) pick the modules DeepSpeed's would;
  a selector that matches nothing is one line naming it.
- A mixture-of-experts-like leaf whose experts run only for the tokens routed to them: each rank
  calls a different expert. Per-module units diverge (the trace check names both ranks' modules);
  as a leaf it trains and matches one process fed both ranks' data (rtol 1e-5).

Planted: without the reduction at the end of a leaf's backward (a leaf's units reduced like any
unit's, when complete or at the end of the backward) the two ranks reduce in different orders and
the routed run fails; hooking a leaf's inner modules as well makes it diverge like per-module units.
"""

import pytest
import torch
from torch import nn

from tests.layouts import (
    assemble_params,
    assert_close,
    assert_params_match,
    layout_worker,
    run_training,
    small_config,
    strip_padding,
    with_padded_vocab,
)
from megazero.core.errors import UsageError
from megazero.parallel.process_groups import ProcessGroups
from megazero.training import setup
from tests.zero.stage3.test_coordinator_hardening import HANG, _assert_matches_one_process, _build, _train

VOCAB, STEPS = 61, 3
BY_CLASS = {"leaf_module": {"classes": ["TransformerLayer"]}, "prefetch_bucket_size": 20000}
BY_LAYER = {"stage3_granularity": "layer", "prefetch_bucket_size": 20000}


def leaf_layouts_worker(ctx, layouts):
    return [layout_worker(ctx, cfg, dp) for cfg, dp in layouts]


def test_transformer_layer_leaves_are_the_layer_granularity(dist_pool):
    reference = run_training(small_config(steps=STEPS), ProcessGroups.single())
    ref_params = strip_padding(assemble_params([reference]), VOCAB)
    layouts = [
        (small_config(stage=3, steps=STEPS, zero_extra=BY_CLASS), 2),
        (small_config(stage=3, steps=STEPS, zero_extra=BY_LAYER), 2),
        (small_config(tp=2, stage=3, steps=STEPS, zero_extra=BY_CLASS, model_extra={"recompute_activations": True}), 2),
    ]
    by_class, by_layer, tp = (list(r) for r in zip(*dist_pool(4).run(leaf_layouts_worker, layouts)))
    assert by_class[0]["losses"] == by_layer[0]["losses"] and by_class[0]["norms"] == by_layer[0]["norms"]
    for name, value in assemble_params(by_class).items():
        assert torch.equal(value, assemble_params(by_layer)[name]), name
    for what, got in (("leaves dp 2", by_class), ("leaves tp 2 x dp 2, recompute", tp)):
        best = next(r for r in got if r is not None)
        assert_close(best["losses"], reference["losses"], what)
        assert_params_match(strip_padding(assemble_params(got), VOCAB), ref_params, what)


def _hooked(zero_extra) -> set[str]:
    cfg = with_padded_vocab(small_config(stage=3, layers=2, steps=1, zero_extra=zero_extra))
    gather = setup(cfg, ProcessGroups.single()).engine.gather
    return {gather.module_name(m) for m in gather.module_units}


def test_each_selector_makes_leaves_and_a_selector_matching_nothing_is_one_line():
    base = {"embedding.word", "embedding.position", "output_head"}
    per_module = _hooked({})
    assert {"layers.0.attention.qkv", "layers.1.mlp.fc2"} <= per_module
    assert _hooked({"leaf_module": {"classes": "MLP"}}) == {m for m in per_module if ".mlp." not in m} | {
        "layers.0.mlp",
        "layers.1.mlp",
    }
    # the module-qualified class name and a module name select the same kind of thing
    assert _hooked({"leaf_module": {"classes": ["megazero.models.gpt.TransformerLayer"]}}) == base | {
        "layers.0",
        "layers.1",
    }
    assert _hooked({"leaf_module": {"names": ["layers.1.attention"]}}) == {
        m for m in per_module if not m.startswith("layers.1.attention.")
    } | {"layers.1.attention"}
    assert _hooked({"leaf_module": {"name_suffixes": [".attention"]}}) == {
        m for m in per_module if ".attention." not in m
    } | {"layers.0.attention", "layers.1.attention"}
    for selector, named in (
        ({"names": ["layers.7.mlp"]}, "names 'layers.7.mlp'"),
        ({"classes": ["Expert"], "name_suffixes": [".mlp"]}, "classes 'Expert'"),
    ):
        with pytest.raises(UsageError, match=f"leaf_module: {named} matches no module") as err:
            _hooked({"leaf_module": selector})
        assert "\n" not in str(err.value)


# --- a leaf whose inner path depends on the data ----------------------------------------------
class Experts(nn.Module):
    """Each row goes to expert `a` or `b` by the sign of its gate; an expert no row is routed to is
    not called at all (as a mixture-of-experts layer skips experts without tokens)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, gate):
        out = x.new_zeros(x.shape)
        for expert, rows in ((self.a, gate > 0), (self.b, gate <= 0)):
            index = rows.nonzero().flatten()
            if index.numel():
                out = out.index_copy(0, index, expert(x.index_select(0, index)))
        return out


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.experts, self.out = nn.Linear(4, 4), Experts(), nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.experts(torch.tanh(self.inp(x)), x[:, 0]))


def _routed_batch(step, rank, rows=3):
    """Rank 0's first row goes to expert b and the others to expert a; all of rank 1's to b. So
    rank 0's leaf has every gradient in before its backward is over, rank 1's never does."""
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(100 * step + rank))
    x[:, 0] = x[:, 0].abs() + 0.1
    if rank == 0:
        x[0, 0] = -x[0, 0]
    else:
        x[:, 0] = -x[:, 0]
    return x


STAGE3 = dict(stage=3, param_persistence_threshold=0, max_reuse_distance=0)


def routed_worker(ctx, steps=3):
    """Per-module units (the trace check must fail), then Experts as a leaf on both ranks, then
    stage 0 on rank 0 alone with both ranks' data."""
    model, engine = _build(ctx, Routed, 2, **STAGE3)
    try:
        _train(model, engine, [_routed_batch(0, ctx.rank)])
        diverged = None
    except RuntimeError as err:
        diverged = str(err)
    model, engine = _build(ctx, Routed, 2, **STAGE3, leaf_module={"classes": ["Experts"]})
    hooked = {engine.gather.module_name(m) for m in engine.gather.module_units}
    leaf = _train(model, engine, [_routed_batch(s, ctx.rank) for s in range(steps)])
    model, engine = _build(ctx, Routed, 1, stage=0)
    if model is None:
        return leaf, None, (diverged, hooked)
    both = [torch.cat([_routed_batch(s, 0), _routed_batch(s, 1)]) for s in range(steps)]
    return leaf, _train(model, engine, both), (diverged, hooked)


def test_a_leaf_with_a_data_dependent_inner_path_trains_where_module_units_diverge(dist_pool):
    results = dist_pool(2).run(routed_worker, timeout=HANG)
    for _, _, (diverged, hooked) in results:
        assert diverged is not None and "ranks of the shard group diverge" in diverged, diverged
        assert "'experts.a'" in diverged and "'experts.b'" in diverged, diverged
        assert hooked == {"inp", "experts", "out"}, hooked
    _assert_matches_one_process(results)
