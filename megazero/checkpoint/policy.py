"""When a run saves and when it stops: Megatron's --save-interval, --exit-interval,
--exit-duration-in-mins and --exit-signal-handler (with --exit-signal), the save at the end of training,
and what a failed save does.

Conditions that one rank can see before another (the wall clock, a signal from Slurm before
preemption, Ctrl-C) are agreed over the whole layout after every step, so all ranks save and stop at
the same iteration. The training loop folds them into the step's loss reduction (`stop_flags`, then
`after_step(..., agreed)`): no collective of their own. Called without the agreed values,
`after_step` agrees on both in one reduction (`agree_on_any`). With --exit-signal-handler, SIGINT
(Ctrl-C) is handled as the chosen signal is: finish the step, save, exit 0.

A save that fails (no room, a failed write: a SaveError, the same on every rank) is logged in one line
and training goes on, the previous checkpoint intact, unless --exit-on-save-failure asks to stop or the
save was the last one (the end of training, or a stop the user asked for): then the error ends the run.

A model whose last loss was not finite (a run that diverged under --no-check-for-nan-in-loss-and-grad)
is never saved: one line says so. --ckpt-keep-last deletes old checkpoints only once a step with a
finite loss followed the newest one (or the run ended as planned), and a run stopped for diverging
(megazero.training.divergence) saves nothing more and points `latest` back at the last checkpoint a
finite loss followed: the checkpoint saved in the step that blew the weights up never costs the
healthy one before it.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from typing import Callable

from .agreement import SaveError
from .files import latest_iteration_name
from .saver import CheckpointSaver, agree_on_any


@dataclasses.dataclass
class SavePolicy:
    saver: CheckpointSaver | None = None
    save_interval: int = 0
    exit_interval: int = 0
    exit_duration_mins: float = 0.0
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"
    exit_on_save_failure: bool = False
    say: Callable[[str], None] = print

    def __post_init__(self):
        self.started = time.monotonic()
        self.signalled: str | None = None  # the name of the signal received
        self.last_saved: int | None = None
        self.last_loss: float | None = None  # the loss of the last step (None: no step yet)
        if self.exit_signal_handler:
            for name in {self.exit_signal, "SIGINT"}:
                signal.signal(getattr(signal, name), self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = signal.Signals(signum).name  # finish the current step, save, exit 0

    def stop_flags(self) -> tuple[bool, ...]:
        """This rank's (wall clock past --exit-duration-in-mins, signal received), to be agreed
        over the layout; () when neither option is on (nothing to agree on)."""
        if not (self.exit_duration_mins or self.exit_signal_handler):
            return ()
        late = self.exit_duration_mins and time.monotonic() - self.started >= 60 * self.exit_duration_mins
        return bool(late), self.signalled is not None

    def after_step(
        self, state, consumed_samples: int, agreed: tuple[bool, ...] | None = None, loss: float | None = None
    ) -> str | None:
        """Saves when due; returns why the run stops now (or None to go on). `agreed`: the values of
        `stop_flags()` already agreed over the layout (the training loop's step does that); `loss`:
        the step's loss (the same on every rank), kept in the checkpoint's metadata."""
        it = state.iteration
        self.last_loss = loss
        if self.saver is not None and loss is not None and math.isfinite(loss):
            self.saver.confirm()
        reason = None
        if self.exit_interval and it % self.exit_interval == 0:
            reason = f"--exit-interval {self.exit_interval}"
        if self.exit_duration_mins or self.exit_signal_handler:
            late, signalled = agreed if agreed is not None else agree_on_any(self.stop_flags(), state.groups)
            if late:
                reason = reason or f"--exit-duration-in-mins {self.exit_duration_mins:g}"
            if signalled:
                reason = reason or self.signalled or "a signal another rank received"
        if self.saver is not None and ((self.save_interval and it % self.save_interval == 0) or reason):
            last = reason is not None or it == state.cfg.train_iters
            why = f"stopping: {reason}" if reason else "final" if last else f"--save-interval {self.save_interval}"
            self.save(state, consumed_samples, last=last, why=why)
        return reason

    def save(self, state, consumed_samples: int, last: bool = False, why: str = "") -> None:
        """Saves unless this iteration is saved already; a failed save is logged and training goes on,
        unless it is the `last` one or --exit-on-save-failure is set (then the SaveError ends the run)."""
        if self.saver is None or self.last_saved == state.iteration:
            return
        if self.last_loss is not None and not math.isfinite(self.last_loss):
            self.say(
                f" iteration {state.iteration}: not saved: its loss is {self.last_loss} (the model "
                f"diverged); {self.kept()}"
            )
            return
        try:
            self.saver.save(state, consumed_samples, why, loss=self.last_loss)
        except SaveError as err:
            if last or self.exit_on_save_failure:
                raise
            self.say(f" warning: {err}; training goes on (--exit-on-save-failure stops instead)")
            return
        self.last_saved = state.iteration

    def kept(self) -> str:
        """Which checkpoint a stopped run leaves, in words (a save in flight counts once committed)."""
        if self.saver is None:
            return "no checkpoint: no --save"
        latest = latest_iteration_name(self.saver.save_dir)
        save = self.saver.save_dir
        return (
            f"last checkpoint: {save / latest} (resume with --load {save})"
            if latest
            else f"no checkpoint saved yet in {save}"
        )

    def stop_without_saving(self) -> str:
        """A diverged run's end: commits a save still in flight (collective), saves nothing more,
        points `latest` back at the last checkpoint a finite loss followed; returns what is kept."""
        if self.saver is None:
            return "no checkpoint: no --save"
        self.saver.finalize()
        return self.saver.rewind()

    def finish(self, state, consumed_samples: int) -> None:
        """End of training: the final save (if not just done), and any async save committed."""
        if self.saver is not None:
            self.save(state, consumed_samples, last=True, why="final")
            self.saver.finalize()
            self.saver.confirm()  # a run that ended as planned: its last checkpoint stands
