"""megazero.initialize on transformers models (Llama, GPT-2, Mixtral) reproduces a plain torch loop.

Each run trains a tiny model built by transformers (fp32, dropout off) for 10 steps of 2 micro
batches per rank through `megazero.initialize` and DeepSpeed's engine calls (engine(...),
engine.backward(loss), engine.step()), with an AdamW config block (weight decay on every parameter,
as DeepSpeed's single param group) and gradient clipping that triggers on every step. The other side
is the same model, data and seed in one process: torch.optim.AdamW and clip_grad_norm_ (hf_runs.py).
Loss curves and the gradient norms before clipping (engine.get_global_grad_norm() against
clip_grad_norm_'s) match to rtol 1e-5 at every step, final parameters per tensor to 1e-5 (relative
L2). The norms are what sees a gradient's scale: clipping on every step and Adam hide it from the
losses and weights (the factor below went unseen while only those were compared).

Planted to see them fail: the engine's backward without the 1 / data-parallel-ranks factor (every
kind fails on its gradient norms, as does tests/api/test_against_deepspeed.py); weight decay left
at Megatron's rule (>= 2-D only) instead of the param group's (Llama fails on its norm weights).
The schedulers are checked in test_schedulers.py and test_precision.py (these configs have none).
"""

import pytest

from tests.api.hf_runs import assert_matches, ds_config, torch_reference, train_with_megazero

OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
RUNS = [  # (model, data-parallel ranks, stage, extra zero_optimization keys)
    *[("llama", dp, stage, {}) for dp in (2, 4) for stage in (0, 1, 2, 3)],
    ("llama", 4, 2, OFFLOAD),
    ("llama", 4, 3, {**OFFLOAD, "offload_param": {"device": "cpu"}}),
    ("llama", 4, 3, {"mics_shard_size": 2}),
    ("llama", 4, 3, {"zero_hpz_partition_size": 2}),
    ("gpt2", 2, 1, {}),
    ("gpt2", 4, 3, {}),
    ("mixtral", 2, 3, {}),
    ("mixtral", 4, 2, {}),
]


@pytest.fixture(scope="module")
def references():
    cache = {}

    def reference(kind, dp):
        if (kind, dp) not in cache:
            cache[(kind, dp)] = torch_reference(kind, dp)
        return cache[(kind, dp)]

    return reference


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral"])
def test_transformers_models_match_a_plain_torch_loop(dist_pool, references, kind):
    pool = dist_pool(4)
    for model, dp, stage, extra in RUNS:
        if model != kind:
            continue
        result = pool.run(train_with_megazero, kind, dp, ds_config(stage, **extra))[0]
        assert result["steps"] == 10
        assert_matches(result, references(kind, dp), f"{kind} dp {dp} stage {stage} {extra}")


LAYER_FORWARDS = [0]  # forward calls of the first decoder layer's MLP in this pool worker


def checkpointed_llama():
    """The tiny Llama with transformers' own activation checkpointing on (each decoder layer's
    forward rerun in its backward, under ZeRO-3 a second gather of its parameters)."""
    from tests.api.hf_runs import tiny_model

    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    LAYER_FORWARDS[0] = 0
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: LAYER_FORWARDS.__setitem__(0, LAYER_FORWARDS[0] + 1))
    return model


def train_counting_forwards(ctx, *args, **kwargs):
    result = train_with_megazero(ctx, *args, **kwargs)
    return result and {**result, "layer_forwards": LAYER_FORWARDS[0]}


def test_gradient_checkpointing_enable_matches_the_plain_loop(dist_pool, references):
    """model.gradient_checkpointing_enable() (item 3 of the own-model API): the recomputed forward
    changes no value, so the curve is the plain loop's without checkpointing; under ZeRO-3 the
    rerun forward gathers the layer's parameters again inside the backward. The layer runs twice
    per micro batch (planted: checkpointing left off gives 20 forwards for 40)."""
    pool = dist_pool(4)
    for dp, stage in ((2, 2), (2, 3)):
        result = pool.run(train_counting_forwards, "llama", dp, ds_config(stage), build=checkpointed_llama)[0]
        assert result["steps"] == 10 and result["layer_forwards"] == 2 * 10 * 2, result.get("layer_forwards")
        assert_matches(result, references("llama", dp), f"llama checkpointed dp {dp} stage {stage}")
