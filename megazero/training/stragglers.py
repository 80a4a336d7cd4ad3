"""Names the rank that holds the others back (--straggler-threshold; Megatron-LM's straggler detector).

Every rank times its own work over a log interval: forward, backward and the optimizer step (its
compute, less the host time blocked in collectives inside them), and the host time it spent blocked
in collectives' waits in all (comm wait). On a GPU the phases are stream times (events) and NCCL's
waits are on the stream, not the host: there a slow peer's wait stays inside the phase. In lockstep training
every rank's wall clock per step is the same (the collectives make it so), so the slow rank shows
in its compute, and the others wait for it. At each log line one gather of 5 numbers per rank (over
DP, then over TP x PP: together the whole world, no group of its own) brings every rank's times to
every rank; a rank whose compute exceeds the median compute by more than the threshold is named.
No collective is added to any other step.
"""

from __future__ import annotations

import statistics

import torch

from megazero.core import comm
from megazero.core.streams import Timers

PHASES = ("forward", "backward", "step")


class StragglerWatch:
    """This rank's phase timers for the interval, and the gather that compares the ranks."""

    def __init__(self, threshold: float, device, log: comm.CommLog):
        self.threshold, self.device, self.log = threshold, torch.device(device), log
        self.timers = Timers(self.device)
        self._wait_at_start = log.wait_s
        # host waits inside a phase (a TP all-reduce in the forward, a ZeRO bucket's wait in the
        # backward) are the peers' slowness, not this rank's work: taken out of the phase's time
        self._inside: dict[str, float] = {}
        self.iterations = 0  # steps timed since the last gather (or reset)
        self._wait_at_phase: dict[str, float] = {}

    def start(self, name: str) -> None:
        self.timers.start(name)
        self._wait_at_phase[name] = self.log.wait_s

    def stop(self, name: str) -> None:
        self.timers.stop(name)
        waited = self.log.wait_s - self._wait_at_phase.pop(name)
        self._inside[name] = self._inside.get(name, 0.0) + waited

    def reset(self) -> None:
        """Forgets the times so far (this rank only)."""
        self.timers.elapsed_ms()
        self.iterations = 0
        self._inside.clear()
        self._wait_at_start = self.log.wait_s

    def gather(self, groups) -> list[dict]:
        """Every rank's seconds in each phase since the last call (collective over the whole
        layout: every rank calls it at the same iterations), ordered by global rank."""
        ms, inside = self.timers.elapsed_ms(), self._inside
        self._inside, self.iterations = {}, 0
        wait = self.log.wait_s - self._wait_at_start
        work = [max(0.0, ms.get(p, 0.0) / 1000 - inside.get(p, 0.0)) for p in PHASES]
        mine = torch.tensor([float(groups.rank)] + work + [wait], dtype=torch.float64, device=self.device)
        over_dp = torch.empty(groups.dp.size * mine.numel(), dtype=torch.float64, device=self.device)
        comm.all_gather(over_dp, mine, groups.dp)
        everyone = torch.empty(groups.mp.size * over_dp.numel(), dtype=torch.float64, device=self.device)
        comm.all_gather(everyone, over_dp, groups.mp)
        self._wait_at_start = self.log.wait_s  # the gather's own wait is not the next interval's
        rows = everyone.view(-1, mine.numel()).tolist()
        return sorted(
            ({"rank": int(r[0]), **dict(zip(PHASES, r[1:4])), "comm_wait": r[4], "compute": sum(r[1:4])} for r in rows),
            key=lambda t: t["rank"],
        )


def find_stragglers(times: list[dict], threshold: float, iterations: int) -> dict | None:
    """The slowest rank whose compute is more than `threshold` (a fraction) over the median
    compute of all ranks, over `iterations` steps, as a record field; None when no rank is."""
    median = statistics.median(t["compute"] for t in times)
    slow = [t for t in times if t["compute"] > median * (1 + threshold)]
    if not slow or median <= 0:
        return None
    worst = max(slow, key=lambda t: t["compute"])
    return {
        "rank": worst["rank"],
        "iterations": iterations,
        "seconds": worst["compute"],
        "median_seconds": median,
        "ratio": worst["compute"] / median,
        "ranks": [t["rank"] for t in slow],
        **{p: worst[p] for p in PHASES},
        "comm_wait": worst["comm_wait"],
    }


def describe(found: dict) -> str:
    """The log line naming the straggler."""
    others = [r for r in found["ranks"] if r != found["rank"]]
    return (
        f" straggler: rank {found['rank']} took {found['seconds']:.2f} s in the last {found['iterations']} "
        f"iterations, {found['ratio']:.1f}x the median {found['median_seconds']:.2f} s (forward "
        f"{found['forward']:.2f} s, backward {found['backward']:.2f} s, step {found['step']:.2f} s, "
        f"comm wait {found['comm_wait']:.2f} s)"
        + (f"; also over the threshold: ranks {', '.join(map(str, others))}" if others else "")
    )
