"""The GPT under tensor parallelism: tp=2 and tp=4 start from the tp=1 weights and reproduce its
10-step loss curve in fp32, for the default model and for one with every option switched
(rotary on half of each head, SwiGLU, zero-centred RMSNorm, grouped-query attention, heads wider than
hidden / heads, no biases, untied embeddings, selective recomputation);
dropout streams differ across TP ranks exactly where they must."""

import pytest
import torch
from torch import nn

from tests.layouts import (
    assemble_params,
    assert_close,
    assert_params_match,
    last_stage_result,
    layout_worker,
    run_training,
    small_config,
    strip_padding,
)
from megazero.parallel.process_groups import ProcessGroups
from megazero.parallel.random import MODEL_PARALLEL, TrackedDropout, TrackedModule, make_checkpoint_fn, seed_everything
from megazero.parallel.topology import Topology
from megazero.training import setup

VOCAB = 61
VARIANT = {
    "position_embedding": "rope",
    "activation": "swiglu",
    "normalization": "rmsnorm",
    "num_attention_heads": 8,
    "num_query_groups": 4,
    "kv_channels": 12,
    "rotary_percent": 0.5,
    "apply_layernorm_1p": True,
    "recompute_granularity": "selective",
    "add_bias_linear": False,
}
MODELS = {"default": ({}, True), "every option": (VARIANT, False)}  # name -> (model fields, tied)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_tp2_and_tp4_reproduce_tp1(dist_pool, model):
    extra, tied = MODELS[model]
    initial = run_training(small_config(steps=0, model_extra=extra, tied=tied), ProcessGroups.single())
    ref = run_training(small_config(model_extra=extra, tied=tied), ProcessGroups.single())
    ref_params = strip_padding(assemble_params([ref]), VOCAB)
    for tp in (2, 4):
        start = dist_pool(4).run(layout_worker, small_config(tp=tp, steps=0, model_extra=extra, tied=tied), 1)
        got, want = strip_padding(assemble_params(start), VOCAB), strip_padding(assemble_params([initial]), VOCAB)
        for name in want:
            assert torch.equal(got[name], want[name]), f"tp={tp}: initial {name} differs from tp=1"
        results = dist_pool(4).run(layout_worker, small_config(tp=tp, model_extra=extra, tied=tied), 1)
        assert_close(last_stage_result(results)["losses"], ref["losses"], f"{model} tp={tp}: losses")
        assert_params_match(strip_padding(assemble_params(results), VOCAB), ref_params, f"{model} tp={tp}")


def dropout_streams(ctx, sequence_parallel):
    groups = ctx.groups(Topology(world_size=2, tp=2))
    cfg = small_config(tp=2, sequence_parallel=sequence_parallel, model_extra={"hidden_dropout": 0.5})
    from tests.layouts import with_padded_vocab

    state = setup(with_padded_vocab(cfg), groups)
    masks = {}
    layer = state.chunks[0].layers["0"]
    layer.attention_dropout.register_forward_hook(
        lambda m, args, out: masks.__setitem__("hidden", (out == 0) & (args[0] != 0))
    )
    tokens = torch.arange(17).unsqueeze(0) % VOCAB
    state.chunks[0](tokens[:, :-1], tokens[:, 1:])

    # The tracker itself: the model-parallel stream differs per TP rank, the default one agrees,
    # and recomputation replays both.
    tracker = seed_everything(11, groups.coords.tp, 0, "cpu")
    tracked = TrackedModule(nn.Dropout(0.5), tracker)(torch.ones(64))
    plain = nn.Dropout(0.5)(torch.ones(64))
    x = torch.ones(32, requires_grad=True)
    fn = lambda t: TrackedDropout(0.5, tracker)(t) * nn.functional.dropout(t, 0.5)  # noqa: E731
    states = (torch.get_rng_state(), tracker.get_states())
    fn(x).sum().backward()
    direct = x.grad.clone()
    x.grad = None
    torch.set_rng_state(states[0])
    tracker.set_states(states[1])
    make_checkpoint_fn(tracker)(fn, x).sum().backward()
    return masks["hidden"], tracked, plain, torch.equal(direct, x.grad), MODEL_PARALLEL in tracker.states


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_differs_across_tp_ranks_only_where_it_must(dist_pool, sequence_parallel):
    (h0, t0, p0, replay0, _), (h1, t1, p1, replay1, _) = dist_pool(2).run(dropout_streams, sequence_parallel)
    assert replay0 and replay1, "recomputation must replay the same dropout masks"
    assert not torch.equal(t0, t1), "model-parallel stream must differ across TP ranks"
    assert torch.equal(p0, p1), "default stream must agree across TP ranks"
    if sequence_parallel:  # each rank holds different tokens: masks come from per-rank streams
        assert not torch.equal(h0, h1)
    else:  # replicated activations: every TP rank drops the same elements
        assert torch.equal(h0, h1) and h0.any()
