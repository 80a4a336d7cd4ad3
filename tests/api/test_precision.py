"""fp16 with dynamic loss scaling and bf16 on a user's model under megazero.initialize (one process,
ZeRO-2): the module's parameters take the 16-bit dtype; an fp16 step whose scaled gradients overflow
is skipped as DeepSpeed skips it (weights unchanged bitwise, scale halved, skipped_steps and
global_steps counted, the lr scheduler not stepped), and once the scale fits, steps apply and the
scale grows again after loss_scale_window clean steps; bf16 applies every step.

Planted to see it fail: the lr scheduler stepped after a skipped step too.
"""

import torch
from torch import nn

import megazero
from megazero.utils import safe_get_full_fp32_param


def run(precision: dict, steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        **precision,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 5, "warmup_type": "linear"},
        },
    }
    engine, _, _, scheduler = megazero.initialize(model=model, config=config)
    dtype = next(engine.module.parameters()).dtype
    trace = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        before = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
        loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        moved = any(not torch.equal(b, safe_get_full_fp32_param(p)) for b, p in zip(before, engine.module.parameters()))
        trace.append((engine.get_loss_scale(), moved, engine.skipped_steps, scheduler.last_batch_iteration))
    return dtype, engine.global_steps, trace


def deepspeed_scales(overflows: list[bool], power: int, window: int) -> list[float]:
    """The scale after each step by DeepSpeed's dynamic loss scaler with hysteresis 1 (its
    update_scale): halve on an overflow; double when the steps since the last overflow reach a
    multiple of the window (its iteration counter starts at 0, the last overflow at -1)."""
    scale, last_overflow, out = 2.0**power, -1, []
    for it, overflow in enumerate(overflows):
        if overflow:
            scale, last_overflow = max(scale / 2, 1.0), it
        elif (it - last_overflow) % window == 0:
            scale *= 2
        out.append(scale)
    return out


def test_fp16_skips_overflowing_steps_as_deepspeed_does():
    dtype, global_steps, trace = run(
        {"fp16": {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 3, "hysteresis": 1}}, 14
    )
    assert dtype == torch.float16 and global_steps == 14
    skipped = [i == 0 and t[2] == 1 or i > 0 and t[2] == trace[i - 1][2] + 1 for i, t in enumerate(trace)]
    assert skipped[0] and not all(skipped), trace  # 2^20 overflows first, then steps apply
    assert [t[0] for t in trace] == deepspeed_scales(skipped, 20, 3), trace
    applied = 0
    for (scale, moved, _, iteration), skip in zip(trace, skipped):
        assert moved != skip, trace  # a skipped step leaves the weights bitwise
        applied += not skip
        assert iteration == applied - 1, trace  # the scheduler steps after applied steps only


def test_bf16_applies_every_step():
    dtype, global_steps, trace = run({"bf16": {"enabled": True}}, 4)
    assert dtype == torch.bfloat16 and global_steps == 4
    assert all(moved and scale == 1.0 for scale, moved, _, _ in trace) and trace[-1][2:] == (0, 3)
