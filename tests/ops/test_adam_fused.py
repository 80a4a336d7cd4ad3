"""torch's fused Adam(W) kernel (megazero.ops.adam.adam_update_fused: what ZeRO partitions on a GPU
step with) against the reference update, on CPU, where torch has the same kernel.

- Moments (exp_avg, exp_avg_sq) are the reference's to one rounding (bitwise over the kernel's
  vectorised body; torch's CPU kernel rounds its scalar tail's exp_avg_sq once more, e.g. in 1 of
  7 elements), for AdamW and Adam with L2 decay, fp32 and bf16 gradients, with and without
  weight decay and with the three kinds of grad scale: none, the fp16 loss scale alone (a power of
  two: the kernel's divisor is exact) and a clipping coefficient (multiplied into the gradients
  first, as the reference does; dividing by its inverse instead moves exp_avg by up to 1e-3
  relative where it nearly cancels). The parameter agrees
  to within 1e-6 of the update's size per step (the kernel orders the bias corrections its own way)
  and to 1e-6 relative L2 after ten steps; the bf16 parameter copy is the updated fp32 value rounded.
  Planted: dividing by 1/scale for a clipping scale (the moments test fails); _fused_adamw_ for
  Adam with L2 decay (the moments test fails).
- Gradients in bf16 are widened in bounded slices; many slices give the bits of one.
- `adam_step` sends CPU segments to adam_update (the C++ kernel) and the rest to the fused kernel;
  a ZeRO run whose every step goes through the fused kernel tracks the default run.
"""

import itertools

import pytest
import torch

from tests.layouts import RTOL, assert_params_match, run_training, small_config
from megazero.ops import adam as adam_module
from megazero.ops.adam_config import AdamConfig
from megazero.ops.adam import (
    AdamSegment,
    adam_step,
    adam_update,
    adam_update_fused,
    adam_update_reference,
    fused_available,
)
from megazero.parallel.process_groups import ProcessGroups

SIZES = (1, 7, 1000, 4099)
ONE_ROUNDING = 2.0**-23  # relative: one fp32 rounding of the value
BODY = 992  # leading elements the CPU kernel runs vectorised (16-lane loops)
LR = 1e-3
CASES = list(itertools.product([True, False], [torch.float32, torch.bfloat16], [1.0, 2.0**-10, 0.37]))


def _ids(case):
    adamw, dtype, scale = case
    return f"{'adamw' if adamw else 'adam_l2'}-{str(dtype)[6:]}-scale{scale:g}"


def _states(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]
        for n in SIZES
    ]


def _grads(seed: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * 100).to(dtype) for n in SIZES]


def _decay(i: int) -> float:
    return 0.1 if i % 2 == 0 else 0.0


def _reference_step(states, grads, step, config, scale):
    for i, ((p, m, v), g) in enumerate(zip(states, grads)):
        adam_update_reference(
            p, g.clone(), m, v, step=step, lr=LR, config=config, weight_decay=_decay(i), grad_scale=scale
        )


def _fused_step(states, grads, step, config, scale, copies=None):
    segments = [
        AdamSegment(p, g.clone(), m, v, _decay(i), None if copies is None else copies[i])
        for i, ((p, m, v), g) in enumerate(zip(states, grads))
    ]
    adam_update_fused(segments, step=step, lr=LR, config=config, grad_scale=scale)


def test_torch_has_a_fused_kernel_for_the_cpu():
    assert fused_available("cpu") and fused_available(torch.device("cpu"))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_fused_step_equals_the_reference(case):
    adamw, dtype, scale = case
    config = AdamConfig(lr=LR, weight_decay=0.1, decoupled_weight_decay=adamw)
    reference = _states(1)
    for step in range(1, 5):
        grads = _grads(10 + step, dtype)
        fused = [[t.clone() for t in s] for s in reference]
        copies = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
        _reference_step(reference, grads, step, config, scale)
        _fused_step(fused, grads, step, config, scale, copies)
        for (p, m, v), (fp, fm, fv), copy in zip(reference, fused, copies):
            for got, want in ((fm, m), (fv, v)):
                torch.testing.assert_close(got, want, rtol=ONE_ROUNDING, atol=0)
            if len(m) >= BODY:
                assert torch.equal(fm[:BODY], m[:BODY]) and torch.equal(fv[:BODY], v[:BODY])
            torch.testing.assert_close(fp, p, rtol=1e-6, atol=1e-6 * LR)
            assert torch.equal(copy, fp.to(torch.bfloat16))


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_ten_fused_steps_stay_within_1e6_of_the_reference(adamw):
    config = AdamConfig(lr=LR, weight_decay=0.1, decoupled_weight_decay=adamw)
    reference, fused = _states(2), _states(2)
    for step in range(1, 11):
        grads = _grads(20 + step, torch.float32)
        scale = 0.37 if step % 2 else 2.0**-12
        _reference_step(reference, grads, step, config, scale)
        _fused_step(fused, grads, step, config, scale)
    for ref, got in zip(reference, fused):
        for r, g in zip(ref, got):
            assert float((g.double() - r.double()).norm()) <= 1e-6 * float(r.double().norm())


def test_bf16_gradients_widened_in_slices_give_the_bits_of_one_pass(monkeypatch):
    config = AdamConfig(lr=LR, weight_decay=0.1)
    grads = _grads(3, torch.bfloat16)
    whole, sliced = _states(3), _states(3)
    _fused_step(whole, grads, 3, config, 0.37)
    monkeypatch.setattr(adam_module, "WIDEN_SLICE", 64)
    _fused_step(sliced, grads, 3, config, 0.37)
    for a, b in zip(whole, sliced):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_adam_step_routes_cpu_segments_to_adam_update_and_others_to_the_fused_kernel(monkeypatch):
    config = AdamConfig(lr=LR, weight_decay=0.1)
    grads = _grads(4, torch.float32)
    stepped, expected = _states(4), _states(4)
    copies = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    adam_step(
        [AdamSegment(p, g.clone(), m, v, _decay(i), copies[i]) for i, ((p, m, v), g) in enumerate(zip(stepped, grads))],
        step=2,
        lr=LR,
        config=config,
        grad_scale=0.5,
    )
    for i, ((p, m, v), g) in enumerate(zip(expected, grads)):
        adam_update(p, g.clone(), m, v, step=2, lr=LR, config=config, weight_decay=_decay(i), grad_scale=0.5)
    for a, b, copy in zip(stepped, expected, copies):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert torch.equal(copy, a[0].to(torch.bfloat16))
    calls = []
    monkeypatch.setattr(adam_module.route, "impl", lambda device: "fused")
    monkeypatch.setattr(adam_module, "adam_update_fused", lambda segs, **kw: calls.append(len(segs)))
    adam_step([AdamSegment(p, g, m, v, 0.0) for (p, m, v), g in zip(_states(4), grads)], step=1, lr=LR, config=config)
    assert calls == [len(SIZES)]


@pytest.mark.parametrize("stage,bf16", [(1, False), (2, True)], ids=["stage1-fp32", "stage2-bf16"])
def test_a_zero_run_on_the_fused_kernel_tracks_the_default_run(monkeypatch, stage, bf16):
    """Every storage steps through torch's fused kernel, as on a GPU (clipping triggers every step,
    so the clipping scale is multiplied in; bf16 runs refresh the 16-bit weights by copy)."""
    default = run_training(small_config(stage=stage, steps=6, bf16=bf16), ProcessGroups.single())
    routed = []
    monkeypatch.setattr(adam_module.route, "impl", lambda device: routed.append(device) or "fused")
    fused = run_training(small_config(stage=stage, steps=6, bf16=bf16), ProcessGroups.single())
    assert routed, "the engine's step did not go through adam_step"
    torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(default["losses"]), rtol=RTOL, atol=0)
    assert_params_match(
        {name: value for name, (value, _) in fused["params"].items()},
        {name: value for name, (value, _) in default["params"].items()},
        "fused vs default",
    )
