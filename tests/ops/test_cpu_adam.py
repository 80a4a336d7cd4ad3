"""megazero.ops.CPUAdam, the C++ Adam kernel as a torch.optim.Optimizer, against torch.optim.AdamW /
Adam: bitwise on the reference path, within the kernel's few ulps on the kernel path (what the
ulps mean: test_adam.py); its state_dict round trip, with torch's AdamW as the loader too; and
what it refuses.
"""

from copy import deepcopy

import pytest
import torch

from megazero.core.errors import UsageError
from tests.ops.test_adam import FUSED, assert_bitwise, require_kernel


def _params_and_grads(seed, steps):
    """Parameters of several shapes (two groups) and the gradients of every step."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1,), (7,), (17,), (31, 33), (1023,)]
    params = [torch.randn(shape, generator=gen) for shape in shapes]
    grads = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(steps)]
    return params, grads


def _run(optim_cls, params, grads, adamw, **extra):
    """`len(grads)` steps of optim_cls on copies of params; returns (params, optimizer)."""
    params = [torch.nn.Parameter(p.clone()) for p in params]
    groups = [{"params": params[:2], "weight_decay": 0.0}, {"params": params[2:], "weight_decay": 0.1, "lr": 3e-3}]
    optim = optim_cls(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, **extra)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optim.step()
    return params, optim


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_cpu_adam_matches_torch(monkeypatch, adamw):
    """CPUAdam against torch.optim.AdamW / Adam (L2 decay): bitwise on the reference path, and
    within the kernel's few ulps per step (rtol 1e-6 after 5 steps) on the kernel path."""
    from megazero.ops import CPUAdam

    params, grads = _params_and_grads(6, steps=5)
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    expected, torch_optim = _run(torch_cls, params, grads, adamw, foreach=False)
    monkeypatch.setenv("MEGAZERO_DISABLE_CPP_ADAM", "1")
    ours, ours_optim = _run(CPUAdam, params, grads, adamw, adamw_mode=adamw)
    for e, o in zip(expected, ours):
        assert torch.equal(e, o)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch_optim.state[e][key], ours_optim.state[o][key])
    require_kernel()
    monkeypatch.delenv("MEGAZERO_DISABLE_CPP_ADAM")
    ours, ours_optim = _run(CPUAdam, params, grads, adamw, adamw_mode=adamw)
    for e, o in zip(expected, ours):
        torch.testing.assert_close(o, e, rtol=1e-6, atol=1e-7)
        if adamw and FUSED:  # AdamW's moments depend on the gradients alone
            assert_bitwise(ours_optim.state[o]["exp_avg_sq"], torch_optim.state[e]["exp_avg_sq"])


def test_cpu_adam_state_dict_round_trip():
    """Saved mid-run and loaded into a fresh CPUAdam (or torch's AdamW), the run continues with
    exactly the states of an uninterrupted one."""
    from megazero.ops import CPUAdam

    params, grads = _params_and_grads(7, steps=5)
    straight, _ = _run(CPUAdam, params, grads, True, adamw_mode=True)
    first, optim = _run(CPUAdam, params, grads[:3], True, adamw_mode=True)
    saved = optim.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert saved["state"][0]["step"].dtype == torch.float32 and saved["state"][0]["step"] == 3
    for optim_cls, extra in ((CPUAdam, {}), (torch.optim.AdamW, {"foreach": False})):
        resumed, optim = _run(optim_cls, [p.detach() for p in first], [], True, **extra)
        optim.load_state_dict(deepcopy(saved))  # loading shares tensors with `saved`
        assert all(g["decoupled_weight_decay"] for g in optim.param_groups)
        for step_grads in grads[3:]:
            for p, g in zip(resumed, step_grads):
                p.grad = g.clone()
            optim.step()
        for s, r in zip(straight, resumed):
            if optim_cls is CPUAdam:
                assert torch.equal(s, r)
            else:  # torch's sqrt against the kernel's: the few-ulp difference of the contract
                torch.testing.assert_close(r, s, rtol=1e-6, atol=1e-7)


def test_cpu_adam_rejects_what_it_cannot_do():
    from megazero.ops import CPUAdam

    with pytest.raises(UsageError, match="betas"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0))
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    half.grad = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(UsageError, match="fp32 CPU parameters, got torch.bfloat16"):
        CPUAdam([half]).step()
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.zeros(3)
    optim = CPUAdam([param])
    optim.param_groups[0]["amsgrad"] = True
    with pytest.raises(UsageError, match="amsgrad"):
        optim.step()
