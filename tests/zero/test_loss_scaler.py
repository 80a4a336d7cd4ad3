"""fp16 with dynamic loss scaling: an overflow on any rank skips the step everywhere (weights and
optimizer states untouched) and lowers the scale; clean steps train and track the fp32 curve."""

import torch

from tests.layouts import run_training, setup_training, small_config
from megazero.parallel.process_groups import ProcessGroups
from megazero.zero.loss_scaler import LossScaler
from megazero.zero.config import PrecisionConfig


def _fp16_config(stage):
    cfg = small_config(stage=stage, steps=14)
    cfg.precision.fp16 = True
    cfg.precision.initial_scale_power = 24  # far too large: fp16 gradients overflow at first
    cfg.precision.hysteresis = 1
    return cfg


def test_fp16_overflow_skips_and_lowers_the_scale(dist_pool):
    fp32 = run_training(small_config(steps=14), ProcessGroups.single())["losses"]
    for stage in (1, 3):
        results = dist_pool(2).run(fp16_worker, _fp16_config(stage))
        for skipped, scales, unchanged, losses in results:
            assert skipped[0] and not all(skipped), f"stage {stage}: expected early overflows, then steps"
            for i in range(len(skipped) - 1):  # hysteresis 1: every overflow halves the scale
                assert scales[i + 1] == (scales[i] / 2 if skipped[i] else scales[i]), (i, scales)
            assert unchanged == skipped, "weights move exactly on the steps that were not skipped"
            assert sum(skipped[len(skipped) // 2 :]) <= len(skipped) // 4, skipped
            # same weights and batch as fp32 on the first step; then fp16 steps still learn
            assert abs(losses[0] - fp32[0]) <= 1e-2 * fp32[0], (losses[0], fp32[0])
            assert losses[-1] < losses[0] - 0.05, losses


def fp16_worker(ctx, cfg):
    from megazero.training.lr_schedule import learning_rate
    from megazero.parallel.topology import Topology
    from megazero.training import train_step
    from megazero.zero.state_access import safe_get_full_fp32_param

    groups = ctx.groups(Topology(world_size=2))
    state, source = setup_training(cfg, groups)
    probe = next(state.chunks[0].parameters())
    skipped, scales, unchanged, losses = [], [], [], []
    for it in range(cfg.train_iters):
        before = safe_get_full_fp32_param(probe)
        step = train_step(state, source.batch(it), learning_rate(cfg.optimizer, it + 1, cfg.train_iters))
        skipped.append(step.skipped)
        scales.append(step.loss_scale)
        unchanged.append(torch.equal(before, safe_get_full_fp32_param(probe)))
        losses.append(step.loss)
    return skipped, scales, unchanged, losses


def test_loss_scaler_hysteresis_and_growth():
    scaler = LossScaler.from_config(
        PrecisionConfig(fp16=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    )
    assert scaler.scale == 16.0
    scaler.update(True)
    assert scaler.scale == 16.0  # first overflow is tolerated
    scaler.update(True)
    assert scaler.scale == 8.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 16.0  # three clean steps double it
    assert LossScaler.from_config(PrecisionConfig(fp16=True, loss_scale=128.0)).dynamic is False


def _scales(scaler: LossScaler, overflows: str) -> list[float]:
    """Scale after each step of a pattern like "oco" (o: overflow, c: clean step)."""
    out = []
    for step in overflows:
        scaler.update(step == "o")
        out.append(scaler.scale)
    return out


def test_loss_scaler_hysteresis_refill_as_deepspeed():
    """Without consecutive_hysteresis only a scale increase refills the hysteresis, so once it is used
    up every overflow halves; with it every clean step refills, so only overflows in a row count."""
    plain = LossScaler.from_config(PrecisionConfig(fp16=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2))
    assert _scales(plain, "ocoo" + "ccc" + "oo") == [16, 16, 8, 4] + [4, 4, 8] + [8, 4]
    consecutive = LossScaler.from_config(
        PrecisionConfig(
            fp16=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2, consecutive_hysteresis=True
        )
    )
    assert _scales(consecutive, "ocococ" + "oo") == [16] * 6 + [16, 8]
    assert (
        LossScaler.from_config(PrecisionConfig(fp16=True, loss_scale=128.0, consecutive_hysteresis=True)).dynamic
        is False
    )
