"""How many CPU threads a rank takes of its node: the cores this process may run on, and torch's
intra-op threads per rank where OMP_NUM_THREADS does not say (megazero.run.launch asks, and its
Launch.device and cpu_optimizer_threads apply the answer). Reads no environment variable.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as Slurm and containers restrict it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(cores: int, local_world: int, load: float) -> int:
    """torch's threads per rank when OMP_NUM_THREADS is unset: the cores other work leaves idle (the
    1-minute load average off the count) shared by the node's ranks, at least 1. On a busy machine
    all-core OpenMP regions wait on their descheduled threads: a tiny step measured 253-2541 ms on
    two busy cores against 38-92 ms on one thread."""
    idle = min(cores, cores - int(load + 0.5)) if load > 0 else cores
    return max(1, idle // max(1, local_world))
