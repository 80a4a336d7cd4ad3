"""ZenFlow as the engine's optimizer placement (megazero.zero.placement): the storages' offloads are
ZenFlowOffload, the CPU Adam gets the threads the training leaves (pt_reserved_cores_perc), and
with update_interval "auto" one AutoWindows decides for every storage, before they step, whether
the window ends; its open window goes into this rank's checkpoint index and comes back from it.
"""

from __future__ import annotations

import functools


from ..offload import Offloaded
from .optimizer import ZenFlowOffload
from .windows import AutoWindows


class ZenFlow(Offloaded):
    def __init__(self, zero, groups, counts_in_norm):
        super().__init__(zero, groups)
        self.flow = zero.zenflow
        self.cpu_threads = max(1, round(self.cpu_threads * (1 - self.flow.pt_reserved_cores_perc)))
        self.windows = AutoWindows(self.flow, groups.model_parallel) if self.flow.update_interval == "auto" else None
        self.tensor, self.counts_in_norm = groups.tensor, counts_in_norm

    def make_offload(self):
        return functools.partial(
            ZenFlowOffload,
            zenflow=self.flow,
            cpu_threads=self.cpu_threads,
            windows=self.windows,
            tensor=self.tensor,
            counted=self.counts_in_norm,
        )

    def before_step(self, storages, step: int, coef: float) -> None:
        if self.windows is not None:  # one window decision for every storage, first
            self.windows.decide(storages, step, coef)

    def checkpoint_index(self, storages, name_of) -> dict:
        """The open "auto" window: this rank's running sums, by parameter name."""
        if self.windows is None:
            return {}
        return {"zenflow_window": self.windows.state_dict(storages, name_of)}

    def restore(self, indexes: list[dict], storages, name_of) -> None:
        """The open "auto" window: its step count and its running sums, by parameter name from any
        rank that saved them (every rank holding a matrix holds its whole sums; none saved: the
        checkpoint closed its window, or was written without "auto")."""
        if self.windows is None:
            return
        saved = [index["zenflow_window"] for index in indexes if "zenflow_window" in index]
        window = {
            "steps": max((w["steps"] for w in saved), default=0),
            "sums": {name: pair for w in saved for name, pair in w["sums"].items()},
        }
        self.windows.load_state_dict(window, storages, name_of)
