"""Shared fixtures: gloo worker pools that live for the whole session, one per world size."""

import os
from pathlib import Path

# One OpenMP thread per process: the two pytest-xdist workers already fill the 2 cores, and an
# OpenMP barrier whose other thread is descheduled costs a time slice per op (a tiny in-process
# pretrain_gpt run went from 0.6 s to 4-15 s per step on a busy machine with 2 threads). Subprocesses
# (pretrain_gpt.py, torchrun) inherit it; launch keeps a set OMP_NUM_THREADS.
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from megazero.testing import DistributedPool

torch.set_num_threads(1)

# The files that take longest, longest first, by path under tests/ (worker-seconds measured on the
# 2-core machine; see tests/README.md). With `--dist loadfile` each file runs whole on one xdist
# worker, and a worker takes the next file when it runs dry: handing out the long files first keeps
# the two workers' ends close together (longest-processing-time-first). The other files follow in
# collection order. A file moved or renamed without this list following fails the session's start.
SLOWEST_FIRST = [
    "run/test_cli.py",
    "run/test_hosts.py",
    "zero/test_engine_exactness.py",
    "run/test_operations.py",
    "checkpoint/test_save_and_load.py",
    "parallel/pipeline/test_schedules.py",
]
TESTS = Path(__file__).resolve().parent
_stale = [name for name in SLOWEST_FIRST if not (TESTS / name).is_file()]
assert not _stale, f"tests/conftest.py SLOWEST_FIRST names files that do not exist: {_stale}"


def pytest_configure(config):
    # xdist's own order (--loadscope-reorder, its default) hands out files with the most tests
    # first, which left the long files of few tests for last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _under_tests(item) -> str:
    path = item.path.resolve()
    return path.relative_to(TESTS).as_posix() if TESTS in path.parents else str(path)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_under_tests(item), len(rank)))  # stable: files stay whole


class _Pools:
    def __init__(self):
        self._pools = {}

    def __call__(self, world_size: int) -> DistributedPool:
        if world_size not in self._pools:
            self._pools[world_size] = DistributedPool(world_size)
        return self._pools[world_size]

    def close(self):
        # Killed, not asked to finish: at the session's end nothing is left to do, and up to 14
        # ranks tearing down gloo and unloading torch on a busy machine took 16-28 s of the last
        # test's teardown on each xdist worker.
        for pool in self._pools.values():
            pool.close(force=True)


@pytest.fixture(scope="session")
def dist_pool():
    """dist_pool(n) -> a pool of n gloo ranks; `pool.run(fn, *args)` runs fn(ctx, *args) on each."""
    pools = _Pools()
    yield pools
    pools.close()
