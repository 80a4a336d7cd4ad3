"""A run that runs out of memory mid-step ends in one line on every rank that does, no traceback, exit
code 1: the phase, the bytes asked and free, and the flags that lower that phase's memory. In-process
runs meet the CPU allocator's own error at a planted allocation too large for any machine, in each
phase; one real process meets it at the size limit of its address space (ulimit -v), where the
CPU's math attention kernel asks for its (b, heads, s, s) probabilities."""

import os
import resource
import subprocess
import sys

import pytest
import torch

from megazero.models import gpt
from megazero.zero.engine import ZeroEngine
from tests.driver import REPO, TINY, run_main
from tests.launching import torchrun_command, worker_env

TOO_MUCH = 2**50  # 1 PiB: no machine's allocator grants it, none refuses it for another reason


def _plant(monkeypatch, owner, name):
    real = getattr(owner, name)

    def planted(*args, **kwargs):
        torch.empty(TOO_MUCH, dtype=torch.uint8)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, planted)


@pytest.mark.parametrize(
    "owner,name,phase,flags",
    [
        (
            gpt.CoreAttention,
            "forward",
            "forward",
            ["--micro-batch-size (now 2)", "--recompute-activations", "--attention-dropout 0"],
        ),
        (
            ZeroEngine,
            "backward",
            "backward",
            ["--micro-batch-size (now 2)", "--zero-stage 2 (gradients partitioned; now 1)"],
        ),
        (ZeroEngine, "step", "optimizer step", ["--zero-stage 3 (now 1)", "--zero-offload-optimizer nvme"]),
    ],
)
def test_out_of_host_memory_in_a_phase_is_one_line(tmp_path, monkeypatch, capsys, owner, name, phase, flags):
    monkeypatch.chdir(tmp_path)
    _plant(monkeypatch, owner, name)
    code, out = run_main(
        TINY
        + [
            "--mock-data",
            "--train-iters",
            "2",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--zero-stage",
            "1",
        ],
        capsys,
    )
    lines = out.err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in out.err, out.err
    line = lines[0]
    assert line.startswith(f"error: out of host memory in the {phase}: asked for 1048576.0 GiB with "), line
    assert " free (" in line and all(f in line for f in flags), line


def _limited(limit):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


LONG = TINY + [
    "--mock-data",
    "--train-iters",
    "1",
    "--seq-length",
    "2048",
    "--max-position-embeddings",
    "2048",
    "--micro-batch-size",
    "8",
]


def test_a_real_process_out_of_address_space_ends_in_one_line(tmp_path):
    """The start-up check passes (it reads MemAvailable), then the forward's math attention kernel
    asks for its probabilities beyond the process's address-space limit."""
    argv = [sys.executable, str(REPO / "pretrain_gpt.py")] + LONG + ["--global-batch-size", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    limit = 2 * 2**30  # a run of seq 64 fits (0.4 GiB at its peak); 8 x 4 x 2048^2 probabilities (0.5 GiB each) do not
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, preexec_fn=_limited(limit)
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith("error: out of host memory in the forward: asked for "), lines[0]
    assert "the address-space limit (ulimit -v) of 2.0 GiB" in lines[0], lines[0]
    assert "--attention-dropout 0" in lines[0] and "--micro-batch-size (now 8)" in lines[0], lines[0]


def test_every_rank_that_runs_out_says_so(tmp_path):
    """Two torchrun ranks, each beyond its limit in the same forward: one line from each rank that
    gets there (torchrun stops the other when the first one's process ends: on a busy machine the
    second may not reach its allocation first)."""
    argv = torchrun_command(2, [str(REPO / "pretrain_gpt.py")] + LONG + ["--global-batch-size", "16"])
    limit = 2 * 2**30
    done = subprocess.run(
        argv, cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=600, preexec_fn=_limited(limit)
    )
    said = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and len(said) in (1, 2), done.stderr[-3000:]
    ranks = [line.split(":")[1] for line in said]
    assert len(set(ranks)) == len(ranks) and set(ranks) <= {" rank 0", " rank 1"}, said
    assert all("out of host memory in the forward: asked for 512.0 MiB" in line for line in said), said
    assert "megazero" + os.sep not in done.stderr.replace(str(REPO), ""), done.stderr[-3000:]  # no worker frames


class _Exhausted:
    """Any attribute read asks for more memory than the machine has."""

    def __getattr__(self, name):
        torch.empty(TOO_MUCH, dtype=torch.uint8)


def test_the_phase_is_the_module_and_function_the_allocation_failed_in():
    """Named by the frame's module (megazero.core.source_paths says why), not by a file name: the
    names of the training room's files moved once already ("training.py" matched nothing since)."""
    from megazero.checkpoint.resume import check_resume
    from megazero.training import assembly, loop, out_of_memory

    for call, phase in (
        (lambda: loop.evaluate(_Exhausted(), []), "evaluation"),
        (lambda: assembly.setup(_Exhausted(), None), "set-up (model and ZeRO engine)"),
        (lambda: check_resume(_Exhausted(), None, 1, None), "checkpoint"),
    ):
        with pytest.raises(RuntimeError) as caught:
            call()
        assert out_of_memory.is_out_of_memory(caught.value) and out_of_memory.phase_of(caught.value) == phase
