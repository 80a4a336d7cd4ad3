"""Operating a real run: a full disk, killed and stopped ranks, Ctrl-C, torchrun restarts, the lr
schedule on resume, file modes, and the edges a cluster user meets (--help, cosmetic DeepSpeed keys,
--clip-grad inf, torchrun's error file).

The torchrun cases run real torchrun with 2 ranks on a tiny model; each launch checks several things
(the line a rank prints, the summary torchrun prints, what is on disk). The others run in-process or
in the session's gloo pool. Timeouts only catch hangs.
"""

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.driver import REPO, TINY
from tests.driver import run_main as _main
from tests.launching import Torchrun
from tests.metrics_reading import loss_curve, metrics_records
from megazero.checkpoint import CheckpointReader
from tests.layouts import setup_training

sys.path.insert(0, str(REPO))
from tools import convert_checkpoint  # noqa: E402

TORCHRUN_FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
]


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line.lower() or "Traceback" in line]


# --- torchrun: lost, stopped and interrupted ranks, restarts, a full disk --------------------------


def test_a_run_killed_once_restarts_to_the_straight_curve(tmp_path):
    """kill -9 of rank 1 mid-run under `torchrun --max-restarts 1 ... --save D --load D`: rank 0 prints
    one line naming rank 1 (no gloo traceback), torchrun restarts both ranks, they resume from D, and
    the finished fp32 curve (dropout on) equals the uninterrupted run's bitwise. The kill lands while
    rank 0 waits in a collective (rank 1 is stopped first, until rank 0 uses no CPU); torchrun polls
    its workers every 5 s here so that rank 0 gets to print before it is told to stop (polling every
    second, it lost that race on a machine with a load of 25). (Planted: without the attempt
    prefix on the process group's store the restarted attempt fails in gloo's connectFullMesh; with
    peer_failure_line returning None rank 0 prints a traceback.)"""
    common = TORCHRUN_FLAGS + ["--train-iters", "10"]
    straight = Torchrun(tmp_path, common + ["--metrics-file", "straight.jsonl", "--run-dir", "a"])
    code, err = straight.finish()
    assert code == 0, err[-3000:]
    killed = Torchrun(
        tmp_path,
        common
        + ["--save", "ck", "--load", "ck", "--save-interval", "2", "--metrics-file", "killed.jsonl", "--run-dir", "b"],
        "--max-restarts",
        "1",
        "--monitor-interval",
        "5",
    )
    killed.wait_for(lambda: len(metrics_records(tmp_path / "killed.jsonl", missing_ok=True)) >= 5)
    victim = killed.rank_pid(1)
    os.kill(victim, signal.SIGSTOP)
    killed.wait_until_blocked(0)  # rank 0 now waits for rank 1 in a collective
    os.kill(victim, signal.SIGKILL)
    code, err = killed.finish()
    assert code == 0, err[-3000:]
    first = killed.log(0, 0)
    assert _error_lines(first) == [next(line for line in first.splitlines() if line.startswith("error:"))], first
    assert "error: rank 0: lost rank 1 (its process ended) during " in first, first
    assert "Connection reset" not in first + err and "Traceback" not in first, first
    resumed = killed.log(1, 0, "stdout")
    assert "loaded weights and optimizer from ck/iter_" in resumed and "RNG states restored" in resumed, resumed
    assert loss_curve(tmp_path / "killed.jsonl") == loss_curve(tmp_path / "straight.jsonl")
    assert sorted(loss_curve(tmp_path / "straight.jsonl")) == list(range(1, 11))


def test_a_stopped_rank_ends_the_job_within_the_timeout(tmp_path):
    """SIGSTOP of rank 1 with --distributed-timeout-minutes 0.2 (12 s) and the heartbeat off: rank 0's
    collective gives up after the timeout and prints one line naming rank 1 (stopped) and the
    collective waited on; the same line is torchrun's root cause. (torchrun would stop the stopped
    process itself, with SIGKILL after its 30 s grace; the test kills it at once to spare that wait.)
    (Planted: without the timeout on the groups made by new_group, gloo's default 30 minutes applies
    and the wait below fails as a hang.)"""
    run = Torchrun(
        tmp_path,
        TORCHRUN_FLAGS
        + [
            "--train-iters",
            "3000",
            "--distributed-timeout-minutes",
            "0.2",
            "--heartbeat-timeout-minutes",
            "0",
            "--metrics-file",
            "m.jsonl",
            "--run-dir",
            "r",
        ],
    )
    waited, code, err = run.stop_rank_until_said(
        1, lambda: len(metrics_records(tmp_path / "m.jsonl", missing_ok=True)) >= 3, timeout=12 + 120
    )
    line = next(x for x in run.log(0, 0).splitlines() if x.startswith("error:"))
    assert line.startswith("error: rank 0: no answer within --distributed-timeout-minutes 0.2 during "), line
    assert "(rank 1: its process is stopped" in line and "Traceback" not in run.log(0, 0), line
    assert waited >= 6, f"the line came {waited:.1f} s after the stop, before any timeout could pass"
    assert code != 0 and f"traceback : {line[len('error: ') :]}" in err, err[-3000:]


def test_a_stopped_rank_is_named_by_its_heartbeat_before_the_backend_times_out(tmp_path):
    """SIGSTOP of rank 1 with the backend's timeout at 10 minutes and megazero's heartbeat at 0.25
    (15 s): rank 0 names rank 1 (stopped) and the collective it waited in, from the heartbeat alone,
    as it must under NCCL, whose watchdog aborts with no Python exception; the line is torchrun's
    root cause. (Planted: with the heartbeat off, --heartbeat-timeout-minutes 0, nothing is printed
    within the wait below and it fails as a hang.)"""
    run = Torchrun(
        tmp_path,
        TORCHRUN_FLAGS
        + [
            "--train-iters",
            "3000",
            "--distributed-timeout-minutes",
            "10",
            "--heartbeat-timeout-minutes",
            "0.25",
            "--metrics-file",
            "m.jsonl",
            "--run-dir",
            "r",
        ],
    )
    waited, code, err = run.stop_rank_until_said(
        1, lambda: len(metrics_records(tmp_path / "m.jsonl", missing_ok=True)) >= 3, timeout=15 + 120
    )
    line = next(x for x in run.log(0, 0).splitlines() if x.startswith("error:"))
    assert line.startswith(
        "error: rank 0: rank 1 went silent (its process is stopped (SIGSTOP, or a debugger)): no heartbeat for "
    ), line
    assert (
        "(--heartbeat-timeout-minutes 0.25); rank 0 waited for it in " in line
        and "over the dp group (ranks [0, 1])" in line
        and "rank 1's last collective: " in line
    ), line
    # The silence is measured from the last beat rank 0 saw, up to a beat interval before the stop.
    silent_for = int(line.split("no heartbeat for ")[1].split(" s")[0])
    assert "Traceback" not in run.log(0, 0) and silent_for >= 15 and waited < 600, (waited, line)
    assert code != 0 and f"traceback : {line[len('error: ') :]}" in err, err[-3000:]


@pytest.mark.parametrize("handler", [True, False], ids=["exit-signal-handler", "plain"])
def test_ctrl_c_under_torchrun(tmp_path, handler):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it, and again from torchrun).
    With --exit-signal-handler every rank finishes the step, saves and exits 0: `latest` names the
    last logged iteration. Without it every rank ends, one of them printing "interrupted at iteration
    N; last checkpoint: ..." and no rank a KeyboardInterrupt. (Planted: without SIGINT among the
    handler's signals no checkpoint of the last iteration is written; without Interrupts the ranks
    print KeyboardInterrupt tracebacks.)"""
    argv = TORCHRUN_FLAGS + [
        "--train-iters",
        "3000",
        "--save",
        "ck",
        "--save-interval",
        "2",
        "--metrics-file",
        "m.jsonl",
        "--run-dir",
        "r",
    ]
    run = Torchrun(tmp_path, argv + (["--exit-signal-handler"] if handler else []))
    run.wait_for(lambda: len(metrics_records(tmp_path / "m.jsonl", missing_ok=True)) >= 3)
    os.killpg(run.proc.pid, signal.SIGINT)
    run.finish(timeout=600)  # torchrun itself ends with its own SignalException report
    ranks = [run.log(0, rank) for rank in (0, 1)]
    assert not any("KeyboardInterrupt" in text or "Traceback" in text for text in ranks), ranks
    last = max(loss_curve(tmp_path / "m.jsonl"))
    latest = (tmp_path / "ck" / "latest").read_text().strip()
    if handler:
        assert latest == f"iter_{last:07d}" and not any(_error_lines(text) for text in ranks), ranks
        assert f"stopping after iteration {last} (SIGINT)" in run.log(0, 0, "stdout")
        assert CheckpointReader(tmp_path / "ck").metadata["iteration"] == last
    else:
        lines = [line for text in ranks for line in text.splitlines() if "interrupted" in line or "rror" in line]
        assert len(lines) == 1 and lines[0].startswith("interrupted at iteration "), ranks
        assert lines[0].endswith(f"; last checkpoint: ck/{latest} (resume with --load ck)"), lines


def test_a_full_disk_keeps_training_and_the_last_checkpoint(tmp_path):
    """--save on a 12 MiB tmpfs (one checkpoint of this model fits, a second does not): the save at
    iteration 2 is written; the one at 4 is refused before anything is written (one line naming
    --save, the bytes needed and free) and training goes on; the final save at 6 is refused the same
    way and ends the run, its line torchrun's root cause. `latest` still names iteration 2, which
    loads, and no temporary directory is left. (Planted: without check_room the write fails midway
    with ENOSPC, which the in-process test below covers.)"""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?); the patched-write tests cover a full disk")
    try:
        run = Torchrun(
            tmp_path,
            TORCHRUN_FLAGS
            + [
                "--train-iters",
                "6",
                "--save",
                str(disk / "ck"),
                "--save-interval",
                "2",
                "--metrics-file",
                "m.jsonl",
                "--run-dir",
                "r",
            ],
        )
        code, err = run.finish()
        assert code != 0, err[-3000:]
        assert sorted(loss_curve(tmp_path / "m.jsonl")) == [1, 2, 3, 4, 5, 6], "training went on"
        warning = next(x for x in run.log(0, 0, "stdout").splitlines() if "warning:" in x)
        assert f"--save {disk / 'ck'}: no room for the checkpoint of iteration 4: it needs " in warning, warning
        assert "MiB are free there; nothing was written and latest still names iter_0000002" in warning
        first = run.log(0, 0)
        assert len(_error_lines(first)) == 1 and "no room for the checkpoint of iteration 6" in first, first
        assert "Traceback" not in first + run.log(0, 1)
        assert f"traceback : --save {disk / 'ck'}: no room for the checkpoint of iteration 6" in err, err[-3000:]
        assert sorted(p.name for p in (disk / "ck").iterdir()) == ["iter_0000002", "latest"]
        reader = CheckpointReader(disk / "ck")
        assert reader.metadata["iteration"] == 2 and all(reader.full_tensor(n).isfinite().all() for n in reader.names)
    finally:
        subprocess.run(["umount", "-l", str(disk)])


# --- in-process and pool: failed writes, the save policy, the schedule, modes, edges -------------


def failing_save_worker(ctx, directory, fail_rank, phase, code):
    """Two ranks save at iteration 1, then at iteration 2 rank `fail_rank` fails with errno `code`
    while writing its shard ("write") or rank 0 while committing ("commit"); returns the error."""
    from tests.layouts import small_config
    from megazero.checkpoint import CheckpointSaver, SaveError
    import megazero.checkpoint.saver as saver_module
    from megazero.parallel.topology import Topology
    from megazero.training import train_step

    groups = ctx.groups(Topology(world_size=2, tp=1))
    cfg = small_config(stage=2, steps=2)
    state, source = setup_training(cfg, groups)
    saver = CheckpointSaver(directory, "disk-run")
    train_step(state, source.batch(0), 1e-3)
    saver.save(state, cfg.global_batch_size)

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    real = saver_module.save_file, saver_module.commit_directory
    if ctx.rank == fail_rank:
        if phase == "write":
            saver_module.save_file = fail
        else:
            saver_module.commit_directory = fail
    train_step(state, source.batch(1), 1e-3)
    try:
        saver.save(state, 2 * cfg.global_batch_size)
    except SaveError as err:
        return str(err)
    finally:
        saver_module.save_file, saver_module.commit_directory = real
    return None


@pytest.mark.parametrize(
    "fail_rank,phase,code", [(1, "write", errno.ENOSPC), (0, "write", errno.EIO), (0, "commit", errno.ENOSPC)]
)
def test_a_failed_write_is_one_agreed_line_and_keeps_the_previous_checkpoint(
    dist_pool, tmp_path, fail_rank, phase, code
):
    """ENOSPC or EIO while one rank writes its shard (or rank 0 commits): every rank raises the same
    SaveError naming that rank and the reason, the temporary directory is gone and `latest` still
    names the previous checkpoint, which loads. (Planted: with agree() skipped in finalize the other
    rank commits a checkpoint with a missing shard, or waits forever.)"""
    errors = dist_pool(2).run(failing_save_worker, str(tmp_path), fail_rank, phase, code)
    what = "write its shard of the checkpoint" if phase == "write" else "commit the checkpoint"
    assert (
        errors[0]
        == errors[1]
        == (
            f"--save {tmp_path}: rank {fail_rank} could not {what} of iteration 2 "
            f"({os.strerror(code)}); the partial checkpoint was removed and latest "
            f"still names iter_0000001"
        )
    ), errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest"]
    assert CheckpointReader(tmp_path).metadata["iteration"] == 1


def test_a_failed_save_keeps_training_unless_asked_to_stop(tmp_path, capsys, monkeypatch):
    """The filesystem has room for the first save only: the run logs one warning per refused save and
    trains on; the last save's refusal ends it (exit 1, one line). With --exit-on-save-failure the
    first refusal stops the run. (Planted: a policy that re-raises every SaveError stops at 4.)"""
    import megazero.checkpoint.saver as saver_module

    monkeypatch.chdir(tmp_path)
    saves = []

    def room(folder):
        saves.append(folder)
        return 1 << 40 if len(saves) == 1 else 1000

    monkeypatch.setattr(saver_module, "free_bytes", room)
    argv = TINY + ["--train-iters", "6", "--save", "ck", "--save-interval", "2"]
    code, out = _main(argv + ["--metrics-file", "a.jsonl"], capsys)
    assert code == 1 and sorted(loss_curve(tmp_path / "a.jsonl")) == [1, 2, 3, 4, 5, 6]
    warnings = [x for x in out.out.splitlines() if "warning:" in x]
    assert len(warnings) == 1 and "no room for the checkpoint of iteration 4" in warnings[0], out.out
    # (progress lines, "building train indices ...", may come first when the indices are not cached)
    errors = [line for line in out.err.splitlines() if not line.startswith("building ")]
    assert len(errors) == 1 and errors[0].startswith("error: --save ck: no room for the checkpoint of iteration 6"), (
        out.err
    )
    saves.clear()
    code, out = _main(argv + ["--save", "ck2", "--exit-on-save-failure", "--metrics-file", "b.jsonl"], capsys)
    assert code == 1 and sorted(loss_curve(tmp_path / "b.jsonl")) == [1, 2, 3, 4], out.err
    assert (
        out.err.startswith("error: --save ck2: no room for the checkpoint of iteration 4") and "warning" not in out.out
    )
    assert (tmp_path / "ck2" / "latest").read_text().strip() == "iter_0000002"


def test_the_lr_schedule_on_resume_follows_megatron(tmp_path, capsys, monkeypatch):
    """A checkpoint of a 6-iteration schedule resumed with --train-iters 12: refused naming both
    values, unless --override-opt_param-scheduler (the flags' schedule) or
    --use-checkpoint-opt_param-scheduler (the checkpoint's) says which; both at once are refused.
    (Planted: schedule_on_resume returning the flags' settings unchecked lets the first resume run.)"""
    from megazero.config.train_flags import config_from_args, parse_args
    from megazero.training.lr_schedule import learning_rate

    monkeypatch.chdir(tmp_path)
    assert _main(TINY + ["--train-iters", "6", "--exit-interval", "3", "--save", "ck"], capsys)[0] == 0
    resume = TINY + ["--train-iters", "12", "--save", "ck", "--load", "ck", "--exit-interval", "4"]
    code, out = _main(resume, capsys)
    assert code == 2 and out.err.count("\n") == 1, out.err
    # the flag the user changed is named, with the schedule it derives, not flags never typed
    assert "--train-iters 12 differs from the checkpoint's run (6)" in out.err, out.err
    assert "decay over 12 iterations (checkpoint: 6)" in out.err and "--lr-decay-iters" not in out.err
    assert "--override-opt_param-scheduler" in out.err
    assert (
        "--use-checkpoint-opt_param-scheduler" in out.err
        and (tmp_path / "ck" / "latest").read_text() == "iter_0000003\n"
    )
    lrs = {}
    for flag, iters in (("--use-checkpoint-opt_param-scheduler", 6), ("--override-opt_param-scheduler", 12)):
        code, out = _main(resume + [flag, "--metrics-file", f"m{iters}.jsonl", "--save", f"ck{iters}"], capsys)
        assert code == 0 and "lr schedule of the " in out.out, out.err
        lrs[flag] = metrics_records(tmp_path / f"m{iters}.jsonl")[0]["lr"]
        optimizer = config_from_args(parse_args(TINY + ["--train-iters", str(iters)])).optimizer
        assert lrs[flag] == pytest.approx(learning_rate(optimizer, 4, iters), rel=1e-12), (flag, lrs)
    assert lrs["--use-checkpoint-opt_param-scheduler"] != lrs["--override-opt_param-scheduler"]
    code, out = _main(resume + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], capsys)
    assert code == 2 and "choose one" in out.err


def test_files_follow_the_umask(tmp_path, capsys, monkeypatch):
    """Checkpoint shards (which safetensors writes 0600), metadata, tokenizer files and the exported
    model get the mode the umask gives: 0644 under 022, 0640 under 027. (Planted: apply_umask doing
    nothing leaves the shards 0600.)"""
    monkeypatch.chdir(tmp_path)
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(umask)
        try:
            assert _main(TINY + ["--train-iters", "1", "--save", f"ck{umask}"], capsys)[0] == 0
            convert_checkpoint.export_hf(f"ck{umask}", f"hf{umask}")
        finally:
            os.umask(old)
        files = [
            p for p in [*(tmp_path / f"ck{umask}").rglob("*"), *(tmp_path / f"hf{umask}").iterdir()] if p.is_file()
        ]
        assert any(p.name.endswith(".safetensors") for p in files) and len(files) >= 8
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(mode) for p in files}


def test_cosmetic_deepspeed_keys_yield_to_flags_and_math_keys_still_refuse(tmp_path):
    """steps_per_print (DeepSpeed's console cadence, 2000 in Hugging Face's examples) loses to
    --log-interval with a note; dump_state is noted; a key that changes the math still refuses a
    contradicting flag. (Planted: removing log_interval from COSMETIC brings back the refusal.)"""
    from megazero.config.train_flags import config_from_args, parse_args
    from megazero.core.errors import UsageError

    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {"steps_per_print": 2000, "dump_state": True, "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}}
        )
    )
    cfg = config_from_args(parse_args(["--zero-config", str(path), "--log-interval", "1"]))
    assert cfg.log_interval == 1 and cfg.optimizer.clip_grad == 0.5
    assert f"--log-interval 1 wins over steps_per_print = 2000 in {path} (DeepSpeed's console cadence)" in cfg.notes
    assert any(n.startswith(f"{path}: dump_state = true has no effect") for n in cfg.notes), cfg.notes
    assert config_from_args(parse_args(["--zero-config", str(path)])).log_interval == 2000
    with pytest.raises(UsageError, match="--clip-grad 1.0 contradicts gradient_clipping = 0.5"):
        config_from_args(parse_args(["--zero-config", str(path), "--clip-grad", "1.0"]))


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--clip-grad", "inf"], "error: --clip-grad must be finite (>= 0), got inf; 0 turns clipping off"),
        (["--lr", "nan"], "error: --lr must be finite (>= 0), got nan"),
        (["--distributed-timeout-minutes", "0"], "error: --distributed-timeout-minutes must be > 0, got 0.0"),
        (
            ["--distributed-timeout-minutes", "2", "--heartbeat-timeout-minutes", "3"],
            "error: --heartbeat-timeout-minutes 3 must be below --distributed-timeout-minutes 2: at the backend's timeout "
            "NCCL aborts the job naming no rank",
        ),
        (["--exit-signal", "SIGUSR1"], "error: --exit-signal SIGUSR1 needs --exit-signal-handler"),
        (["--exit-on-save-failure"], "error: --exit-on-save-failure needs --save FOLDER"),
    ],
)
def test_edge_flags_fail_in_one_line(capsys, argv, expected):
    code, out = _main(argv, capsys)
    assert code == 2 and out.err.count("\n") == 1 and out.err.startswith(expected), out.err


def test_help_opens_with_one_line_per_flag_group(capsys):
    """The first screen: a one-line usage, then one line per flag group, then the flags (argparse's
    85-line synopsis is gone). (Planted: dropping usage= from the parser fails the first check.)"""
    from megazero.run import launch
    from megazero.config.flags import GROUPS

    with pytest.raises(SystemExit):
        launch.main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("usage: python pretrain_gpt.py [FLAGS]") and len(lines[0]) < 100, lines[:3]
    first_flag = next(i for i, line in enumerate(lines) if line.lstrip().startswith("--"))
    groups = [
        line.split()[0] for line in lines[:first_flag] if line.startswith("  ") and not line.lstrip().startswith("-")
    ]
    assert first_flag < 20 and len(groups) == len(GROUPS), lines[:first_flag]
    assert all(f"\n{group}:\n" in "\n".join(lines) for group in GROUPS)


def test_torchrun_shows_the_error_file_line_as_the_root_cause(tmp_path):
    """The error file megazero writes is read back by torch's own ProcessFailure: torchrun's summary
    shows the line where it would show a traceback."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from megazero.run import failures

    path = tmp_path / "error.json"
    failures.write_error_file(str(path), "rank 0: lost rank 1 (its process ended) during all_reduce")
    summary = ChildFailedError("pretrain_gpt.py", {0: ProcessFailure(0, 123, 1, str(path))}).format_msg()
    assert "traceback : rank 0: lost rank 1 (its process ended) during all_reduce" in summary, summary


def test_one_visible_gpu_per_rank_is_cuda_0(monkeypatch):
    """CUDA_VISIBLE_DEVICES set per task (one GPU visible to each rank, as some Slurm set-ups do): every
    rank takes cuda:0, not cuda:LOCAL_RANK; with the node's GPUs all visible, its local rank; fewer
    GPUs than the node's ranks is one line naming both counts."""
    from megazero.core.errors import UsageError
    from megazero.run.launch import cuda_index

    assert [cuda_index(r, 8, 1) for r in range(8)] == [0] * 8
    assert [cuda_index(r, 8, 8) for r in range(8)] == list(range(8))
    assert cuda_index(1, 2, 8) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(
        UsageError,
        match=r"^8 ranks on this node but 4 GPUs visible \(CUDA_VISIBLE_DEVICES=0,1,2,3\): "
        r"launch --nproc-per-node 4, or make one GPU per rank visible$",
    ):
        cuda_index(1, 8, 4)
