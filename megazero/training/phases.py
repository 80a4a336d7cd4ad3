"""The phases of a training run, and the one list of listeners that hears them.

A run names its phases as it enters and leaves them: "build" (the model chunks made on the meta
device), "initial value" (one parameter's starting value, drawn on the host), then per step
"train step" around the whole step and, inside it, "forward" and "backward" (each microbatch's, from
the pipeline schedule), "reduce" (the last gradients reduced and finalised) and "step" (the
optimizer step). Whoever needs to know listens instead of wrapping the loop's functions:
wall_clock_breakdown's Timers and the straggler watch time the step's inner phases, the
out-of-memory mark names the phase an allocation failed in, and the dry run's device stand-in
(megazero.dry_run) notes its memory at phase edges and stops counting while the model is built.

A listener has `phase_started(name)` and `phase_ended(name, error)` (`error`: the exception leaving
the phase, or None). `listening(listener)` adds one to every `Phases` made while it is open (the dry
run's way in: it does not build the TrainState).

Must not: change what a phase computes; a listener only observes.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

from megazero.training.out_of_memory import mark_phase

STEP_PHASES = ("forward", "backward", "reduce", "step")  # what the timers time


class PhaseListener(Protocol):
    def phase_started(self, name: str) -> None: ...

    def phase_ended(self, name: str, error: BaseException | None) -> None: ...


class Timed:
    """Times the step's phases on `timers` (anything with start(name) / stop(name): core.streams'
    Timers, the straggler watch)."""

    def __init__(self, timers, names=STEP_PHASES):
        self.timers, self.names = timers, names

    def phase_started(self, name: str) -> None:
        if name in self.names:
            self.timers.start(name)

    def phase_ended(self, name: str, error) -> None:
        if name in self.names:
            self.timers.stop(name)


class OutOfMemoryMark:
    """Marks an out-of-memory error with the innermost step phase it left (its one line names it)."""

    def phase_started(self, name: str) -> None:
        pass

    def phase_ended(self, name: str, error) -> None:
        if name in STEP_PHASES:
            mark_phase(error, name)


class _Open:
    listeners: list = []  # added by `listening`, heard by every Phases made meanwhile


@contextlib.contextmanager
def listening(listener: PhaseListener):
    """Every `Phases` made while the block runs tells `listener` too (after its own listeners)."""
    _Open.listeners.append(listener)
    try:
        yield listener
    finally:
        _Open.listeners.remove(listener)


class _Phase:
    __slots__ = ("listeners", "name")

    def __init__(self, listeners, name):
        self.listeners, self.name = listeners, name

    def __enter__(self):
        for listener in self.listeners:
            listener.phase_started(self.name)

    def __exit__(self, kind, err, tb):
        for listener in reversed(self.listeners):
            listener.phase_ended(self.name, err)


class Phases:
    """The run's listeners, in order: the given ones, the out-of-memory mark, then those
    `listening` had open when it was made."""

    def __init__(self, *listeners: PhaseListener):
        self.listeners = [*listeners, OutOfMemoryMark(), *_Open.listeners]

    def __call__(self, name: str) -> _Phase:
        """`with phases("forward"):` tells every listener the phase starts, then that it ended."""
        return _Phase(self.listeners, name)
