"""DeepSpeed's schedulers as megazero.initialize steps them (megazero/api/schedulers.py) against
DeepSpeed's own classes (deepspeed.runtime.lr_schedules): the same config block on two param groups
of different rates, stepped 60 times, writes the same rate into each group at every step, log and
linear warmups, and after a state_dict round trip. Skipped, with a line, without deepspeed.

Planted to see it fail: WarmupCosineLR's progress without DeepSpeed's + 1 (t - W instead of
t - W + 1), WarmupDecayLR's decay over T instead of T - W.
"""

import importlib.util
import os

import pytest
import torch

from megazero.api.schedulers import scheduler_from_config

BLOCKS = [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 10}},
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_num_steps": 7, "warmup_type": "linear"}},
    {
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": 40, "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 8},
    },
    {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 50, "warmup_min_ratio": 0.1, "warmup_num_steps": 12, "cos_min_ratio": 0.01},
    },
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_type": "linear"}},
]


def optimizer():
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    return torch.optim.SGD([{"params": params[:1], "lr": 1e-3}, {"params": params[1:], "lr": 4e-4}])


def rates(opt) -> list[float]:
    return [g["lr"] for g in opt.param_groups]


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install deepspeed; DS_ACCELERATOR=cpu)",
)
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b['type']}-{b['params'].get('warmup_type', 'log')}")
def test_schedulers_write_the_rates_deepspeeds_do(block):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import lr_schedules

    ours_opt, theirs_opt = optimizer(), optimizer()
    ours = scheduler_from_config(block, ours_opt)
    theirs = getattr(lr_schedules, block["type"])(theirs_opt, **block["params"])
    assert rates(ours_opt) == pytest.approx(rates(theirs_opt), rel=1e-12, abs=0), "before the first step"
    for step in range(60):
        if step == 30:  # a resumed run (a fresh optimizer and scheduler) continues where it was
            state = ours.state_dict()
            ours_opt = optimizer()
            ours = scheduler_from_config(block, ours_opt)
            ours.load_state_dict(state)
        ours.step()
        theirs.step()
        assert rates(ours_opt) == pytest.approx(rates(theirs_opt), rel=1e-12, abs=0), f"step {step}"
        assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12, abs=0)
