"""Megatron's --num-workers N > 0: the next batches are read by a background thread while the current
step runs, so the step does not wait on the disk. Any source with `batch(i)` (a pure function of i)
is wrapped; batch(i) returns what source.batch(i) returns, whatever the order of the calls, so reading
ahead never changes which samples a step gets. Threads, not processes: the work is numpy slicing of
memory-mapped files, which releases the GIL, and the batches are the step's own tensors (no copies
between processes). It owns the thread pool; it must not touch the samples.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class ReadAhead:
    def __init__(self, source, workers: int, depth: int = 2, end: int | None = None):
        """`end`: the first batch index the run never asks for (its --train-iters): nothing is read
        from there on (a dataset of whole epochs holds more samples than the run trains on)."""
        self.source, self.depth, self.end = source, max(1, depth), end
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="megazero-data")
        self.pending: dict[int, Future] = {}

    def __getattr__(self, name):  # num_microbatches, ramp, ... as the source has them
        return getattr(self.source, name)

    def batch(self, i: int):
        for j in range(i, i + 1 + self.depth):  # this batch and the next `depth` ones in flight
            if j != i and self.end is not None and j >= self.end:
                break
            if j not in self.pending:
                self.pending[j] = self.pool.submit(self.source.batch, j)
        for j in [j for j in self.pending if j < i]:  # a jump back or forward drops stale reads
            self.pending.pop(j).cancel()
        return self.pending.pop(i).result()

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=True)
