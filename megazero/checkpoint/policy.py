"""When a run saves and when it stops: Megatron's --save-interval, --exit-interval,
--exit-duration-in-mins and --exit-signal-handler, and the save at the end of training.

Conditions that one rank can see before another (the wall clock, a SIGTERM from Slurm before
preemption) are agreed over the whole layout after every step, so all ranks save and stop at the
same iteration. The training loop folds them into the step's loss reduction (`stop_flags`, then
`after_step(..., agreed)`): no collective of their own. Called without the agreed values,
`after_step` agrees on both in one reduction (`agree_on_any`).
"""
from __future__ import annotations

import dataclasses
import signal
import time

from .saver import CheckpointSaver, agree_on_any


@dataclasses.dataclass
class SavePolicy:
    saver: CheckpointSaver | None = None
    save_interval: int = 0
    exit_interval: int = 0
    exit_duration_mins: float = 0.0
    exit_signal_handler: bool = False

    def __post_init__(self):
        self.started = time.monotonic()
        self.signalled = False
        self.last_saved: int | None = None
        if self.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True            # finish the current step, save, exit 0

    def stop_flags(self) -> tuple[bool, ...]:
        """This rank's (wall clock past --exit-duration-in-mins, signal received), to be agreed
        over the layout; () when neither option is on (nothing to agree on)."""
        if not (self.exit_duration_mins or self.exit_signal_handler):
            return ()
        late = self.exit_duration_mins and time.monotonic() - self.started >= 60 * self.exit_duration_mins
        return bool(late), self.signalled

    def after_step(self, state, consumed_samples: int, agreed: tuple[bool, ...] | None = None) -> str | None:
        """Saves when due; returns why the run stops now (or None to go on). `agreed`: the values of
        `stop_flags()` already agreed over the layout (the training loop's step does that)."""
        it = state.iteration
        reason = None
        if self.exit_interval and it % self.exit_interval == 0:
            reason = f"--exit-interval {self.exit_interval}"
        if self.exit_duration_mins or self.exit_signal_handler:
            late, signalled = agreed if agreed is not None else agree_on_any(self.stop_flags(), state.groups)
            if late:
                reason = reason or f"--exit-duration-in-mins {self.exit_duration_mins:g}"
            if signalled:
                reason = reason or "SIGTERM"
        if self.saver is not None and ((self.save_interval and it % self.save_interval == 0) or reason):
            self.save(state, consumed_samples)
        return reason

    def save(self, state, consumed_samples: int) -> None:
        if self.saver is not None and self.last_saved != state.iteration:
            self.saver.save(state, consumed_samples)
            self.last_saved = state.iteration

    def finish(self, state, consumed_samples: int) -> None:
        """End of training: the final save (if not just done), and any async save committed."""
        if self.saver is not None:
            self.save(state, consumed_samples)
            self.saver.finalize()
