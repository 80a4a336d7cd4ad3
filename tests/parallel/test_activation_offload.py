"""Activation offload (parallel/activation_offload.py: --cpu-offloading, DeepSpeed's cpu_checkpointing).

- The loss curve and the final parameters are bitwise those of the same layout without offload (the
  tensors come back as they left), under a pipeline with microbatches in flight, tensor and sequence
  parallelism (tp 2 x pp 2, one of each chunk's two layers offloaded; again under the zero-bubble
  zb-h1 schedule, whose deferred weight-gradient pass W reads the fetched copies of its GEMMs' inputs
  after B: exact against one process through tests/parallel/pipeline/test_zero_bubble.py's zb-h1
  layouts), and under ZeRO-3 with full
  recomputation (dp 2, every layer's checkpointed input offloaded: DeepSpeed's cpu_checkpointing); the
  host held something, and nothing once each backward was done.
- Under the stream sanitizer a step runs clean (the copies to the host and back on the copy stream,
  each ordered by an event; also beside ZeRO-3's gathers with selective recomputation), and a fetch
  the compute stream does not wait for is caught.
- The planner's host bytes are what the offload held, and the device's activations fall by them.
Planted to see them fail: a host copy off by one part in 2^20 fails the bitwise test (the tp 2 x pp 2
layout's parameters); dropping the compute stream's wait for a fetch (Event.wait a no-op, kept as a test)
and dropping the copy stream's wait for the forward before the copies to the host (read-after-write on
the (2, 16, 32) layer input, main -> copy) each fail under the sanitizer.
"""

from __future__ import annotations

import pytest
import torch

from megazero.core.stream_check import StreamOrderError, checking
from megazero.parallel import activation_offload
from megazero.parallel.process_groups import ProcessGroups
from megazero.config.memory_estimate import plan_bytes
from tests.layouts import (
    assemble_params,
    last_stage_result,
    layout_worker,
    run_training,
    small_config,
    with_padded_vocab,
)

STEPS = 3
FULL_UNIFORM = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _offloaded(cfg, layers: int):
    cfg.parallel.cpu_offloading_num_layers = layers
    return cfg


def _layouts():
    """(name, config, dp) pairs: each layout without offload, then with it."""
    pipeline = dict(tp=2, pp=2, sequence_parallel=True, steps=STEPS, global_batch=8)
    zero3 = dict(stage=3, steps=STEPS, global_batch=8, model_extra=FULL_UNIFORM)
    zero_bubble = dict(pipeline, schedule="zb-h1")
    return [
        ("tp2 pp2 sp", small_config(**pipeline), 1),
        ("tp2 pp2 sp, offload 1", _offloaded(small_config(**pipeline), 1), 1),
        ("tp2 pp2 sp zb-h1", small_config(**zero_bubble), 1),
        ("tp2 pp2 sp zb-h1, offload 1", _offloaded(small_config(**zero_bubble), 1), 1),
        ("zero-3 full recompute", small_config(**zero3), 2),
        ("zero-3 full recompute, offload 4", _offloaded(small_config(**zero3), 4), 2),
    ]


def offload_worker(ctx, layouts):
    out = []
    for _, cfg, dp in layouts:
        held = {}
        result = layout_worker(ctx, cfg, dp, on_setup=lambda state: held.update(offload=state.offload))
        if result is not None and held["offload"] is not None:
            result["host"] = (held["offload"].peak_host_bytes, held["offload"].host_bytes)
        out.append(result)
    return out


def test_offload_is_bitwise_invisible_in_the_loss_curve(dist_pool):
    layouts = _layouts()
    per_rank = dist_pool(4).run(offload_worker, layouts)
    per_layout = [list(results) for results in zip(*per_rank)]
    for k in range(0, len(layouts), 2):
        plain, offloaded = per_layout[k], per_layout[k + 1]
        name = layouts[k + 1][0]
        assert last_stage_result(offloaded)["losses"] == last_stage_result(plain)["losses"], name
        want, got = assemble_params(plain), assemble_params(offloaded)
        assert want.keys() == got.keys()
        assert all(torch.equal(got[n], want[n]) for n in want), name
        for result in filter(None, offloaded):
            peak, left = result["host"]
            assert peak > 0 and left == 0, (name, result["coords"], peak, left)


@pytest.mark.parametrize("model,rtol", [(FULL_UNIFORM, 0.0), ({}, 0.15)], ids=["checkpoints", "layers"])
def test_the_planner_counts_what_leaves_the_device(model, rtol):
    """The planner's host bytes against what the offload held at its peak (a checkpoint's input exactly;
    a whole layer's saved set by Korthikanti's count), and its device activations fall by as much, less
    what the two units the backward brings back at a time add beyond the layer above them."""
    plain = small_config(steps=1, layers=4, global_batch=2, model_extra=model)
    cfg = _offloaded(small_config(steps=1, layers=4, global_batch=2, model_extra=model), 3)
    held = {}
    run_training(cfg, ProcessGroups.single(), on_setup=lambda state: held.update(offload=state.offload))
    measured = held["offload"].peak_host_bytes
    before, after = plan_bytes(with_padded_vocab(plain), 1), plan_bytes(cfg, 1)
    assert after["host_activations"] == pytest.approx(measured, rel=rtol) and before["host_activations"] == 0
    fall, host, unit = before["activations"] - after["activations"], after["host_activations"], measured / 3
    assert host - unit <= fall <= host and (fall == host or model != FULL_UNIFORM), (fall, host, unit)


def _checked_step(layers: int, stage: int = 0, **model):
    cfg = _offloaded(small_config(steps=1, layers=3, global_batch=4, stage=stage, model_extra=model), layers)
    with checking() as checker:
        result = run_training(cfg, ProcessGroups.single())
    return result, checker


@pytest.mark.parametrize(
    "stage,model",
    [(0, {}), (0, FULL_UNIFORM), (3, {"recompute_granularity": "selective"})],
    ids=["layers", "checkpoints", "zero-3 selective"],
)
def test_a_step_runs_clean_under_the_stream_sanitizer(stage, model):
    result, checker = _checked_step(2, stage, **model)
    assert checker.side_ops > 0 and torch.isfinite(torch.tensor(result["losses"])).all()


def test_a_fetch_the_compute_stream_does_not_wait_for_is_caught(monkeypatch):
    class Unwaited(activation_offload.Event):
        def wait(self, stream=None):
            pass

    monkeypatch.setattr(activation_offload, "Event", Unwaited)
    with pytest.raises(
        StreamOrderError,
        match=r"read-after-write race .* written on stream 'copy' .* read "
        r"on stream 'main'",
    ):
        _checked_step(2)
