"""tests/gpu: checks that need CUDA devices and NCCL (run by bench/gpu_check.sh on GPU machines).

Every test collected here gets the `gpu` marker; `@pytest.mark.gpu(n)` asks for n devices (default
1). Where there are fewer, each test is skipped with the reason, which `-ra` prints: a CPU run
reports these as skipped, never as passed. `trainer` runs pretrain_gpt.py as users launch it.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launching import torchrun_command, worker_env
from tests.metrics_reading import metrics_records

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    found = _devices()
    for item in items:
        if HERE not in item.path.resolve().parents:
            continue
        marker = item.get_closest_marker("gpu")
        if marker is None:
            item.add_marker(pytest.mark.gpu)
        needed = marker.args[0] if marker is not None and marker.args else 1
        if found == 0:
            item.add_marker(
                pytest.mark.skip(
                    reason="no CUDA device (torch.cuda.is_available() is False); run bench/gpu_check.sh on a GPU machine"
                )
            )
        elif found < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA devices, found {found}"))


class Trainer:
    """Runs pretrain_gpt.py in `cwd` (one process, or torchrun with nproc ranks); returns the train
    losses of <cwd>/<run_dir>/metrics.jsonl."""

    def __init__(self, cwd: Path):
        self.cwd = cwd

    def run(self, argv: list[str], run_dir: str, nproc: int = 1, timeout: int = 300) -> list[float]:
        script = [str(REPO / "pretrain_gpt.py"), *argv, "--run-dir", run_dir]
        command = torchrun_command(nproc, script) if nproc > 1 else [sys.executable, *script]
        proc = subprocess.run(command, cwd=self.cwd, capture_output=True, text=True, timeout=timeout, env=worker_env())
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        records = metrics_records(self.cwd / run_dir / "metrics.jsonl")
        losses = [r["loss"] for r in records if r.get("split", "train") == "train"]
        assert losses and all(math.isfinite(x) for x in losses), losses
        return losses


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return Trainer(tmp_path_factory.mktemp("gpu_runs"))
