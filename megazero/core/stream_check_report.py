"""The CPU stream sanitizer's line for a run: a pretrain_gpt.py run under MEGAZERO_STREAM_CHECK=1 is
checked whole (megazero.core.stream_check) and ends with one line of counts, summed over the
launch's ranks through its rendezvous store; a violation fails the run with its message.

Owns that line and the switch around the run; what is checked, and how, is stream_check's.
"""

from __future__ import annotations

import contextlib

import torch

from megazero.core.stream_check import StreamChecker, StreamOrderError, checking


def summed(checker: StreamChecker, store=None, rank: int = 0, world: int = 1) -> str | None:
    """The run's line: the checker's counts, summed over the launch's ranks through its rendezvous
    `store` (a torch.distributed Store). Rank 0 returns it, the other ranks None."""
    if store is None or world == 1:
        return checker.summary()
    store.set(f"stream_check/{rank}", f"{checker.side_ops} {checker.violations}")
    if rank != 0:
        return None
    counts = [[int(x) for x in store.get(f"stream_check/{r}").decode().split()] for r in range(world)]
    return (
        f"stream check ({checker.describe_semantics()}): {sum(c[0] for c in counts)} side-stream ops "
        f"checked on {world} ranks, {sum(c[1] for c in counts)} violations"
    )


@contextlib.contextmanager
def for_launch(enabled: bool, device, store=None, rank: int = 0, world: int = 1, say=print):
    """A pretrain_gpt.py run under MEGAZERO_STREAM_CHECK=1: the whole run is checked and one line
    says at its end how many side-stream ops were checked and how many violations were found; a
    violation fails the run with its message (after this rank's line)."""
    if not enabled:
        yield
        return
    if torch.device(device).type != "cpu":
        from megazero.core.errors import UsageError

        raise UsageError(
            f"MEGAZERO_STREAM_CHECK=1 models the streams of CPU runs, not {device}; on GPUs "
            f"run torch's own sanitizer (TORCH_CUDA_SANITIZER=1 with --distributed-backend nccl)"
        )
    with checking() as checker:
        try:
            yield
        except StreamOrderError:
            say(f"{checker.summary()} (rank {rank})", flush=True)
            raise
    line = summed(checker, store, rank, world)
    if line is not None:
        say(line, flush=True)
