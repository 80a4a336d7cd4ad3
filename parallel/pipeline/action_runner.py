"""Runs a schedule written as lists of actions (actions.py, zero_bubble.py) on this stage.

Each rank runs its own list in order. Its point-to-point messages (a forward's output to the next
virtual stage, a B's input gradient to the previous one, unless that stage is this rank: the V's
middle hand-off stays local) go in batches, one per instant of the ideal timeline (`simulate`) at
which some action ends: before an action that starts at time t, a rank runs every batch of an
instant up to t that holds a message from or to it, waited in full. Both ends of a message meet in
the batch of the instant its action ends, and a batch's messages between a pair are listed by
(kind, virtual stage, microbatch) on both sides, so the matching by order needs no tags (p2p.py).
Nothing can wait forever: a rank reaches its batch of instant t after actions that need only
messages of earlier instants, which every rank exchanges before t, whatever the real durations.

A B runs under the microbatch's `WeightGradWork` (models/split_backward.py) through
`job.backward_input`; its W hands that work's gradients over through `job.backward_weight`, the
rank's last W (or BW) of the step being the last microbatch for ZeRO (stages 0-1 reduce there).
"""

from __future__ import annotations

import dataclasses

import torch

from megazero.models.split_backward import WeightGradWork, deferring
from .actions import ListSchedule, forward_only as forwards_of, simulate
from .p2p import free_output


@dataclasses.dataclass(frozen=True)
class Message:
    kind: str  # "act" (to the next virtual stage) or "grad" (to the previous)
    virtual: int  # the virtual stage that sends it
    microbatch: int
    source: int  # stage
    target: int  # stage


def message_plan(schedule: ListSchedule) -> list[list]:
    """Per stage, its program: ("run", actions) and ("batch", [Message, ...]) in the order it runs them."""
    layout, timeline = schedule.layout, simulate(schedule)
    at: dict[float, list[Message]] = {}
    for stage, slots in enumerate(timeline.slots):
        for group, _, end in slots:
            for a in group:
                v = layout.virtual_stage(stage, a.chunk)
                if a.kind == "F" and v + 1 < layout.virtual_stages:
                    to = layout.place(v + 1)[0]
                    if to != stage:
                        at.setdefault(end, []).append(Message("act", v, a.microbatch, stage, to))
                elif a.kind in ("B", "BW") and v > 0:
                    to = layout.place(v - 1)[0]
                    if to != stage:
                        at.setdefault(end, []).append(Message("grad", v, a.microbatch, stage, to))
    times = sorted(at)
    programs = []
    for stage, slots in enumerate(timeline.slots):
        mine = [
            (
                t,
                sorted(
                    (m for m in at[t] if stage in (m.source, m.target)), key=lambda m: (m.kind, m.virtual, m.microbatch)
                ),
            )
            for t in times
        ]
        mine = [(t, batch) for t, batch in mine if batch]
        program, k = [], 0
        for group, start, _ in slots:
            while k < len(mine) and mine[k][0] <= start:
                program.append(("batch", mine[k][1]))
                k += 1
            program.append(("run", group))
        program.extend(("batch", batch) for _, batch in mine[k:])
        programs.append(program)
    return programs


class _Stage:
    """One rank's state while it runs its program: inputs and output gradients that arrived, what
    each microbatch's forward saved, the outbox, the deferred weight gradients."""

    def __init__(self, job, schedule: ListSchedule, train: bool):
        self.job, self.schedule, self.train = job, schedule, train
        self.layout, self.stage = schedule.layout, job.stage
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # (virtual, mb) -> input
        self.grads: dict[tuple[int, int], torch.Tensor] = {}  # (virtual, mb) -> output grad
        self.saved: dict[tuple[int, int], tuple] = {}  # (chunk, mb) -> (input, output)
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self.works: dict[tuple[int, int], WeightGradWork] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.held = self.max_held = self.deferred = self.max_deferred = 0
        last = [k for k, a in enumerate(schedule.ranks[self.stage]) if a.kind in ("W", "BW")]
        self.last_weight_grad = schedule.ranks[self.stage][last[-1]] if last else None

    def forward(self, chunk: int, mb: int) -> None:
        v = self.layout.virtual_stage(self.stage, chunk)
        x = self.inputs.pop((v, mb)) if v > 0 else None
        work = self.works.setdefault((chunk, mb), WeightGradWork()) if self.train else None
        with deferring(work):
            out = self.job.forward(chunk, x, mb)
        if v == self.layout.virtual_stages - 1:
            self.losses[mb] = out.detach()
        elif self.layout.place(v + 1)[0] == self.stage:  # the V's turn: stays on this rank
            self.inputs[(v + 1, mb)] = out.detach().requires_grad_()
        else:
            self.outbox[("act", v, mb)] = out
        if self.train:
            self.saved[(chunk, mb)] = (x, out)
            self.held += 1
            self.max_held = max(self.max_held, self.held)

    def input_grad(self, chunk: int, mb: int) -> None:
        v = self.layout.virtual_stage(self.stage, chunk)
        x, out = self.saved.pop((chunk, mb))
        grad = self.grads.pop((v, mb)) if v < self.layout.virtual_stages - 1 else None
        with deferring(self.works[(chunk, mb)]):
            self.job.backward_input(out, grad, (chunk, mb))
        self.held -= 1
        self.deferred += 1
        self.max_deferred = max(self.max_deferred, self.deferred)
        if v == 0:
            return
        if self.layout.place(v - 1)[0] == self.stage:
            self.grads[(v - 1, mb)] = x.grad
        else:
            self.outbox[("grad", v, mb)] = x.grad

    def weight_grad(self, action) -> None:
        work = self.works.pop((action.chunk, action.microbatch))
        self.job.backward_weight(work.run, (action.chunk, action.microbatch), action is self.last_weight_grad)
        self.deferred -= 1

    def run(self, action) -> None:
        if action.kind == "F":
            self.forward(action.chunk, action.microbatch)
            return
        if action.kind in ("B", "BW"):
            self.input_grad(action.chunk, action.microbatch)
        if action.kind in ("W", "BW"):
            self.weight_grad(action)

    def exchange(self, batch) -> None:
        sends = [
            (self.outbox.pop((m.kind, m.virtual, m.microbatch)), m.target) for m in batch if m.source == self.stage
        ]
        wanted = [m for m in batch if m.target == self.stage]
        got = self.job.p2p.exchange_with(sends, [(m.source, f"pipeline {m.kind} received") for m in wanted])
        for tensor, _ in sends:
            free_output(tensor)
        for m, tensor in zip(wanted, got):
            if m.kind == "act":
                self.inputs[(m.virtual + 1, m.microbatch)] = tensor
            else:
                self.grads[(m.virtual - 1, m.microbatch)] = tensor.detach()


def run_list_schedule(job, schedule: ListSchedule, forward_only: bool = False):
    """Runs this stage's list of `schedule` (all forwards alone when `forward_only`); returns (the
    losses by microbatch on the loss stage, the most chunk activations held at once, the most Ws
    waiting at once)."""
    if forward_only:
        schedule = forwards_of(schedule)
    stage = _Stage(job, schedule, train=not forward_only)
    for step, what in message_plan(schedule)[job.stage]:
        if step == "batch":
            stage.exchange(what)
        else:
            for action in what:
                stage.run(action)
    if stage.works or stage.saved or stage.outbox:
        raise RuntimeError(f"schedule {schedule.name!r} left work undone on stage {job.stage}")
    losses = [stage.losses[mb] for mb in sorted(stage.losses)]
    return losses, stage.max_held, stage.max_deferred
