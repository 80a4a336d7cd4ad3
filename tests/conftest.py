"""Shared fixtures: gloo worker pools that live for the whole session, one per world size."""
import pytest
import torch

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
