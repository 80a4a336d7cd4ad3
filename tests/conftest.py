"""Shared fixtures: gloo worker pools that live for the whole session, one per world size."""
import os

# One OpenMP thread per process: the two pytest-xdist workers already fill the 2 cores, and an
# OpenMP barrier whose other thread is descheduled costs a time slice per op (a tiny in-process
# pretrain_gpt run went from 0.6 s to 4-15 s per step on a busy machine with 2 threads). Subprocesses
# (pretrain_gpt.py, torchrun) inherit it; launch keeps a set OMP_NUM_THREADS.
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from megazero.testing import DistributedPool

torch.set_num_threads(1)

# The files that take longest, longest first (worker-seconds measured on the 2-core machine; see
# tests/README.md). With `--dist loadfile` each file runs whole on one xdist worker, and a worker
# takes the next file when it runs dry: handing out the long files first keeps the two workers'
# ends close together (longest-processing-time-first). The other files follow in collection order.
SLOWEST_FIRST = [
    "test_cli.py", "test_zero_exactness.py", "test_operations.py", "test_checkpoint.py", "test_pipeline.py",
]


def pytest_configure(config):
    # xdist's own order (--loadscope-reorder, its default) hands out files with the most tests
    # first, which left the long files of few tests for last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: files stay whole


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
