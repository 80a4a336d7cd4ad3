"""DeepSpeed's state API on a user's model under megazero.initialize, against torch: a small MLP in
one process at ZeRO-2 and ZeRO-3 and the same MLP trained by torch.optim.AdamW on the same batch.

- safe_get_full_grad between engine.backward and engine.step equals the parameter's .grad in torch;
  after the step, safe_get_full_fp32_param equals torch's weight and safe_get_full_optimizer_state
  ("exp_avg", "exp_avg_sq") torch's AdamW state, to 1e-6.
- safe_set_full_fp32_param writes what safe_get_full_fp32_param then reads and the forward uses.
- offload_states() / reload_states() between steps leave the next step's loss and weights bitwise
  those of a run without them.

Planted to see it fail: safe_get_full_optimizer_state answering "exp_avg_sq" with exp_avg.
"""

import pytest
import torch
from torch import nn

import megazero
from megazero.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
)

LR, DECAY = 1e-2, 0.1


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def step(engine, i):
    x, y = batch(i)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.parametrize("stage", [2, 3])
def test_state_api_reads_what_torch_holds(stage):
    reference = model()
    torch_adam = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=DECAY)
    x, y = batch(0)
    nn.functional.mse_loss(reference(x), y).backward()
    engine, *_ = megazero.initialize(model=model(), config=config(stage))
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    names = dict(engine.module.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(safe_get_full_grad(names[name]), p.grad, rtol=1e-6, atol=0)
    engine.step()
    torch_adam.step()
    for name, p in reference.named_parameters():
        mine = names[name]
        torch.testing.assert_close(safe_get_full_fp32_param(mine), p.detach(), rtol=1e-6, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                safe_get_full_optimizer_state(mine, key),
                torch_adam.state[p][key],
                rtol=1e-6,
                atol=0,
                msg=lambda m: f"{name} {key}: {m}",
            )
    weight = names["2.bias"]
    safe_set_full_fp32_param(weight, torch.tensor([1.0, -2.0, 3.0]))
    assert torch.equal(safe_get_full_fp32_param(weight), torch.tensor([1.0, -2.0, 3.0]))
    with torch.no_grad():
        engine.eval()
        out = engine(torch.zeros(1, 6))
        engine.train()
    with torch.no_grad():
        hidden = torch.tanh(torch.zeros(1, 8) + safe_get_full_fp32_param(names["0.bias"]))
        want = hidden @ safe_get_full_fp32_param(names["2.weight"]).T + torch.tensor([1.0, -2.0, 3.0])
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_and_reload_states_change_nothing(stage):
    runs = []
    for offload in (False, True):
        engine, *_ = megazero.initialize(model=model(), config=config(stage))
        losses = [step(engine, 0)]
        if offload:
            engine.offload_states()
            engine.reload_states()
        losses.append(step(engine, 1))
        runs.append((losses, [safe_get_full_fp32_param(p) for p in engine.module.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
