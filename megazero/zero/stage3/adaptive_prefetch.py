"""Stage 3's adaptive prefetch budget (`stage3_adaptive_prefetch_bucket_size`): how many elements
the coordinator gathers ahead grows while the compute waits for gathers and shrinks while it never
does, between `stage3_adaptive_prefetch_min_size` and `..._max_size` (and never above
`max_live_parameters`).

The rule (megazero's own, after DeepSpeed's): every ADAPT_EVERY training passes, the last of them is
measured: the time the compute stream spent waiting for gathers that were not done when it needed
them, over the whole pass (timing events on the compute stream on a GPU, so nothing waits but one
event at the pass's end; host clocks on the CPU, where a gather's wait blocks the host). The shard
group agrees on the largest ratio (its slowest rank sets the pace, and every rank must prefetch the
same units or their gathers would pair up wrongly): above GROW_ABOVE the budget grows by GROW, below
SHRINK_BELOW it shrinks by SHRINK (at least one element either way), otherwise it stays. The
agreement runs at the same passes on every rank whatever happened to its trace; a rank without a
measurement (no trace yet, or it was dropped) makes every rank skip that update.

Owns the budget and its measurements only; the coordinator asks `budget` and reports the waits.
"""

from __future__ import annotations

import torch

from megazero.core import comm, host_read
from megazero.core.streams import Event

ADAPT_EVERY = 10
GROW_ABOVE, SHRINK_BELOW = 0.10, 0.02
GROW, SHRINK = 1.25, 0.9


class AdaptivePrefetch:
    def __init__(self, config, group: comm.Group, device):
        self.group, self.device = group, torch.device(device)
        self.low = min(config.adaptive_prefetch_min_size, config.max_live_parameters)
        self.high = min(config.adaptive_prefetch_max_size, config.max_live_parameters)
        self.budget = self._bounded(config.prefetch_bucket_size)
        self.passes = 0  # training passes so far (the agreement's cadence)
        self.ratios: list[float] = []  # the agreed wait ratio of each update, for inspection
        self._start: Event | None = None
        self._waits: list[tuple[Event, Event]] = []

    def _bounded(self, value: float) -> int:
        return int(max(self.low, min(self.high, value)))

    @property
    def sampling(self) -> bool:
        return self._start is not None

    def begin_pass(self, traced: bool) -> None:
        """A training pass starts; it is measured when it is the last of a cadence and has a trace."""
        self._waits, self._start = [], None
        if traced and self.passes % ADAPT_EVERY == ADAPT_EVERY - 1:
            self._start = Event(self.device, timing=True).record()

    def before_wait(self) -> Event | None:
        return Event(self.device, timing=True).record() if self.sampling else None

    def after_wait(self, started: Event | None) -> None:
        if started is not None and self.sampling:
            self._waits.append((started, Event(self.device, timing=True).record()))

    def dropped_trace(self) -> None:
        """The trace was dropped mid-pass: this pass's measurement is void."""
        self._start, self._waits = None, []

    def end_pass(self) -> None:
        """Ends a training pass; at the end of a cadence the shard group agrees and the budget moves."""
        self.passes += 1
        ratio = -1.0  # no measurement
        if self._start is not None:
            end = Event(self.device, timing=True).record()
            total = self._start.elapsed_ms(end)
            waited = sum(a.elapsed_ms(b) for a, b in self._waits)
            ratio = waited / total if total > 0 else 0.0
        self._start, self._waits = None, []
        if self.passes % ADAPT_EVERY:
            return
        # [largest ratio, 1 if some rank has none]: MAX of both in one all-reduce.
        agreed = torch.tensor(
            [max(ratio, 0.0), 1.0 if ratio < 0 else 0.0], dtype=torch.float64, device=self.group.device
        )
        comm.all_reduce(agreed, self.group, op=comm.ReduceOp.MAX)
        worst, missing = host_read.read(
            agreed, "prefetch wait ratio", healthy=[max(ratio, 0.0), 1.0 if ratio < 0 else 0.0]
        )
        if missing:
            return
        self.ratios.append(worst)
        if worst > GROW_ABOVE:
            self.budget = self._bounded(max(self.budget * GROW, self.budget + 1))
        elif worst < SHRINK_BELOW:
            self.budget = self._bounded(min(self.budget * SHRINK, self.budget - 1))
