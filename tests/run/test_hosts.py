"""Across hosts (tests/hosts.py: network namespaces joined by a bridge, torchrun on each): 2 hosts x 2
ranks train exactly as one host's 4 ranks (TP 2 x ZeRO-3 with a static rendezvous, PP 2 x ZeRO-1 with
c10d; fp32 losses, gradient norms and the saved checkpoint to rtol 1e-5), the checkpoint written by
both hosts to one shared path; a host whose name resolves to loopback is refused in one line before
anything connects, and one whose address does not answer (packets lost) is named in seconds; a host killed (kill -9 of its whole tree) or cut off (its link down: no process
ends, no socket closes) is named on the other host within --distributed-timeout-minutes, in one line
naming the lost host and its ranks, the job ends, and the checkpoint saved before still loads; with
--max-restarts 1 and c10d a worker killed on one host restarts both hosts, which resume exactly, and
with --nnodes 1:2 a host lost for good leaves the other to resume alone, resharded."""

import os
import signal
import time

import pytest
import torch

from megazero.checkpoint import CheckpointReader
from tests.hosts import Hosts, wait_all, wait_said, workers
from tests.metrics_reading import split_records

TIMEOUT_MINUTES = 0.5  # the heartbeat's is half: 15 s
MODEL = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "64",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--lr-warmup-iters",
    "1",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--num-workers",
    "0",
    "--distributed-timeout-minutes",
    str(TIMEOUT_MINUTES),
]
_ports = iter(range(29520, 29600))


@pytest.fixture(scope="module")
def made():
    with Hosts(2) as hosts:
        yield hosts


@pytest.fixture
def hosts(made):
    yield made
    made.reset()


def _losses(run_dir):
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in split_records(run_dir)]


def _errors(log) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if line.startswith("error: ")]


def _no_worker_traceback(log) -> None:
    text = log.read_text(errors="replace")
    assert 'pretrain_gpt.py", line' not in text, text[-3000:]  # every worker traceback passes there


@pytest.mark.parametrize(
    "layout,rdzv",
    [
        (["--tensor-model-parallel-size", "2", "--zero-stage", "3"], "static"),
        (["--pipeline-model-parallel-size", "2", "--zero-stage", "1"], "c10d"),
    ],
    ids=["tp2-zero3-static", "pp2-zero1-c10d"],
)
def test_two_hosts_train_as_one(hosts, tmp_path, layout, rdzv):
    flags = MODEL + layout + ["--train-iters", "4"]
    one, two = tmp_path / "one", tmp_path / "two"
    job = hosts.torchrun(
        0,
        1,
        4,
        flags + ["--run-dir", str(one), "--save", str(one / "ckpt")],
        tmp_path / "one.log",
        rdzv=rdzv,
        port=next(_ports),
    )
    assert wait_all([job], 300)[0][0] == 0, (tmp_path / "one.log").read_text()[-3000:]
    port = next(_ports)
    jobs = [
        hosts.torchrun(
            k,
            2,
            2,
            flags + ["--run-dir", str(two), "--save", str(two / "ckpt")],
            tmp_path / f"two{k}.log",
            rdzv=rdzv,
            port=port,
        )
        for k in range(2)
    ]
    ends = wait_all(jobs, 300)
    assert [code for code, _ in ends] == [0, 0], (tmp_path / "two1.log").read_text()[-3000:]
    expected, got = _losses(one), _losses(two)
    assert [r[0] for r in got] == [1, 2, 3, 4] == [r[0] for r in expected]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    print(f"across hosts ({rdzv}): {'bitwise' if got == expected else 'within rtol 1e-5'} of one host")
    reference, saved = CheckpointReader(one / "ckpt"), CheckpointReader(two / "ckpt")  # every rank's file, CRCs
    assert saved.names == reference.names
    for name in reference.names:
        torch.testing.assert_close(saved.full_tensor(name), reference.full_tensor(name), rtol=1e-5, atol=0)


def test_a_loopback_host_name_is_refused_before_connecting(hosts, tmp_path):
    hosts.set_names(loopback=True)  # mzh0 -> 127.0.1.1 on host 0, as Debian's /etc/hosts has it
    port = next(_ports)
    jobs = [
        hosts.torchrun(
            k,
            2,
            2,
            MODEL + ["--train-iters", "2", "--run-dir", str(tmp_path / "run")],
            tmp_path / f"{k}.log",
            port=port,
        )
        for k in range(2)
    ]
    ends = wait_all(jobs, 120)
    assert [code for code, _ in ends] == [1, 1], ends
    assert max(t for _, t in ends) < 60, ends  # ends at once: no connection attempt, no timeout
    [line] = _errors(tmp_path / "0.log")
    assert line.startswith(
        "error: this job spans hosts but host mzh0's process-group address is 127.0.1.1, a "
        "loopback address (the host name mzh0 resolves to it)"
    ), line
    assert "set GLOO_SOCKET_IFNAME to this host's network interface (here: eth0 10.77.0.1)" in line, line
    for k in range(2):
        log = (tmp_path / f"{k}.log").read_text()
        _no_worker_traceback(tmp_path / f"{k}.log")
        assert "exitcode  : 2" in log and line[len("error: ") :] in log  # torchrun's summary shows it
    print(f"loopback refusal: ends after {max(t for _, t in ends):.1f} s")


def test_an_unreachable_host_is_named_in_seconds(hosts, tmp_path):
    """Host 1's ranks offer an address (GLOO_SOCKET_IFNAME=side0) that host 0 routes to a gateway
    nobody holds: packets are lost, nothing refuses. Named in one line with the rank and address well
    before the 5-minute timeout; every host ends. (10.66 sorts below 10.77, so gloo has host 0's
    ranks connect to it: without the probe host 0 ends with gloo's "no route to host" and host 1
    waits on past 150 s. The other way round gloo's pairs would connect, by luck of the ordering.)"""
    ifname = hosts.offer_unreachable(1, to=0)
    port = next(_ports)
    flags = MODEL + ["--train-iters", "2", "--run-dir", str(tmp_path / "run"), "--distributed-timeout-minutes", "5"]
    jobs = [
        hosts.torchrun(
            k, 2, 2, flags, tmp_path / f"{k}.log", port=port, env={"GLOO_SOCKET_IFNAME": "eth0" if k == 0 else ifname}
        )
        for k in range(2)
    ]
    ends = wait_all(jobs, 150)
    assert [code for code, _ in ends] == [1, 1], (ends, (tmp_path / "0.log").read_text()[-3000:])
    assert max(t for _, t in ends) < 120, ends  # start-up (25-65 s loaded) and the probe, not the 300 s timeout
    [line] = _errors(tmp_path / "0.log")
    assert line.startswith("error: cannot reach rank 2 (host mzh1) at 10.66.0.2:"), line
    assert "GLOO_SOCKET_IFNAME=side0 there" in line, line
    for k in range(2):
        _no_worker_traceback(tmp_path / f"{k}.log")
        assert "exitcode  : 2" in (tmp_path / f"{k}.log").read_text()
    print(f"unreachable host: every host ends {max(t for _, t in ends):.1f} s after launch")


@pytest.mark.parametrize("how", ["kill", "cut"])
def test_a_lost_host_is_named_within_the_timeout(hosts, tmp_path, how):
    save = tmp_path / "ckpt"
    flags = MODEL + [
        "--zero-stage",
        "3",
        "--train-iters",
        "1000",
        "--save-interval",
        "2",
        "--save",
        str(save),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    port = next(_ports)
    jobs = [hosts.torchrun(k, 2, 2, flags, tmp_path / f"{k}.log", port=port) for k in range(2)]
    start = time.monotonic()
    while not (save / "latest").exists():
        assert time.monotonic() - start < 300 and jobs[0].poll() is None, (tmp_path / "0.log").read_text()[-3000:]
        time.sleep(0.2)
    (hosts.kill if how == "kill" else hosts.cut)(1)
    # The line naming the lost host comes within the timeout; the exits after it are torchrun's
    # teardown (35 s after a cut, measured under load), bounded by the hang catcher.
    watched = jobs if how == "cut" else jobs[:1]
    ends = wait_said(watched, [tmp_path / f"{k}.log" for k in range(len(watched))], 10 * 60 * TIMEOUT_MINUTES)
    assert all(code == 1 for code, _, _ in ends), ends
    assert all(said is not None and said < 60 * TIMEOUT_MINUTES for _, _, said in ends), ends
    [line] = _errors(tmp_path / "0.log")
    assert "host mzh1 (ranks 2, 3)" in line, line
    _no_worker_traceback(tmp_path / "0.log")
    if how == "cut":  # the cut-off host ends too, and says why
        [own] = _errors(tmp_path / "1.log")
        assert "the launch's store has not answered" in own and "cut off" in own, own
        _no_worker_traceback(tmp_path / "1.log")
    reader = CheckpointReader(save)  # what was saved before is whole (every CRC read)
    for name in reader.names:
        reader.full_tensor(name)
    print(
        f"lost host ({how}): hosts say it {', '.join(f'{said:.1f}' for _, _, said in ends)} s after, and "
        f"end {', '.join(f'{t:.1f}' for _, t, _ in ends)} s after"
    )


def _curve(run_dir) -> dict:
    """Iteration -> (loss, grad norm), the last record of each winning (a restarted attempt repeats some)."""
    return {i: (loss, norm) for i, loss, norm in _losses(run_dir)}


# No dropout: a checkpoint loaded at another layout (the resize) restores no RNG states, so dropout
# would draw other masks there (the one-host restart test in test_operations.py keeps dropout on).
RESTART_FLAGS = MODEL + ["--zero-stage", "3", "--train-iters", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def straight(made, tmp_path_factory):
    """Iteration -> (loss, grad norm) of one host's 4 ranks left alone, ZeRO-3, 8 iterations."""
    run = tmp_path_factory.mktemp("straight")
    job = made.torchrun(0, 1, 4, RESTART_FLAGS + ["--run-dir", str(run)], run / "log", port=next(_ports))
    assert wait_all([job], 300)[0][0] == 0, (run / "log").read_text()[-3000:]
    made.reset()
    curve = _curve(run)
    assert sorted(curve) == list(range(1, 9))
    return curve


def _start_then_break(hosts, tmp_path, nnodes, extra):
    """Both hosts train RESTART_FLAGS with --save D --load D (c10d, one restart) until D holds
    iteration 4 or later; returns the jobs and D."""
    save = tmp_path / "ckpt"
    flags = RESTART_FLAGS + [
        "--save-interval",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--save",
        str(save),
        "--load",
        str(save),
    ]
    port = next(_ports)
    jobs = [
        hosts.torchrun(
            k,
            nnodes,
            2,
            flags,
            tmp_path / f"{k}.log",
            rdzv="c10d",
            port=port,
            extra=["--max-restarts", "1", "--monitor-interval", "1", *extra],
        )
        for k in range(2)
    ]
    start = time.monotonic()
    while not (save / "latest").exists() or (save / "latest").read_text().strip() < "iter_0000004":
        assert time.monotonic() - start < 300 and jobs[0].poll() is None, (tmp_path / "0.log").read_text()[-3000:]
        time.sleep(0.1)
    return jobs


def test_a_restart_across_hosts_resumes_to_the_straight_curve(hosts, tmp_path, straight):
    """torchrun --max-restarts 1 --rdzv-backend c10d on both hosts, --save D --load D: kill -9 of one
    worker of host 1 restarts both hosts' workers, which resume from D and finish on the straight
    (one-host) fp32 curve bitwise."""
    jobs = _start_then_break(hosts, tmp_path, 2, [])
    os.kill(workers(jobs[1])[1], signal.SIGKILL)  # rank 3
    ends = wait_all(jobs, 300)
    assert [code for code, _ in ends] == [0, 0], (tmp_path / "1.log").read_text()[-3000:]
    # (rank 2's "lost rank 3" line is not asserted: torchrun, polling every second, may stop rank 2
    # before it notices, which docs/clusters.md documents; test_operations.py holds that line on one host.)
    assert "loaded weights and optimizer from" in (tmp_path / "0.log").read_text()
    assert _curve(tmp_path / "run") == straight


def test_a_host_lost_for_good_resizes_the_job_and_resumes(hosts, tmp_path, straight):
    """--nnodes 1:2: host 1 killed for good, host 0 restarts alone (world 2, dp 2 where it was 4),
    loads the checkpoint resharded, and finishes the same global batches on the straight curve (rtol
    1e-5: the dp sums run in another order)."""
    jobs = _start_then_break(hosts, tmp_path, "1:2", ["--rdzv-conf", "last_call_timeout=2"])
    hosts.kill(1)
    [(code, _)] = wait_all(jobs[:1], 300)
    log = (tmp_path / "0.log").read_text()
    assert code == 0, log[-3000:]
    assert "world=4 tp=1 pp=1 dp=4" in log and "world=2 tp=1 pp=1 dp=2" in log, log[-3000:]
    assert "loaded weights and optimizer from" in log
    got = _curve(tmp_path / "run")
    assert sorted(got) == sorted(straight)
    torch.testing.assert_close(
        torch.tensor([got[i] for i in sorted(got)]),
        torch.tensor([straight[i] for i in sorted(straight)]),
        rtol=1e-5,
        atol=0,
    )


def _signal(job, sig) -> list[int]:
    pids = workers(job)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def _term_pending(pid: int) -> bool:
    """Whether SIGTERM waits on a (stopped) process: torchrun has begun stopping it."""
    try:
        status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    except OSError:
        return True  # gone
    return any(int(status[key], 16) & (1 << (signal.SIGTERM - 1)) for key in ("SigPnd", "ShdPnd"))


def test_a_host_that_comes_back_is_used_again(hosts, tmp_path, straight):
    """--nnodes 1:2 --max-restarts 2 (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): host 1 killed, host 0 goes on alone (world 2) and saves; host 1's
    torchrun started again joins the rendezvous, torchrun restarts host 0's workers, and both hosts
    resume at world 4 from the world-2 checkpoint, resharded back, to the straight curve (rtol 1e-5).
    Host 0's world-2 workers are held (SIGSTOP, let run in 0.3 s slices) so that they save and have
    not finished when host 1 is back."""
    save = tmp_path / "ckpt"
    flags = RESTART_FLAGS + [
        "--save-interval",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--save",
        str(save),
        "--load",
        str(save),
    ]
    port = next(_ports)
    extra = ["--max-restarts", "2", "--monitor-interval", "1", "--rdzv-conf", "last_call_timeout=2"]
    # torch's shared rendezvous store publishes the workers' MASTER_ADDR in the first round only, so a
    # node joining a later round waits for it until it times out: the opt-out makes every round say it
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    start = lambda k, log: hosts.torchrun(
        k,
        "1:2",
        2,
        flags,
        tmp_path / log,
        rdzv="c10d",
        port=port,  # noqa: E731
        extra=extra,
        env=env,
    )
    first = start(0, "0.log")
    start(1, "1.log")
    began = time.monotonic()
    latest = lambda: (save / "latest").read_text().strip() if (save / "latest").exists() else ""  # noqa: E731
    log0 = lambda: (tmp_path / "0.log").read_text(errors="replace")  # noqa: E731
    while not latest():
        assert time.monotonic() - began < 300 and first.poll() is None, log0()[-3000:]
        time.sleep(0.1)
    hosts.kill(1)
    at_loss = latest()
    while "world=2 tp=1 pp=1 dp=2" not in log0():
        assert time.monotonic() - began < 400 and first.poll() is None, log0()[-3000:]
        time.sleep(0.1)
    _signal(first, signal.SIGSTOP)
    while latest() <= at_loss:  # world 2 trains in slices until it has saved
        assert time.monotonic() - began < 500 and first.poll() is None, log0()[-3000:]
        _signal(first, signal.SIGCONT)
        time.sleep(0.3)
        _signal(first, signal.SIGSTOP)
    saved_at_world_2 = latest()
    back = start(1, "1b.log")
    held = workers(first)
    while not all(_term_pending(pid) for pid in held):  # torchrun restarts host 0 for the newcomer
        assert time.monotonic() - began < 600 and first.poll() is None, log0()[-3000:]
        time.sleep(0.2)
    _signal(first, signal.SIGCONT)
    ends = wait_all([first, back], 150)
    log = log0()
    assert [code for code, _ in ends] == [0, 0], (ends, log[-3000:], (tmp_path / "1b.log").read_text()[-3000:])
    assert log.count("world=4 tp=1 pp=1 dp=4") == 2 and log.count("world=2 tp=1 pp=1 dp=2") == 1, log[-3000:]
    assert f"from {save / saved_at_world_2} at iteration" in log.split("world=4 tp=1 pp=1 dp=4")[-1], log[-3000:]
    got = _curve(tmp_path / "run")
    assert sorted(got) == sorted(straight)
    torch.testing.assert_close(
        torch.tensor([got[i] for i in sorted(got)]),
        torch.tensor([straight[i] for i in sorted(straight)]),
        rtol=1e-5,
        atol=0,
    )
    print(f"host back: world 4 -> 2 ({at_loss}) -> 4 ({saved_at_world_2}), {time.monotonic() - began:.1f} s in all")


def test_the_clusters_page_slurm_script_runs_the_restart_tests_lines():
    """docs/clusters.md's two-node Slurm script carries the restart test's torchrun and pretrain_gpt.py flags."""
    from tests.hosts import REPO

    text = (REPO / "docs" / "clusters.md").read_text()
    script = text[text.index("#SBATCH --job-name=megazero-2n") :]
    script = " ".join(script[: script.index("```")].replace("\\\n", " ").split())
    launch = (
        '--nnodes 2 --rdzv-backend c10d --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" '
        "--nproc-per-node 2 --max-restarts 1 --monitor-interval 1 pretrain_gpt.py "
    )
    flags = RESTART_FLAGS + ["--save-interval", "2"]
    assert launch + " ".join(flags) + " --run-dir " in script, script
