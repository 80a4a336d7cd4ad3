"""What the loop does around a step that changes no number: Megatron's --manual-gc (Python's
automatic collector off, a collection every --manual-gc-interval steps and around evaluation, at the
same step on every rank, so no rank stalls the others at a random moment) and --profile (a
torch.profiler trace of the steps [--profile-step-start, --profile-step-end) on the ranks of
--profile-ranks, one Chrome-trace JSON per rank, viewable in Perfetto or TensorBoard's profiler).

Steps are counted as Megatron counts them when it profiles: the step taken after N completed
iterations is step N, so a run resumed from a checkpoint profiles the same steps. It owns the
collector's switch (restored on close) and the profiler; it must not touch the model or the groups.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from megazero.config.train_config import RunOptions


def trace_path(run_dir: str, rank: int) -> Path:
    """Where rank `rank`'s --profile trace is written."""
    return Path(run_dir) / "profile" / f"rank{rank}.pt.trace.json"


class Housekeeping:
    def __init__(self, options: RunOptions, rank: int, device: torch.device, run_dir: str):
        self.options, self.rank, self.device, self.run_dir = options, rank, device, run_dir
        self.gc_was_enabled = gc.isenabled()
        if options.manual_gc:
            gc.disable()
            gc.collect()
        self.profiles = options.profile and rank in options.profile_ranks
        self.profiler = self.span = None

    def before_step(self, iteration: int) -> None:
        """Before the step numbered `iteration` (from 1)."""
        if self.profiles and iteration - 1 == self.options.profile_step_start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()
        if self.profiler is not None:  # names the step in the trace
            self.span = torch.profiler.record_function(f"megazero iteration {iteration}")
            self.span.__enter__()

    def after_step(self, iteration: int) -> None:
        options = self.options
        if options.manual_gc and options.manual_gc_interval and iteration % options.manual_gc_interval == 0:
            gc.collect()
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
        if self.profiler is not None:
            self.profiler.step()
            if iteration == options.profile_step_end:
                self._finish_trace()

    def around_evaluation(self) -> None:
        """Megatron's --manual-gc-eval (its default): collect before and after an evaluation."""
        if self.options.manual_gc:
            gc.collect()

    def _finish_trace(self) -> None:
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        path = trace_path(self.run_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))

    def close(self) -> None:
        """The run ended (or stopped early): a trace in progress is written, the collector restored."""
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
        if self.profiler is not None:
            self._finish_trace()
        if self.options.manual_gc and self.gc_was_enabled:
            gc.enable()
