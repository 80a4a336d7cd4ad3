"""pretrain_gpt.py's checkpoint flags: save and resume, --exit-interval, SIGTERM (Slurm preemption),
--ckpt-keep-last, and the one-line refusals (before any process group) of bad --save/--load."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.driver import REPO, TINY
from tests.driver import run_main as _main
from tests.launching import run_torchrun
from tests.metrics_reading import metrics_records


def _iterations(metrics: Path) -> list[int]:
    return [r["iteration"] for r in metrics_records(metrics)]


def test_save_resume_exit_interval_and_keep_last(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = _main(
        TINY
        + [
            "--train-iters",
            "8",
            "--save",
            "ck",
            "--save-interval",
            "2",
            "--ckpt-keep-last",
            "2",
            "--exit-interval",
            "5",
            "--metrics-file",
            "a.jsonl",
        ],
        capsys,
    )
    assert code == 0
    # every save says what it wrote, why and where; the last line says how to go on
    saves = [line for line in out.out.splitlines() if "saved checkpoint" in line]
    assert [line.split(" MiB")[0].rsplit(" (", 1)[0] for line in saves] == [
        " saved checkpoint (--save-interval 2) of iteration 2: ck/iter_0000002",
        " saved checkpoint (--save-interval 2) of iteration 4: ck/iter_0000004",
        " saved checkpoint (stopping: --exit-interval 5) of iteration 5: ck/iter_0000005",
    ], saves
    assert out.out.splitlines()[-1].endswith("checkpoints in ck (go on with --load ck)")
    assert _iterations(tmp_path / "a.jsonl") == [1, 2, 3, 4, 5], "stops after the multiple of 5"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["iter_0000004", "iter_0000005", "latest"]
    code, out = _main(
        TINY + ["--train-iters", "8", "--save", "ck", "--load", "ck", "--metrics-file", "b.jsonl"], capsys
    )
    assert code == 0 and "loaded weights and optimizer from ck/iter_0000005" in out.out
    assert _iterations(tmp_path / "b.jsonl") == [6, 7, 8]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "iter_0000008"
    # the same line again (the README's main job run twice): nothing to train, nothing rewritten
    written = (tmp_path / "ck" / "iter_0000008" / "metadata.json").stat().st_mtime_ns
    code, out = _main(
        TINY + ["--train-iters", "8", "--save", "ck", "--load", "ck", "--metrics-file", "c.jsonl"], capsys
    )
    assert code == 0 and "--train-iters 8 is done; raise --train-iters to train on" in out.out
    assert "saved checkpoint" not in out.out, out.out
    assert (tmp_path / "ck" / "iter_0000008" / "metadata.json").stat().st_mtime_ns == written


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--load", "nowhere"], "--load nowhere: no such directory"),
        (["--save", "afile"], "--save afile is a file, not a directory"),
        (["--save", "other"], "--save other holds checkpoints of another run"),
        (["--save-interval", "2"], "need --save FOLDER"),
        (["--finetune"], "--finetune needs --load FOLDER"),
        (
            ["--load", "other", "--hidden-size", "32"],
            "differs from this run's in a setting: --hidden-size 64 (this run: "
            "--hidden-size 32); pass --hidden-size 64",
        ),
        # the tokenizer flags left out: the checkpoint's own tokenizer is named, with the flags for it
        (
            ["--load", "other", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"],
            "the checkpoint keeps the tokenizer it was trained with (SentencePieceTokenizer, vocab 8192) (this run: vocab "
            "300); pass "
            "--tokenizer-type SentencePieceTokenizer --tokenizer-model other/iter_0000001/tokenizer/tokenizer.model",
        ),
        # a longer run: the flag the user changed is named, not the decay it derives
        (
            ["--load", "other", "--train-iters", "3"],
            "--train-iters 3 differs from the checkpoint's run (1), and "
            "the lr schedule follows it (decay over 3 iterations (checkpoint: 1))",
        ),
        (
            ["--load", "other", "--lr-decay-iters", "3"],
            "the lr schedule differs from the checkpoint's: --lr-decay-iters 3 (checkpoint: 1)",
        ),
        # another micro batch (as at another layout): the global batch and the micro batch in one line
        # (planted: naming only the global batch, as before, fails)
        (
            ["--load", "other", "--micro-batch-size", "3"],
            "--global-batch-size 3 differs from the checkpoint's 8; "
            "resuming reads samples where it stopped only with the same global batch: pass --global-batch-size 8 with "
            "--micro-batch-size 8 or 4 or 2 (--micro-batch-size 3 x data-parallel size 1 = 3 does not divide 8)",
        ),
    ],
)
def test_bad_checkpoint_flags_fail_in_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    code, _ = _main(TINY + ["--train-iters", "1", "--save", "other"], capsys)
    assert code == 0
    before = sorted(p.name for p in (tmp_path / "other").iterdir())
    code, out = _main(TINY + ["--train-iters", "1"] + argv, capsys)
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.err
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == before, "nothing saved is touched"


def test_resume_idiom_starts_from_scratch_with_a_notice(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = _main(TINY + ["--train-iters", "1", "--save", "new", "--load", "new"], capsys)
    assert code == 0 and "no checkpoint there yet; training starts from scratch" in out.out
    assert (tmp_path / "new" / "latest").read_text().strip() == "iter_0000001"


def test_sigterm_finishes_the_step_saves_and_exits_zero(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "pretrain_gpt.py"),
            *TINY,
            "--train-iters",
            "100000",
            "--save",
            str(tmp_path / "ck"),
            "--exit-signal-handler",
            "--metrics-file",
            str(metrics),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "hang"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    assert "(SIGTERM)" in out
    last = _iterations(metrics)[-1]
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"iter_{last:07d}"


def test_torchrun_save_then_load_at_another_layout(tmp_path):
    """2 ranks (tp 2, ZeRO-3) save through the driver; one process (ZeRO-1) loads and goes on."""
    two = run_torchrun(
        2,
        [
            str(REPO / "pretrain_gpt.py"),
            *TINY,
            "--train-iters",
            "2",
            "--lr-decay-iters",
            "4",  # the schedule of the 4-iteration run that resumes
            "--tensor-model-parallel-size",
            "2",
            "--zero-stage",
            "3",
            "--save",
            "ck",
        ],
        tmp_path,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run(
        [
            sys.executable,
            str(REPO / "pretrain_gpt.py"),
            *TINY,
            "--train-iters",
            "4",
            "--zero-stage",
            "1",
            "--load",
            "ck",
            "--save",
            "ck",
            "--metrics-file",
            "m.jsonl",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "loaded weights and optimizer from ck/iter_0000002" in one.stdout
    assert _iterations(tmp_path / "m.jsonl") == [3, 4]


def test_a_resume_at_another_data_parallel_size_names_every_batch_flag_it_needs():
    """The checkpoint's global batch 8 at data-parallel size 4 with micro batch 4 (its 2 ranks' run
    resumed on 4): one line with both flags; at data-parallel size 3 no micro batch fits 8. And the
    flags' own check (the global batch given, not divisible) names the micro batches that fit."""
    from megazero.checkpoint.resume import batch_mismatch
    from megazero.config.train_flags import config_from_args, parse_args
    from megazero.core.errors import UsageError

    line = batch_mismatch(8, 16, 4, 4)
    assert "pass --global-batch-size 8 with --micro-batch-size 2 or 1 (--micro-batch-size 4 x data-parallel" in line
    assert "no micro batch splits 8 samples over data-parallel size 3" in batch_mismatch(8, 6, 2, 3)
    assert batch_mismatch(8, 16, 2, 4).endswith("pass --global-batch-size 8 (or use --finetune)")
    with pytest.raises(UsageError, match="= 16; a micro batch of 2 or 1 fits it"):
        config_from_args(parse_args(["--global-batch-size", "8", "--micro-batch-size", "4"]), world_size=4)
