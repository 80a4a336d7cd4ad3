"""ZenFlow's `update_interval: "auto"` (DeepSpeed's Zen-auto): where the CPU Adam's windows end,
decided at each step for every ZenFlow storage of one engine at once.

DeepSpeed's rule (zenflow_stage_1_and_2.py, `_process_selected_fp32_groups_grad`), per matrix (a
parameter of two or more dimensions; a one-dimensional one is selected whole and defers nothing),
over the u steps of the open window, this one included:

    selected = the mean over the window of the L1 norm of the selected columns' gradient,
               per topk_ratio x 10 of the columns
    deferred = the sum over the window of the L1 norm of the other columns' gradient,
               per (1 - topk_ratio) x 10 of the columns

A matrix has caught up when deferred >= selected: its deferred columns have gathered, column for
column, as much gradient as one step of the selected ones. The window ends at the step where at
least int(auto_ratio x the number of matrices) have caught up (the factors 10 cancel: the test is
topk_ratio x sum(deferred L1) >= (1 - topk_ratio) x sum(selected L1) / u). A window also ends at the
step before a re-selection (`select_interval`), so that selections happen at window starts, as
DeepSpeed's update boundary does; its CPU Adam then takes the window's mean gradient, as with a
fixed interval.

Where DeepSpeed's code, as read, does not do what it describes, the rule above is its evident
intent: (1) it divides the running mean by topk_ratio x 10 at every step, compounding it for any
ratio but its default 0.1 (for which the two agree); here the mean is divided once; (2) it sets its
gradient accumulation steps to 0 under "auto" and divides the loss by them; here the window's mean
is taken over its u steps; (3) its backward prologue clears the "window ends" flag of the other
double-buffer state before the update boundary reads it, so its windows end only at re-selections;
here the window ends at the step that meets the rule.

The L1 norms are those of the gradient the optimizer applies (unscaled, clipped), summed over the
shard group and, for a matrix tensor parallelism splits, over the tensor-parallel ranks (the whole
matrix's, as one process sees it). Each matrix is counted once (one pipeline stage's copy of a tied
one, one tensor-parallel rank's: ZenFlowOffload.matrices) and the counts are summed over the tensor-
and pipeline-parallel ranks (`model_parallel`), so every rank ends the windows one process would.

A checkpoint holds the open window's step count and each matrix's two running sums (`state_dict`,
by parameter name; written in each rank's index). The sums are the whole matrix's on every rank, so
a run resumed in any layout ends the same windows.

Owns the window decision; never selects, steps or accumulates (zenflow.py does).
"""

from __future__ import annotations

import math

import torch

from megazero.core import comm, host_read


class AutoWindows:
    """update_interval "auto" for the ZenFlow storages of one engine (see the module docstring).
    `decide(storages, step, grad_scale)` runs once per applied step before any storage steps;
    afterwards `ends` says whether this step closes the window and `steps` how many it holds."""

    def __init__(self, flow, model_parallel):
        self.flow, self.group = flow, model_parallel
        self.steps = 0  # steps in the open window (after decide: this one included)
        self.ends = True  # the last step closed its window: the next one opens one
        self.sums: dict[int, torch.Tensor] = {}  # id(offload) -> [params, 2]: selected, deferred L1
        self.loaded: dict[int, list[float]] = {}  # id(param) -> sums, from a checkpoint

    def decide(self, storages, step: int, grad_scale: float) -> None:
        t = step - self.flow.full_warm_up_rounds
        if t <= 0:
            return
        if self.ends:
            self.steps, self.sums = 0, {}
        self.steps += 1
        counts = None
        for storage in storages:
            offload = storage.offload
            offload.prepare(storage, t)
            l1 = offload.column_l1(storage, grad_scale)
            key = id(offload)
            if key not in self.sums:
                self.sums[key] = self._restored(storage, l1)
            self.sums[key] += l1
            mine = self._caught_up(storage, self.sums[key])
            counts = mine if counts is None else counts + mine
        self.loaded = {}
        comm.all_reduce(counts, self.group)
        # healthy (the dry run's meta tensors; alike on every rank): no matrix has caught up, among
        # enough of them that the rule needs one, so only select_interval ends a window
        ratio = self.flow.auto_ratio
        caught, matrices = host_read.read(
            counts, "zenflow window counts", healthy=[0.0, float(math.ceil(1 / ratio)) if ratio > 0 else 1.0]
        )
        every = self.flow.select_every()
        self.ends = caught >= int(self.flow.auto_ratio * matrices) or (every > 0 and t % every == 0)

    def _caught_up(self, storage, sums: torch.Tensor) -> torch.Tensor:
        """[matrices that have caught up, matrices] of this storage (float, on its device)."""
        matrix = storage.offload.matrices
        ratio = self.flow.topk_ratio
        caught = (ratio * sums[:, 1] >= (1.0 - ratio) * sums[:, 0] / self.steps) & matrix
        return torch.stack([caught.sum(), matrix.sum()]).float()

    def _restored(self, storage, like: torch.Tensor) -> torch.Tensor:
        """The running sums a checkpoint gave this storage's parameters (zero for the others)."""
        sums = torch.zeros_like(like)
        for i, param in enumerate(storage.params):
            if id(param) in self.loaded:
                sums[i] = torch.tensor(self.loaded[id(param)], dtype=sums.dtype)
        return sums

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self, storages, name_of) -> dict:
        """The open window: its step count and each matrix's running sums by `name_of(param)` (a
        closed window saves as an empty one: the next step opens a new window)."""
        sums = {}
        for storage in storages if not self.ends else ():
            values = self.sums.get(id(storage.offload))
            if values is not None:
                sums.update(zip((name_of(p) for p in storage.params), host_read.read(values, "zenflow window sums")))
        return {"steps": 0 if self.ends else self.steps, "sums": sums}

    def load_state_dict(self, state: dict, storages, name_of) -> None:
        """Resumes the window `state_dict` saved (in any layout: the sums are whole matrices')."""
        self.steps = int(state["steps"])
        self.ends, self.sums = self.steps == 0, {}
        saved = state["sums"]
        self.loaded = {id(p): saved[name_of(p)] for storage in storages for p in storage.params if name_of(p) in saved}
