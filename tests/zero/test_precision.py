"""16-bit training as DeepSpeed and Megatron do it, and the non-finite step skip in every precision.

bf16 weights compute in bf16, but gradients accumulate across microbatches and are reduced in fp32
(Precision's defaults), so a parallel layout differs from the single-process bf16 run only where
bf16 arithmetic itself sees other shapes: TP splits a matmul's reduction dimension and DP ranks run
smaller microbatch GEMMs, which round bf16 activations differently. That noise moves a 6-step loss
curve by at most ~4e-5 relative here. Accumulating in bf16 instead (still selectable) rounds every
partial sum to 8 bits of mantissa, which test_gradients_accumulate_in_fp32 measures directly.
"""

import math

import pytest
import torch

from tests.layouts import (
    last_stage_result,
    layout_worker,
    run_training,
    setup_training,
    small_config,
    with_padded_vocab,
)
from megazero.parallel.process_groups import ProcessGroups

STEPS = 6
BF16_RTOL = 2e-4  # measured worst case 4.2e-5 over the grid below (tp 2); the old bar was 1e-2


@pytest.fixture(scope="module")
def bf16_reference():
    return run_training(small_config(bf16=True, steps=STEPS), ProcessGroups.single())["losses"]


def _max_rel_gap(got, ref) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def test_bf16_layouts_track_the_single_process_bf16_run(dist_pool, bf16_reference):
    pool = dist_pool(8)
    worst = 0.0
    layouts = [dict(tp=tp, stage=stage, dp=dp) for stage in (1, 2, 3) for tp in (1, 2) for dp in (2, 4)]
    layouts += [dict(pp=2, stage=stage, dp=2) for stage in (1, 3)] + [dict(pp=2, tp=2, stage=2, dp=2)]
    for layout in layouts:
        dp = layout.pop("dp")
        results = pool.run(layout_worker, small_config(bf16=True, steps=STEPS, **layout), dp)
        gap = _max_rel_gap(last_stage_result(results)["losses"], bf16_reference)
        assert gap <= BF16_RTOL, f"bf16 {layout} dp {dp}: loss curve off by {gap:.2e} relative"
        worst = max(worst, gap)
    print(f"bf16 layouts vs 1-process bf16: worst relative loss gap {worst:.2e}")


def _bf16_state(stage, accum, fusion=True):
    from megazero.training import setup

    cfg = with_padded_vocab(small_config(bf16=True, stage=stage, micro=1, global_batch=8))
    cfg.precision.grad_accum_dtype = accum
    cfg.precision.gradient_accumulation_fusion = fusion
    return setup(cfg, ProcessGroups.single())


def _microbatches():
    from megazero.data.synthetic import ArithmeticTokens
    from megazero.data.sampler import MicrobatchSource

    return MicrobatchSource(ArithmeticTokens(61, 16, seed=3), 8, 1, 0, 1).batch(0)


def test_gradients_accumulate_in_fp32(monkeypatch):
    """Over 8 microbatches the accumulated gradient is the fp32 sum of the microbatches' bf16
    gradients (error ~1e-7); accumulating in bf16 rounds every partial sum (error ~1e-3). Without
    gradient-accumulation fusion: with it, the microbatches' weight gradients are not bf16 to begin
    with (tests/models/test_weight_grad.py)."""
    batches = _microbatches()
    ref_state = _bf16_state(0, "fp32", fusion=False)
    chunk = ref_state.chunks[0]
    names = [n for n, _ in chunk.named_parameters()]
    exact = {n: 0.0 for n in names}
    for tokens in batches:  # autograd.grad fires no accumulation hooks: plain bf16 gradients
        grads = torch.autograd.grad(chunk(tokens[:, :-1], tokens[:, 1:]).float().sum(), list(chunk.parameters()))
        for n, g in zip(names, grads):
            exact[n] = exact[n] + g.double()
    from megazero.zero.state_access import safe_get_full_grad

    errors = {}
    for stage, accum in ((1, "fp32"), (3, "fp32"), (1, "bf16"), (3, "bf16")):
        state = _bf16_state(stage, accum, fusion=False)
        engine, model = state.engine, state.chunks[0]
        engine.begin_step()
        for k, tokens in enumerate(batches):
            engine.backward(model(tokens[:, :-1], tokens[:, 1:]).float().sum(), last_microbatch=k == len(batches) - 1)
        engine.finish_gradients()
        worst = 0.0
        for n, p in model.named_parameters():
            got = safe_get_full_grad(p).double()
            worst = max(worst, float((got - exact[n]).norm() / exact[n].norm().clamp_min(1e-30)))
        errors[(stage, accum)] = worst
    print("relative error of the accumulated gradient:", errors)
    for stage in (1, 3):
        assert errors[(stage, "fp32")] <= 1e-6, errors
        assert errors[(stage, "bf16")] >= 1e-4, errors


def nonfinite_worker(ctx, cfg, tp, pp, inject_rank, inject_step, value):
    """Trains cfg; on `inject_step` rank `inject_rank` poisons one replicated norm weight's
    gradient with `value`. Returns per step: skipped, loss scale, weights unchanged, loss."""
    from megazero.training.lr_schedule import learning_rate
    from megazero.parallel.topology import Topology
    from megazero.training import train_step
    from megazero.zero.state_access import safe_get_full_fp32_param

    groups = ctx.groups(Topology(world_size=ctx.world_size, tp=tp, pp=pp))
    state, source = setup_training(cfg, groups)
    # A TP-replicated norm weight: on TP rank 1 it does not count in the norm, the hard case.
    target = next(p for n, p in state.chunks[0].named_parameters() if "norm" in n)
    probe = next(state.chunks[0].parameters())
    out = []
    for it in range(cfg.train_iters):
        hook = None
        if it == inject_step and ctx.rank == inject_rank:
            hook = target.register_hook(lambda g: g * value)
        before = safe_get_full_fp32_param(probe)
        step = train_step(state, source.batch(it), learning_rate(cfg.optimizer, it + 1, cfg.train_iters))
        if hook is not None:
            hook.remove()
        out.append((step.skipped, step.loss_scale, torch.equal(before, safe_get_full_fp32_param(probe)), step.loss))
    return out, state.engine.skipped_steps


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_nan_on_one_rank_skips_the_step_everywhere(dist_pool, precision):
    cfg = small_config(stage=3, steps=4, bf16=precision == "bf16", global_batch=8)
    cfg.optimizer.warmup_iters = 0  # step 1 would run at lr 0 (Megatron's warmup) and move nothing
    if precision == "fp16":
        cfg.precision.fp16 = True
        cfg.precision.initial_scale_power = 8  # small enough not to overflow by itself
        cfg.precision.hysteresis = 1
    for tp, pp, rank in ((2, 1, 3), (1, 2, 1)):
        results = dist_pool(4).run(nonfinite_worker, cfg, tp, pp, rank, 1, float("nan"))
        for steps, skipped_total in results:
            assert [s[0] for s in steps] == [False, True, False, False], (precision, tp, pp, steps)
            assert [s[2] for s in steps] == [False, True, False, False], "weights move unless skipped"
            assert skipped_total == 1
            assert all(math.isfinite(s[3]) for s in steps)
            if precision == "fp16":  # the scale backs off once, identically
                assert [s[1] for s in steps] == [256.0, 256.0, 128.0, 128.0], steps


def test_fp16_overflow_on_one_rank_only(dist_pool):
    """An inf gradient on one DP rank only: every rank skips and halves the scale together."""
    cfg = small_config(stage=2, steps=3, global_batch=8)
    cfg.precision.fp16, cfg.precision.initial_scale_power, cfg.precision.hysteresis = True, 8, 1
    results = dist_pool(4).run(nonfinite_worker, cfg, 1, 1, 2, 0, float("inf"))
    for steps, skipped_total in results:
        assert [(s[0], s[1]) for s in steps] == [(True, 256.0), (False, 128.0), (False, 128.0)], steps
        assert skipped_total == 1
