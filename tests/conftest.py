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


class _Pools:
    def __init__(self):
        self._pools = {}

    def __call__(self, world_size: int) -> DistributedPool:
        if world_size not in self._pools:
            self._pools[world_size] = DistributedPool(world_size)
        return self._pools[world_size]

    def close(self):
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def dist_pool():
    """dist_pool(n) -> a pool of n gloo ranks; `pool.run(fn, *args)` runs fn(ctx, *args) on each."""
    pools = _Pools()
    yield pools
    pools.close()
