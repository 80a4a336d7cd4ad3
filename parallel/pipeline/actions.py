"""Pipeline schedules written as lists of actions per rank, and what can be read off them.

An action is one chunk's forward (F), input-gradient backward (B), weight-gradient backward (W, a
B's deferred half: models/split_backward.py) or whole backward (BW: B, then its W at once) of one
microbatch, on one rank. `Action.overlapped` marks a forward run together with the backward after
it (DualPipeV's pair of chunks; here one after the other, sharing one slot of the timeline).

A `ListSchedule` is every rank's list plus the layout that places the virtual stages (the model
chunks in pipeline order) on ranks: `PipelineLayout`, either looped (stage p runs virtual stages p,
p + pp, ...: Megatron's interleaving) or a V (stage p runs p and 2 pp - 1 - p: ZB-V and DualPipeV,
whose first and last virtual stage are both on stage 0).

`simulate` runs the lists on an ideal machine (each action takes its kind's time, messages take none)
and gives every action's start and end: the timeline the runner takes its message order from
(action_runner.py), the idle fraction the bench compares with measurements, and the peak of
activations and deferred W inputs a rank holds (the planner's and the dry run's counts). A list
that cannot run (an action waits for one that never comes: W before its B, a missing backward)
raises, naming the first stuck action of each rank.
"""

from __future__ import annotations

import dataclasses

KINDS = ("F", "B", "W", "BW")


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # F, B, W or BW
    chunk: int  # the rank's model chunk (0 .. chunks - 1)
    microbatch: int
    overlapped: bool = False  # an F run together with the backward after it (DualPipeV)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"action kind {self.kind!r}; one of {KINDS}")

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}" + ("&" if self.overlapped else "")


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Where the pp x chunks virtual stages run: looped (stage p: p, p + pp, ...) or a V."""

    pp: int
    chunks: int
    v_shape: bool = False

    def __post_init__(self):
        if self.v_shape and self.chunks != 2:
            raise ValueError("a V layout places exactly two chunks per stage")

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.chunks

    def virtual_stage(self, stage: int, chunk: int) -> int:
        if self.v_shape:
            return stage if chunk == 0 else 2 * self.pp - 1 - stage
        return chunk * self.pp + stage

    def place(self, virtual: int) -> tuple[int, int]:
        """(stage, chunk) of a virtual stage."""
        if self.v_shape:
            return (virtual, 0) if virtual < self.pp else (2 * self.pp - 1 - virtual, 1)
        return virtual % self.pp, virtual // self.pp

    def is_first(self, stage: int, chunk: int) -> bool:
        return self.virtual_stage(stage, chunk) == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        return self.virtual_stage(stage, chunk) == self.virtual_stages - 1

    @property
    def loss_stage(self) -> int:
        return self.place(self.virtual_stages - 1)[0]


@dataclasses.dataclass(frozen=True)
class ListSchedule:
    name: str
    layout: PipelineLayout
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]  # per stage, in the order it runs them

    def format(self) -> str:
        """Each rank's actions, one line per rank (chunk.microbatch; & joins an overlapped pair)."""
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in actions) for r, actions in enumerate(self.ranks))

    def describe(self) -> str:
        """`format`, then the ideal timeline's idle fraction (T_F = T_B = T_W) and each stage's peak
        of activations and waiting W inputs (`holdings`): what tools/dry_run.py prints."""
        peaks = [max((h + d for h, d in rank), default=0.0) for rank in holdings(self)]
        waiting = [max((d for _, d in rank), default=0.0) for rank in holdings(self)]
        return (
            f"pipeline schedule {self.name}: {self.layout.pp} stages x {self.layout.chunks} chunks "
            f"({'V' if self.layout.v_shape else 'looped'}), {self.microbatches} microbatches; "
            f"F<chunk>.<microbatch>, B input gradient, W weight gradient, BW both, & overlapped\n"
            + self.format()
            + "\n"
            f"ideal idle fraction {simulate(self).idle_fraction():.3f}; peak held per stage (microbatches "
            f"of a stage's activations, waiting W inputs included): "
            + " ".join(f"{p:g}" for p in peaks)
            + "; most W inputs waiting: "
            + " ".join(f"{w:g}" for w in waiting)
        )


@dataclasses.dataclass(frozen=True)
class Durations:
    """Times of the kinds of action on the ideal machine (the zero-bubble paper's T_F, T_B, T_W)."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0

    def of(self, kind: str) -> float:
        return {
            "F": self.forward,
            "B": self.input_grad,
            "W": self.weight_grad,
            "BW": self.input_grad + self.weight_grad,
        }[kind]


@dataclasses.dataclass
class Timeline:
    """`slots[rank]`: (actions run together, start, end) in the rank's order; `end_of[(stage, kind,
    chunk, microbatch)]`: when each action ended (a BW also ends its B then)."""

    slots: list[list[tuple[tuple[Action, ...], float, float]]]
    makespan: float

    def idle_fraction(self) -> float:
        busy = sum(end - start for rank in self.slots for _, start, end in rank)
        return 1.0 - busy / (len(self.slots) * self.makespan) if self.makespan else 0.0


def _groups(actions) -> list[tuple[Action, ...]]:
    """The rank's actions as the slots they run in (an overlapped F with the action after it)."""
    out, k = [], 0
    while k < len(actions):
        take = 2 if actions[k].overlapped and k + 1 < len(actions) else 1
        out.append(tuple(actions[k : k + take]))
        k += take
    return out


def _needs(schedule: ListSchedule, stage: int, action: Action) -> list[tuple]:
    """The actions (stage, kind, chunk, microbatch) that must have ended before `action` starts."""
    layout, mb = schedule.layout, action.microbatch
    virtual = layout.virtual_stage(stage, action.chunk)
    if action.kind == "F":
        return [] if virtual == 0 else [(*layout.place(virtual - 1), "F", mb)]
    own_forward = (stage, action.chunk, "F", mb)
    if action.kind == "W":
        return [(stage, action.chunk, "B", mb)]
    after = [] if virtual == layout.virtual_stages - 1 else [(*layout.place(virtual + 1), "B", mb)]
    return [own_forward] + after


def simulate(schedule: ListSchedule, durations: Durations = Durations()) -> Timeline:
    """Every rank's actions on an ideal machine: each starts when its rank is free and what it
    needs has ended (list scheduling in the given order). Raises ValueError on a list that cannot
    run to its end."""
    ended: dict[tuple, float] = {}
    groups = [_groups(actions) for actions in schedule.ranks]
    slots: list[list] = [[] for _ in groups]
    free, cursor = [0.0] * len(groups), [0] * len(groups)
    progressed = True
    while progressed:
        progressed = False
        for stage, rank_groups in enumerate(groups):
            while cursor[stage] < len(rank_groups):
                group = rank_groups[cursor[stage]]
                inside = {(stage, a.chunk, a.kind, a.microbatch) for a in group}
                needs = [need for a in group for need in _needs(schedule, stage, a) if need not in inside]
                if any(need not in ended for need in needs):
                    break
                start = max([free[stage]] + [ended[need] for need in needs])
                t = start
                for a in group:
                    t += durations.of(a.kind)
                    ended[(stage, a.chunk, a.kind, a.microbatch)] = t
                    if a.kind == "BW":
                        ended[(stage, a.chunk, "B", a.microbatch)] = t
                        ended[(stage, a.chunk, "W", a.microbatch)] = t
                slots[stage].append((group, start, t))
                free[stage], cursor[stage] = t, cursor[stage] + 1
                progressed = True
    stuck = [f"rank {s}: {' '.join(str(a) for a in g[cursor[s]])}" for s, g in enumerate(groups) if cursor[s] < len(g)]
    if stuck:
        raise ValueError(f"schedule {schedule.name!r} cannot run: waiting forever at " + "; ".join(stuck))
    return Timeline(slots, max(free, default=0.0))


def check(schedule: ListSchedule) -> Timeline:
    """Raises ValueError unless every (virtual stage, microbatch) has one F and one backward (a B and
    a W, or a BW) on its stage, and the lists run to their end; returns the ideal timeline."""
    layout, want = schedule.layout, {}
    for stage, actions in enumerate(schedule.ranks):
        for a in actions:
            if not 0 <= a.chunk < layout.chunks or not 0 <= a.microbatch < schedule.microbatches:
                raise ValueError(
                    f"schedule {schedule.name!r}: rank {stage} has {a}, outside "
                    f"{layout.chunks} chunks x {schedule.microbatches} microbatches"
                )
            kinds = ("B", "W") if a.kind == "BW" else (a.kind,)
            for kind in kinds:
                key = (stage, a.chunk, kind, a.microbatch)
                if key in want:
                    raise ValueError(
                        f"schedule {schedule.name!r}: rank {stage} runs {kind}{a.chunk}.{a.microbatch} twice"
                    )
                want[key] = a
    for stage in range(layout.pp):
        for chunk in range(layout.chunks):
            for mb in range(schedule.microbatches):
                missing = [k for k in ("F", "B", "W") if (stage, chunk, k, mb) not in want]
                if missing:
                    raise ValueError(
                        f"schedule {schedule.name!r}: rank {stage} lacks "
                        f"{'/'.join(missing)} of chunk {chunk}, microbatch {mb}"
                    )
    return simulate(schedule)


def forward_only(schedule: ListSchedule) -> ListSchedule:
    """The schedule's forwards alone, in its order (evaluation)."""
    ranks = tuple(
        tuple(dataclasses.replace(a, overlapped=False) for a in actions if a.kind == "F") for actions in schedule.ranks
    )
    return dataclasses.replace(schedule, name=schedule.name + " (forward only)", ranks=ranks)


def holdings(schedule: ListSchedule) -> list[list[tuple[float, float]]]:
    """Per rank, after each of its actions, the (activations, deferred W inputs) it holds, in
    microbatches of a whole stage (a chunk counts 1 / chunks): a forward holds its activations
    until its B (or BW), and a B holds its W's inputs until that W. The planner weighs the two with
    their bytes and takes the largest sum (megazero/config/activation_memory.py)."""
    share = 1.0 / schedule.layout.chunks
    out = []
    for actions in schedule.ranks:
        held = deferred = 0.0
        series = []
        for a in actions:
            if a.kind == "F":
                held += share
            elif a.kind in ("B", "BW"):
                held -= share
                deferred += share if a.kind == "B" else 0.0
            else:
                deferred -= share
            series.append((held, deferred))
        out.append(series)
    return out
