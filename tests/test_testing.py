"""The gloo worker pool the multi-rank tests share (megazero/testing.py): a rank whose process ends
fails the call at once, naming it, instead of after the call's timeout; the next call starts afresh."""

import os

import pytest


def rank_and_exit(ctx, rank_to_end):
    if ctx.rank == rank_to_end:
        os._exit(3)
    return ctx.rank


def test_a_rank_that_dies_fails_the_call_at_once_and_the_pool_restarts(dist_pool):
    """(Planted: without the liveness check the call waits out its timeout and says so.)"""
    pool = dist_pool(2)
    with pytest.raises(AssertionError, match=r"rank 1's process ended \(exit code 3\)"):
        pool.run(rank_and_exit, 1, timeout=300)
    assert pool.run(rank_and_exit, None) == [0, 1]
