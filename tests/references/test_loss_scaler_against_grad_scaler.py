"""megazero's fp16 dynamic loss scale against torch.amp.GradScaler and DeepSpeed's documented
hysteresis (test_training_against_torch.py says why these tests exist).
Here the other side is written in the test from torch and from Megatron-LM's / DeepSpeed's
documented rules (reference_rules.py). Each test names, in its docstring, the bugs it was seen to
catch (planted by hand, one at a time; tests/README.md lists them all).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.layouts import setup_training, small_config, with_padded_vocab
from megazero.models.gpt import GPT
from tests.references.reference_rules import megatron_lr


# --- fp16: the dynamic loss scale against torch.amp.GradScaler and DeepSpeed's hysteresis -----


def grad_scaler_scales(overflows: list[bool], scale: float, window: int) -> list[float]:
    """torch.amp.GradScaler itself, fed an overflow pattern: the scale each step runs at."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=window
    )
    out = []
    for overflow in overflows:
        out.append(scaler.get_scale())
        scaler.scale(torch.ones(()))
        param.grad = torch.full((1,), math.inf if overflow else 1.0)
        scaler.step(optimizer)
        scaler.update()
    return out


def loss_scale_rules(
    overflows: list[bool], *, scale: float, window: int, hysteresis: int, consecutive: bool, min_scale: float = 1.0
) -> list[float]:
    """The scale each step runs at: GradScaler's rules (an inf/NaN step is skipped and backs the scale
    off by 2; `window` clean steps in a row grow it by 2, the count restarting at an overflow) with
    DeepSpeed's fp16.hysteresis: an overflow first uses up one of `hysteresis` tolerated overflows
    and only one that finds a single one left halves the scale, as does every later one until a
    growth refills them (with fp16.consecutive_hysteresis, every clean step refills them)."""
    out, tolerance, clean = [], hysteresis, 0
    for overflow in overflows:
        out.append(scale)
        if overflow:
            clean = 0
            if tolerance > 1:
                tolerance -= 1
            else:
                scale = max(scale / 2, min_scale)
            continue
        clean += 1
        if consecutive:
            tolerance = hysteresis
        if clean == window:
            scale, clean, tolerance = scale * 2, 0, hysteresis
    return out


class StepSnapshots:
    """A save policy that saves nothing: after every step it keeps copies of the fp16 weights, the
    fp32 master weights and the Adam moments."""

    def __init__(self, state):
        self.snapshots = [self.take(state)]

    @staticmethod
    def take(state) -> dict:
        from megazero.zero.state_access import safe_get_full_fp32_param, safe_get_full_optimizer_state

        params = dict(state.chunks[0].named_parameters())
        return {
            "fp16": {n: p.detach().clone() for n, p in params.items()},
            "fp32": {n: safe_get_full_fp32_param(p) for n, p in params.items()},
            "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in params.items()},
            "exp_avg_sq": {n: safe_get_full_optimizer_state(p, "exp_avg_sq") for n, p in params.items()},
        }

    def stop_flags(self) -> tuple:
        return ()  # no stop condition to agree on

    def after_step(self, state, consumed_samples, agreed=None, loss=None):
        self.snapshots.append(self.take(state))

    def finish(self, state, consumed_samples):
        pass


def fp16_gradients_overflow(cfg, weights: dict, microbatches, scale: float) -> bool:
    """Whether the plain fp16 GPT with these weights gets a non-finite gradient from any microbatch
    of the loss scaled by `scale` (the summed token loss over the global batch's tokens, in fp32)."""
    model = GPT(cfg.model).to(torch.float16)
    model.load_state_dict(weights, strict=False)  # the tied head shares the embedding
    tokens_per_step = cfg.global_batch_size * cfg.model.seq_length
    for tokens in microbatches:
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:]).float().sum() / tokens_per_step
        (loss * scale).backward()
        if not all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):
            return True
    return False


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_fp16_loss_scale_follows_grad_scaler_and_deepspeed_hysteresis(hysteresis):
    """An fp16 run (megazero.training.train, 1 process) that starts at a loss scale its gradients
    overflow at and grows back into it every 2 clean steps: a step is skipped exactly when the plain
    fp16 GPT, with that step's weights, gets an inf/NaN gradient at that scale; a skipped step leaves
    the master weights and Adam moments bit for bit; the scale each step runs at is GradScaler's
    (checked against torch.amp.GradScaler itself with hysteresis 1) with DeepSpeed's hysteresis; the
    lr schedule advances only on applied steps (Megatron's scheduler is stepped on success only).

    Kills: the loss scale never growing; every overflow halving (hysteresis ignored); a step
    applied despite an overflow; the lr schedule counting skipped steps; the warmup off by one;
    the decay over the wrong period."""
    from megazero.parallel.process_groups import ProcessGroups
    from megazero.training.lr_schedule import learning_rate
    from megazero.training import train

    steps, power, window = 14, 21, 2
    cfg = with_padded_vocab(small_config(steps=steps, layers=2, global_batch=8, clip=1.0, lr=1e-3))
    prec = cfg.precision
    prec.fp16, prec.initial_scale_power, prec.loss_scale_window = True, power, window
    prec.hysteresis = hysteresis
    # The oracle is the plain fp16 GPT's fp16 gradients (GradScaler's and DeepSpeed's view); with
    # gradient-accumulation fusion the weight gradients are fp32 sums, which overflow later.
    prec.gradient_accumulation_fusion = False
    state, source = setup_training(cfg, ProcessGroups.single())
    spy = StepSnapshots(state)
    records = train(state, source, [], lambda n, _samples: learning_rate(cfg.optimizer, n, steps), policy=spy)
    skipped = [r["skipped"] for r in records]
    scales = [r["loss_scale"] for r in records]

    overflows = [
        fp16_gradients_overflow(cfg, spy.snapshots[i]["fp16"], source.batch(i), scales[i]) for i in range(steps)
    ]
    assert skipped == overflows, f"skipped steps {skipped} vs inf/NaN gradients {overflows}"
    grew = any(b > a for a, b in zip(scales, scales[1:]))
    assert sum(skipped) >= 3 and grew, f"the run must overflow and grow back: scales {scales}"

    expected = loss_scale_rules(overflows, scale=2.0**power, window=window, hysteresis=hysteresis, consecutive=False)
    assert scales == expected, f"loss scales {scales}, rules {expected}"
    if hysteresis == 1:
        assert expected == grad_scaler_scales(overflows, 2.0**power, window)

    applied = 0
    for i, record in enumerate(records):
        before, after = spy.snapshots[i], spy.snapshots[i + 1]
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            same = all(torch.equal(before[kind][n], after[kind][n]) for n in before[kind])
            kept = skipped[i] or (kind == "fp32" and record["lr"] == 0.0)  # warmup's first step
            assert same == kept, f"step {i + 1}: {kind} {'changed' if not same else 'kept'}"
        assert record["lr"] == pytest.approx(
            megatron_lr(applied, lr=1e-3, min_lr=1e-4, warmup=2, decay=steps, style="cosine"), rel=1e-12
        ), f"step {i + 1}"
        applied += not skipped[i]


@pytest.mark.parametrize("hysteresis,consecutive", [(1, False), (2, False), (2, True), (3, True)])
def test_loss_scaler_on_overflow_patterns(hysteresis, consecutive):
    """megazero's LossScaler against the rules above on 200 random overflow patterns, near the
    floor too (min scale 4); with hysteresis 1 also against torch.amp.GradScaler itself. Covers
    what one training run cannot choose: an overflow, a clean step, an overflow (consecutive
    hysteresis refills in between, the default does not).

    Kills: the loss scale never growing; growth after window + 1 clean steps; every overflow
    halving (hysteresis ignored); consecutive_hysteresis ignored."""
    from megazero.zero.loss_scaler import LossScaler
    from megazero.zero.config import PrecisionConfig

    rng = np.random.default_rng(hysteresis * 2 + consecutive)
    for _ in range(200):
        overflows = list(rng.random(int(rng.integers(1, 40))) < rng.uniform(0.1, 0.7))
        window = int(rng.integers(1, 5))
        scaler = LossScaler.from_config(
            PrecisionConfig(
                fp16=True,
                initial_scale_power=5,
                loss_scale_window=window,
                hysteresis=hysteresis,
                min_loss_scale=4.0,
                consecutive_hysteresis=consecutive,
            )
        )
        scales = []
        for overflow in overflows:
            scales.append(scaler.scale)
            scaler.update(bool(overflow))
        expected = loss_scale_rules(
            overflows, scale=32.0, window=window, hysteresis=hysteresis, consecutive=consecutive, min_scale=4.0
        )
        assert scales == expected, (overflows, window, scales, expected)
        if hysteresis == 1:
            unfloored = loss_scale_rules(
                overflows, scale=32.0, window=window, hysteresis=1, consecutive=False, min_scale=0.0
            )
            assert unfloored == grad_scaler_scales(overflows, 32.0, window), (overflows, window)
