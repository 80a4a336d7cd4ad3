"""A run that diverges stops (megazero.training.divergence): one line, exit code 3, nothing of the
diverged state saved, and `latest` (and --ckpt-keep-last) keeps the last checkpoint a finite loss
followed; fp16 under a static scale that zeroes every gradient says so at its first step. Tiny runs
in-process, a few steps each."""

import json

import pytest

from tests.driver import TINY
from tests.driver import run_main as _main
from megazero.checkpoint import CheckpointReader
from megazero.training.divergence import EXIT_DIVERGED, DivergenceWatch
from tests.metrics_reading import metrics_records

DIVERGING = TINY + [
    "--train-iters",
    "12",
    "--lr",
    "1e6",
    "--save",
    "ck",
    "--save-interval",
    "1",
    "--ckpt-keep-last",
    "1",
]


def _checkpoints(folder):
    return {p.name: json.loads((p / "metadata.json").read_text())["loss_finite"] for p in folder.glob("iter_*")}


@pytest.mark.parametrize("check", ["default", "off"])
def test_lr_1e6_stops_in_one_line_and_keeps_the_last_healthy_checkpoint(tmp_path, capsys, monkeypatch, check):
    """--lr 1e6: iteration 2 (the first at that rate) blows the weights up, iteration 3's loss is nan.
    By default (--check-for-nan-in-loss-and-grad) the run stops there; with the check off, after
    --max-consecutive-skipped-steps 2 skipped steps (within N + 2 = 4 steps). Exit 3, one line naming
    the checkpoint kept; every step before is in metrics.jsonl; no non-finite model is saved; `latest`
    names iteration 1 again (iteration 2 was saved from the weights that diverged) and --ckpt-keep-last
    1 kept it. (Planted: --ckpt-keep-last applied at each commit, as before, deletes iteration 1.)"""
    monkeypatch.chdir(tmp_path)
    argv = (
        DIVERGING
        + (["--no-check-for-nan-in-loss-and-grad", "--max-consecutive-skipped-steps", "2"] if check == "off" else [])
        + ["--metrics-file", "m.jsonl"]
    )
    code, out = _main(argv, capsys)
    last = 3 if check == "default" else 4
    # (progress lines, "building train indices ...", come first when the indices are not cached)
    err = "".join(line for line in out.err.splitlines(True) if not line.startswith("building "))
    assert code == EXIT_DIVERGED and err.count("\n") == 1, (code, out.err)
    why = (
        "the loss is nan (--check-for-nan-in-loss-and-grad"
        if check == "default"
        else "2 steps in a row were skipped for a non-finite gradient (--max-consecutive-skipped-steps 2)"
    )
    assert err.startswith(f"error: iteration {last}: {why}"), out.err
    assert (
        "latest names ck/iter_0000001 again, the last checkpoint a finite loss followed (iter_0000002 was "
        "saved as the run diverged; resume with --load ck); lower --lr (now 1e+06)"
    ) in out.err, out.err
    assert [r["iteration"] for r in metrics_records(tmp_path / "m.jsonl")] == list(range(1, last + 1))
    assert _checkpoints(tmp_path / "ck") == {"iter_0000001": True, "iter_0000002": True}
    assert CheckpointReader(tmp_path / "ck").metadata["iteration"] == 1
    if check == "off":
        assert "iteration 3: not saved: its loss is nan (the model diverged)" in out.out, out.out


def test_a_static_fp16_scale_that_zeroes_every_gradient_is_said_at_the_first_step(tmp_path, capsys, monkeypatch):
    """--fp16 --loss-scale 1e-8: every fp16 gradient underflows to 0; the first step says so, once.
    (Planted: the warning's condition on grad_norm == 0 checking != 0 stays silent.)"""
    monkeypatch.chdir(tmp_path)
    code, out = _main(TINY + ["--train-iters", "2", "--fp16", "--loss-scale", "1e-8"], capsys)
    assert code == 0, out.err
    warnings = [line for line in out.out.splitlines() if "warning:" in line]
    assert warnings == [
        " warning: iteration 1: every gradient is 0 under the static loss scale 1e-08 "
        "(--loss-scale): the fp16 gradients underflow and nothing trains; raise --loss-scale, "
        "or leave it out for the dynamic scale"
    ], out.out


def test_overflows_of_the_dynamic_fp16_scale_are_its_business():
    """Under fp16's dynamic scale a non-finite gradient is the scale's signal to back off: the check
    lets it pass, up to --max-consecutive-skipped-steps in a row; a non-finite loss still stops."""
    watch = DivergenceWatch(dynamic_loss_scale=True, max_consecutive_skipped=3, lr=1e-3)
    assert watch.after_step(1, 9.0, float("inf"), True) == (None, None)
    assert watch.after_step(2, 9.0, float("nan"), True) == (None, None)
    assert watch.after_step(3, 9.0, 1.0, False) == (None, None)  # the count starts over
    assert [watch.after_step(it, 9.0, float("inf"), True)[0] is None for it in (4, 5, 6)] == [True, True, False]
    assert DivergenceWatch(dynamic_loss_scale=True).after_step(1, float("inf"), 1.0, False)[0] is not None
