"""RNG streams for dropout under tensor parallelism.

Dropout on tensors that are replicated across TP ranks must draw the same mask on every TP rank (the
default stream, seeded identically across the TP group). Dropout on tensors that are split across TP
ranks (attention probabilities of different heads; sequence-parallel shards) must draw different masks
(the "model-parallel" stream, seeded with the TP rank). The tracker swaps the device's RNG state in
and out around the region that needs the other stream.

Activation recomputation must replay the same masks, so `checkpoint` snapshots the tracker's streams
with the forward and restores them around the recomputation.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from torch import nn
from torch.overrides import _get_current_function_mode_stack

MODEL_PARALLEL = "model-parallel"
# Offset of the model-parallel stream from the base seed (any constant works; it only has to differ).
MODEL_PARALLEL_SEED_OFFSET = 2718


class RNGTracker:
    """Named RNG states for one device type; `fork(name)` runs a block on that stream."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = self._get()
        if self.device.type == "cuda":
            # torch.cuda.manual_seed seeds the *current* device; make that the tracker's device.
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)  # the CPU stream only, not every GPU's
        self.states[name] = self._get()
        self._set(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL):
        saved = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


def seed_everything(seed: int, tp_rank: int, pp_rank: int, device) -> RNGTracker:
    """Seeds the default stream (same across TP, differs by pipeline stage) and the model-parallel one."""
    stage_seed = seed + 100 * pp_rank
    torch.manual_seed(stage_seed)
    tracker = RNGTracker(device)
    tracker.add(MODEL_PARALLEL, stage_seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    return tracker


class TrackedDropout(nn.Dropout):
    """Dropout drawing its mask from one of the tracker's streams."""

    def __init__(self, p: float, tracker: RNGTracker, stream: str = MODEL_PARALLEL):
        super().__init__(p)
        self.tracker, self.stream = tracker, stream

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        with self.tracker.fork(self.stream):
            return super().forward(x)


class TrackedModule(nn.Module):
    """Runs a parameter-free module (e.g. the attention core) on one of the tracker's streams."""

    def __init__(self, inner: nn.Module, tracker: RNGTracker, stream: str = MODEL_PARALLEL):
        super().__init__()
        self.inner, self.tracker, self.stream = inner, tracker, stream

    def forward(self, *args):
        with self.tracker.fork(self.stream):
            return self.inner(*args)


def make_checkpoint_fn(tracker: RNGTracker):
    """Activation checkpointing that replays the tracker's streams during recomputation.

    torch's checkpoint restores the default RNG state for the recomputation; the tracker's named
    streams have moved on by then, so we snapshot them at forward time and swap them back in (and out
    again) when the function runs a second time.
    """

    def checkpoint(function, *args):
        snapshot = tracker.get_states()
        # The backward runs with no torch function mode on (autograd does not carry Python's mode
        # stack), so the recomputation re-enters the forward's: it must run the functions the
        # forward ran (the dry run's kernel stand-ins are such modes, dry_run/gpu_kernels.py).
        modes = _get_current_function_mode_stack()
        calls = [0]

        def run(*inner_args):
            calls[0] += 1
            if calls[0] == 1:
                return function(*inner_args)
            current = tracker.get_states()
            tracker.set_states(snapshot)
            try:
                with contextlib.ExitStack() as stack:
                    for mode in modes:
                        stack.enter_context(mode)
                    return function(*inner_args)
            finally:
                tracker.set_states(current)

        # Recompute the whole function (torch stops early once it has the saved tensors it needs):
        # otherwise modules' post-forward hooks never run in the recomputation, and ZeRO-3's
        # reference counts of units in use would stay raised until the step ends.
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)

    return checkpoint
