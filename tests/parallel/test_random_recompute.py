"""Megatron-LM's recomputation flags at tp 2 x pp 2 (fp32, dropout on, 10 steps): selective (the core
attention), full with the uniform method (groups of 1 and 2 layers) and full with the block method
each give the loss curve of no recomputation within 1e-6 relative, which needs the recomputed forward
to draw the same dropout masks from the tensor-parallel RNG streams (parallel.random's checkpoint).
What runs twice is what Megatron says, counted per pipeline stage: every core attention (selective),
every layer (uniform), the first recompute_num_layers layers of each stage (block).

Planted bugs: restoring only torch's RNG state in the checkpoint (no tracker snapshot) makes every
recomputing layout miss the curve; counting block's layers by global index (the model's first N)
instead of per stage makes the forward counts fail.
"""

import pytest
import torch

from tests.layouts import layout_worker, last_stage_result, small_config

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
LAYOUTS = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full uniform 1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full uniform 2": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "full block 1": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
}
STEPS, MICROBATCHES = 10, 2  # global batch 4 = micro 2 x 2 microbatches (dp 1)


def counting_worker(ctx, configs):
    """Trains each config; counts the forward calls of each transformer layer (by its global index)
    and of the attention cores (pre-hooks: recomputation reruns the whole forward, no early stop)."""
    out = []
    for cfg in configs:
        calls: dict = {}

        def hook_layers(state):
            for chunk in state.chunks:
                for index, layer in chunk.layers.items():
                    layer.register_forward_pre_hook(lambda m, a, i=int(index): calls.update({i: calls.get(i, 0) + 1}))
                    layer.attention.core.register_forward_pre_hook(
                        lambda m, a: calls.update({"core": calls.get("core", 0) + 1})
                    )

        result = layout_worker(ctx, cfg, 1, on_setup=hook_layers)
        if result is not None:
            result["calls"] = calls
        out.append(result)
    return out


@pytest.fixture(scope="module")
def runs(dist_pool):
    configs = [
        small_config(tp=2, pp=2, stage=1, steps=STEPS, global_batch=4, model_extra={**DROPOUT, **extra})
        for extra in LAYOUTS.values()
    ]
    per_rank = dist_pool(4).run(counting_worker, configs)
    return dict(zip(LAYOUTS, (list(r) for r in zip(*per_rank))))


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "none"])
def test_recomputation_keeps_the_loss_curve(runs, name):
    got = torch.tensor(last_stage_result(runs[name])["losses"], dtype=torch.float64)
    ref = torch.tensor(last_stage_result(runs["none"])["losses"], dtype=torch.float64)
    gap = float(((got - ref).abs() / ref.abs()).max())
    assert gap <= 1e-6, f"{name}: loss curve differs from no recomputation by {gap:.2e} (relative)"


def test_what_runs_twice_is_what_megatron_says(runs):
    per_micro = STEPS * MICROBATCHES
    stage_layers = {0: (0, 1), 1: (2, 3)}  # 4 layers over pp 2
    expected = {
        "none": lambda layer: 1,
        "selective": lambda layer: 1,
        "full uniform 1": lambda layer: 2,
        "full uniform 2": lambda layer: 2,
        # block: the first layer of each stage (per stage, not the model's first layer only)
        "full block 1": lambda layer: 2 if layer in (0, 2) else 1,
    }
    for name, results in runs.items():
        for r in filter(None, results):
            stage = r["coords"][2]
            for layer in stage_layers[stage]:
                assert r["calls"][layer] == expected[name](layer) * per_micro, (
                    f"{name}: layer {layer} ran {r['calls'][layer] / per_micro:g}x per microbatch"
                )
            cores = 2 if name != "none" else 1  # selective reruns it; full reruns its layer
            if name == "full block 1":
                cores = 1.5  # one of the stage's two layers
            assert r["calls"]["core"] == cores * len(stage_layers[stage]) * per_micro, (
                f"{name}: core attention ran {r['calls']['core'] / per_micro:g} times per microbatch"
            )


def test_the_recomputation_runs_under_the_forwards_torch_function_modes():
    """Autograd runs the backward with no torch function mode on, so a recomputation left alone
    would run other functions than its forward did wherever a mode replaces them (the dry run's
    GPU kernels: the checkpoint then stops, "a different number of tensors was saved"). The
    checkpoint re-enters the forward's modes. Planted: recomputing without them counts 1 call."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from megazero.parallel.random import RNGTracker, make_checkpoint_fn

    calls = []

    class CountingGelu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.gelu:
                calls.append(1)
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    with CountingGelu():
        out = make_checkpoint_fn(RNGTracker(torch.device("cpu")))(lambda a: F.gelu(a @ w), x)
    out.sum().backward()
    assert len(calls) == 2, f"the recomputation ran {len(calls) - 1} gelu calls under the mode, not 1"
    expected = torch.autograd.grad(F.gelu(x @ w).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
