"""Adam with bf16 moments (Megatron-LM's precision-aware optimizer: --exp-avg-dtype bf16,
--exp-avg-sq-dtype bf16), in every implementation of megazero.ops.adam.

The contract (ops/adam.py's docstring): a bf16 moment is widened exactly, the step is the fp32 step
(the parameter update reads this step's fp32 moments), and the moment is stored rounded to nearest
even. What "equal" means here:
- Against torch: torch.optim.AdamW cannot hold bf16 moments beside fp32 parameters (its
  load_state_dict casts them to the parameter's dtype), so the test holds them for it: after each of
  torch's fp32 steps it rounds torch's exp_avg / exp_avg_sq to bf16 (`round_to_bf16`, written here).
  megazero's reference equals that bitwise, moments and parameters, over several steps, AdamW and
  Adam with L2 decay, each moment bf16 alone or both.
- The C++ kernel equals the reference bitwise in the moments, and in the parameter once the
  reference's sqrt is a correctly rounded one (test_adam.py says why), on every loop copy this CPU
  runs and every tail length; the rounding of a stored moment equals `.to(torch.bfloat16)` on every
  kind of fp32 value (ties, subnormals, inf, NaN).
- torch's fused kernel (the device path) takes no bf16 moment beside an fp32 parameter; the moments
  are widened in WIDEN_SLICE slices for it: moments within one bf16 rounding of the reference
  (bitwise over the kernel's vectorised body), the parameter within 1e-6 of the update.
Planted: rounding the stored moment by truncation in the reference (the torch test fails) and in
the C++ kernel's store_state (the kernel tests fail); the parameter update reading the rounded bf16
moment instead of this step's fp32 one (the torch test fails).
"""

import numpy as np
import pytest
import torch

from megazero.ops import adam as adam_module
from megazero.ops.adam import AdamSegment, adam_update, adam_update_fused, adam_update_reference
from megazero.ops.adam_config import AdamConfig
from tests.ops.test_adam import (  # noqa: F401
    FUSED,
    assert_bitwise,
    kernel_on,
    make_grad,
    run_kernel,
    special_floats,
    supported_isas,
)

BF16, FP32 = torch.bfloat16, torch.float32
MOMENTS = [(BF16, BF16), (BF16, FP32), (FP32, BF16)]
IDS = ["both", "exp_avg", "exp_avg_sq"]


def round_to_bf16(t: torch.Tensor) -> None:
    """t (fp32) in place to the nearest bf16 value, ties to even: how a bf16 moment is stored."""
    t.copy_(t.to(BF16))


def exact_sqrt(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.sqrt(t.numpy()))


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("dtypes", MOMENTS, ids=IDS)
def test_reference_equals_torch_adamw_holding_bf16_moments(decoupled, dtypes):
    torch.manual_seed(0)
    config = AdamConfig(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=decoupled)
    params = [torch.randn(1000, requires_grad=True), torch.randn(37, requires_grad=True)]
    optim_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    optim = optim_cls(
        params,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=False,
    )
    ours = [p.detach().clone() for p in params]
    states = [tuple(torch.zeros(p.shape, dtype=d) for d in dtypes) for p in ours]
    for step in range(1, 7):
        grads = [torch.randn_like(p) * 10.0 ** (step % 3 - 1) for p in ours]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optim.step()
        for p in params:
            for key, dtype in zip(("exp_avg", "exp_avg_sq"), dtypes):
                if dtype == BF16:
                    round_to_bf16(optim.state[p][key])
        for p, g, (m, v) in zip(ours, grads, states):
            adam_update_reference(p, g, m, v, step=step, lr=config.lr, config=config, weight_decay=config.weight_decay)
        for p_torch, p_ours, (m, v) in zip(params, ours, states):
            assert torch.equal(p_torch.detach(), p_ours), f"step {step}: parameters differ"
            assert torch.equal(optim.state[p_torch]["exp_avg"], m.float()), f"step {step}: exp_avg"
            assert torch.equal(optim.state[p_torch]["exp_avg_sq"], v.float()), f"step {step}: exp_avg_sq"


@pytest.mark.parametrize("dtypes", MOMENTS, ids=IDS)
@pytest.mark.parametrize("grad_dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_kernel_equals_reference_with_bf16_moments(kernel_on, monkeypatch, dtypes, grad_dtype):
    """Tails below, at and past 8 and 16 lanes, a long buffer; three steps each from one state."""
    if not FUSED:
        pytest.skip("torch's CPU kernels fuse no multiply-add here: bitwise comparisons do not apply")
    gen = torch.Generator().manual_seed(1)
    config = AdamConfig(lr=1e-3, weight_decay=0.1)
    for n in (1, 7, 16, 17, 33, 4099):
        param = torch.randn(n, generator=gen)
        m = (torch.randn(n, generator=gen) * 1e-2).to(dtypes[0])
        v = (torch.rand(n, generator=gen) * 1e-4).to(dtypes[1])
        for step in range(1, 4):
            grad = make_grad(n, grad_dtype, gen)
            kw = dict(step=step, lr=config.lr, config=config, weight_decay=0.1, grad_scale=0.37)
            before = [t.clone() for t in (param, m, v)]
            adam_update_reference(param, grad, m, v, **kw)
            exact = [t.clone() for t in before]
            adam_update_reference(exact[0], grad, exact[1], exact[2], sqrt=exact_sqrt, **kw)
            for isa in supported_isas():
                kernel = [t.clone() for t in before]
                run_kernel(monkeypatch, isa, *kernel[:1], grad, *kernel[1:], **kw)
                for got, want in zip(kernel, exact):
                    assert_bitwise(got, want)
                assert_bitwise(kernel[1], m)
                assert_bitwise(kernel[2], v)


def test_stored_moment_rounds_like_torch_on_every_kind_of_value(kernel_on, monkeypatch):
    """beta1 0 from a zero exp_avg stores the gradient itself (rounded), so exp_avg shows the
    rounding alone on random fp32 bit patterns, bf16 ties, subnormals and the specials, through
    every loop copy (an inf gradient gives NaN there, as torch's lerp gives). Zeros are left out:
    the sign of a zero moment from lerp differs between torch's own vector and scalar loops."""
    grad = special_floats(torch.Generator().manual_seed(5))
    grad = grad[grad != 0]
    n = grad.numel()
    config = AdamConfig(beta1=0.0)
    kw = dict(step=1, lr=0.0, config=config, weight_decay=0.0)
    want = [torch.zeros(n), torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)]
    adam_update_reference(want[0], grad, want[1], want[2], **kw)
    finite = torch.isfinite(grad)
    assert_bitwise(want[1][finite], grad[finite].to(BF16))
    for isa in supported_isas():
        got = [torch.zeros(n), torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)]
        run_kernel(monkeypatch, isa, got[0], grad, got[1], got[2], **kw)
        assert_bitwise(got[1], want[1])
        assert_bitwise(got[2], want[2])


def test_fused_device_path_widens_bf16_moments(monkeypatch):
    """What a GPU's step runs, on the CPU where torch has the same fused kernel."""
    gen = torch.Generator().manual_seed(2)
    config = AdamConfig(lr=1e-3, weight_decay=0.1)
    n, body = 4099, 4096 - 64  # the elements torch's CPU kernel runs in its vectorised loops
    start = [
        torch.randn(n, generator=gen),
        (torch.randn(n, generator=gen) * 1e-2).to(BF16),
        (torch.rand(n, generator=gen) * 1e-4).to(BF16),
    ]
    grad = (torch.randn(n, generator=gen) * 100).to(BF16)
    reference, fused, sliced = ([t.clone() for t in start] for _ in range(3))
    adam_update_reference(
        reference[0],
        grad,
        reference[1],
        reference[2],
        step=3,
        lr=config.lr,
        config=config,
        weight_decay=0.1,
        grad_scale=0.37,
    )
    adam_update_fused(
        [AdamSegment(*fused[:1], grad.clone(), *fused[1:], 0.1)], step=3, lr=config.lr, config=config, grad_scale=0.37
    )
    for got, want in zip(fused[1:], reference[1:]):
        assert_bitwise(got[:body], want[:body])
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-8, atol=0)
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-6, atol=1e-6 * config.lr)
    monkeypatch.setattr(adam_module, "WIDEN_SLICE", 64)
    adam_update_fused(
        [AdamSegment(*sliced[:1], grad.clone(), *sliced[1:], 0.1)], step=3, lr=config.lr, config=config, grad_scale=0.37
    )
    for a, b in zip(sliced, fused):
        assert_bitwise(a, b)


def test_the_kernel_takes_bf16_moments_and_nothing_else(monkeypatch):
    """Moments of another dtype (fp16) go to the reference, which still steps them."""
    n = 64
    p, g = torch.zeros(n), torch.ones(n)
    assert adam_module._kernel_accepts(p, g, torch.zeros(n, dtype=BF16), torch.zeros(n))
    assert not adam_module._kernel_accepts(p, g, torch.zeros(n, dtype=torch.float16), torch.zeros(n))
    assert not adam_module._kernel_accepts(p.bfloat16(), g, torch.zeros(n), torch.zeros(n))
    m = torch.zeros(n, dtype=torch.float16)
    adam_update(p, g, m, torch.zeros(n), step=1, lr=1e-3, config=AdamConfig(), weight_decay=0.0)
    assert torch.equal(m, torch.full((n,), 0.1, dtype=torch.float16))
