"""A pipeline schedule's steady state, simulated once and counted as often as the step runs it.

A step of m microbatches runs a warm-up, a steady state and a cool-down; past the warm-up every
microbatch (under the interleaved schedules: every group of pp microbatches) issues the same ops in
the same order with the same shapes and frees what it allocated, so a rank's record of a step at m
microbatches is its record at m0 with one block repeated. Megatron's GPT-3 175B recipe runs 192
microbatches a step; simulated one by one, its 60 roles take over half an hour on two cores.

So the dry run simulates each rank twice, at m0 and m0 + p microbatches (p: the schedule's period),
both far enough past the warm-up that every stage reaches its peak and runs at least one steady
block, and `extend` reads the block off their difference and counts it k = (m - m0) / p times:

- sequences (each step's collectives and p2p ops, its host reads): the second run's is the first's
  with one block inserted at one place (their longest common prefix, then the rest equal); the
  step at m holds it k times there. Ops outside the steps (the save) must be equal in both;
- counts (allocations, device-to-host copies and bytes, the stream check's ops and violations):
  linear in the blocks, a + k (b - a);
- peaks (allocated, reserved, per owner, per phase, host, the engine's model states): equal in both
  runs, else the steady state still grows (GPipe holds every microbatch) and the rank is simulated
  in full.

- the caching allocator's requests (device_stand_in's `requests`: sizes, and for each free which
  live block), each step's with the blocks the second run inserts (at up to four places) repeated k
  times and the runs of a number it moves (the last stage's stacked losses, the frees behind them)
  counted a + k (b - a), which needs the third run to show them, replayed through caching_allocator
  at the full count: reserved memory, segments and each phase's reserved bytes move in segment-sized
  steps, which no straight line through two runs gives. Where a log does not extend so, the reserved
  figures are counted a + k (b - a) like the peaks, and the rank's `steady_state["reserved"]` says so
  and why (else REPLAYED);
- the op trace of the last step (megazero.dry_run.trace, what --gpu's timeline times): its records
  grow in more than one place (a slot per microbatch made when the step starts, the steady block,
  and a kernel over every microbatch's loss whose bytes grow), so `blocks_repeated` takes b as a
  with a block inserted at two places at most, each repeated k times, and a record alike but for
  its numbers as a + k (b - a); events are named relative to the step (`_relative`), renumbered
  after.

Whatever does not fit (an error in either run, a sequence that is not one insertion, a peak that
differs) makes `extend` raise NotPeriodic, and job.simulate simulates that rank with every
microbatch instead, saying so. tests/dry_run/test_steady_state.py proves the result equal to the
full simulation's.

Owns the choice of the reduced counts (`plan`) and the merge (`extend`); runs nothing itself.
"""

from __future__ import annotations

import dataclasses

from megazero.dry_run.caching_allocator import replay
from megazero.dry_run.repeats import NotPeriodic, extend_trace, inserts_repeated, linear, repeated, same
from megazero.parallel.pipeline.zero_bubble import ZERO_BUBBLE_SCHEDULES, one_f_one_b, zero_bubble_schedule


class ThirdRunNeeded(Exception):
    """A peak differs between the two reduced runs: a third, one block further, must show it linear."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a job's step is simulated: `simulated` None (every microbatch) or the two reduced counts
    (stage 0's; `by_stage`: each pipeline stage's first count, where they differ)."""

    microbatches: int
    schedule: str
    simulated: tuple[int, int] | None = None
    period: int = 1
    note: str = ""
    by_stage: tuple[int, ...] | None = None

    def counts(self, stage: int) -> tuple[int, int]:
        """The two microbatch counts a rank of pipeline stage `stage` is simulated at."""
        m0 = self.by_stage[stage] if self.by_stage else self.simulated[0]
        return m0, m0 + self.period

    def repeats_at(self, stage: int) -> int:
        return (self.microbatches - self.counts(stage)[0]) // self.period

    @property
    def repeats(self) -> int:
        return self.repeats_at(0) if self.simulated else 0

    def record(self) -> dict:
        return {
            "per_step": self.microbatches,
            "schedule": self.schedule,
            "simulated": list(self.simulated) if self.simulated else None,
            "by_stage": list(self.by_stage) if self.by_stage else None,
            "period": self.period,
            "repeats": self.repeats,
            "note": self.note,
        }


def schedule_name(par) -> str:
    """The schedule the step runs (parallel/pipeline/schedules.py's get_schedule picks 'auto')."""
    if par.pipeline_parallel == 1 and par.schedule not in ZERO_BUBBLE_SCHEDULES:
        return "none"
    if par.schedule == "auto":
        return "interleaved" if par.virtual_stages > 1 else "1f1b"
    return par.schedule


def _starts(name: str, pp: int) -> tuple[list[int], int] | None:
    """(each stage's first count m0, the period): past its warm-up and at its peak. 1F1B: stage 0
    runs pp - 1 warm-up forwards and holds pp microbatches at its peak, so pp (at least 3: a first, a
    steady and a last backward) gives every stage a steady pair. (Stage s at pp - s, its own peak's
    count, was tried: in the test's pp 4 layout stage 1's peak still grew from 3 to 4 microbatches.)
    Interleaved at 2 pp (at pp its whole step is warm-up), a block of pp microbatches; the
    zero-bubble lists from 2 pp."""
    if name == "none":
        return [3], 1
    if name == "1f1b":
        return [max(pp, 3)] * pp, 1
    if name in ("interleaved", "interleaved-zb"):
        return [2 * pp] * pp, pp
    if name in ZERO_BUBBLE_SCHEDULES:
        return [2 * pp] * pp, 1
    return None  # gpipe: every forward before any backward, its peak grows with m


def _kinds(actions) -> list[tuple]:
    return [(a.kind, a.chunk, a.overlapped) for a in actions]


def _list_repeats(name: str, pp: int, chunks: int, starts: list[int], period: int, m: int) -> bool:
    """Does each stage's list of actions at m microbatches equal its list at its m0 with the block
    its list at m0 + period adds repeated (microbatch numbers aside)? 1F1B by its list form."""

    def lists(count):
        made = one_f_one_b(pp, count) if name == "1f1b" else zero_bubble_schedule(name, pp, chunks, count)
        return [_kinds(actions) for actions in made.ranks]

    full, made = lists(m), {}
    for stage, m0 in enumerate(starts):
        for count in (m0, m0 + period):
            if count not in made:
                made[count] = lists(count)
        try:
            if repeated(made[m0][stage], made[m0 + period][stage], (m - m0) // period, "actions") != full[stage]:
                return False
        except NotPeriodic:
            return False
    return True


def plan(cfg, world: int, argv: list[str]) -> Plan:
    """The reduced microbatch counts for this job's step, or why every microbatch is simulated."""
    par = cfg.parallel
    dp = world // (par.tensor_parallel * par.pipeline_parallel * par.context_parallel)
    m, name = cfg.num_microbatches(dp), schedule_name(par)
    full = f"every one of its {m} microbatches a step simulated"
    why = None
    if cfg.rampup is not None:
        why = "--rampup-batch-size changes the microbatches from step to step"
    elif "--global-batch-size" not in argv or cfg.batch_from is not None or "--train-samples" in argv:
        why = "the reduced runs set --global-batch-size, and this job's batch or step count comes from elsewhere"
    found = _starts(name, par.pipeline_parallel)
    if why is None and found is None:
        why = f"the {name} schedule holds every microbatch before its first backward (no steady state)"
    if why is not None:
        return Plan(m, name, note=f"{full}: {why}")
    starts, period = found
    starts = [m0 + (m - m0) % period for m0 in starts]
    m0 = starts[0]
    if 2 * m0 + period >= m:
        return Plan(m, name, period=period, note=f"{full} (no fewer than the shortcut's {m0} + {m0 + period})")
    if (name == "1f1b" or name in ZERO_BUBBLE_SCHEDULES) and not _list_repeats(
        name, par.pipeline_parallel, par.virtual_stages, starts, period, m
    ):
        return Plan(
            m,
            name,
            period=period,
            note=f"{full}: the {name} lists of actions at {m0} and "
            f"{m0 + period} microbatches do not extend to its list at {m}",
        )
    by_stage = tuple(starts) if len(set(starts)) > 1 else None
    stages = " (per stage: by_stage)" if by_stage else ""
    return Plan(
        m,
        name,
        (m0, m0 + period),
        period,
        f"{m} microbatches a step ({name}): {m0} and {m0 + period} simulated{stages}, the steady "
        f"state's block of {period} repeated {(m - m0) // period} times (megazero/dry_run/steady_state.py)",
        by_stage,
    )


def reduced_argv(argv: list[str], cfg, world: int, microbatches: int) -> list[str]:
    """`argv` with the global batch that makes `microbatches` a step."""
    par = cfg.parallel
    dp = world // (par.tensor_parallel * par.pipeline_parallel * par.context_parallel)
    out = list(argv)
    i = out.index("--global-batch-size")
    out[i + 1] = str(microbatches * cfg.micro_batch_size * dp)
    return out


# --- the merge ----------------------------------------------------------------------------------------
def _steps(entries: list, ends: list[int]) -> tuple[list[list], list]:
    """Each step's entries (the first step's with the setup before it) and those after the last."""
    cuts = [0] + list(ends)
    return [entries[lo:hi] for lo, hi in zip(cuts, cuts[1:])], entries[cuts[-1] :]


def _extend_entries(a, b, k: int) -> tuple[list, list[int], list[int]]:
    steps_a, tail_a = _steps(a.entries, a.step_ends)
    steps_b, tail_b = _steps(b.entries, b.step_ends)
    same(len(steps_a), len(steps_b), "the number of steps")
    same(tail_a, tail_b, "the ops after the last step")
    entries, ends, blocks = [], [], []
    for n, (x, y) in enumerate(zip(steps_a, steps_b)):
        entries += repeated(x, y, k, f"step {n + 1}'s ops")
        ends.append(len(entries))
        blocks.append(len(y) - len(x))
    return entries + tail_a, ends, blocks


def _runs_of_step(reads: list[dict]) -> list[tuple]:
    """The reads cut where their step changes: (step, its reads), in order."""
    out = []
    for r in reads:
        if out and out[-1][0] == r["step"]:
            out[-1][1].append(r)
        else:
            out.append((r["step"], [r]))
    return out


def _extend_reads(a: list[dict], b: list[dict], k: int) -> list[dict]:
    runs_a, runs_b = _runs_of_step(a), _runs_of_step(b)
    same([s for s, _ in runs_a], [s for s, _ in runs_b], "the steps of the host reads")
    out = []
    for (step, x), (_, y) in zip(runs_a, runs_b):
        out += (
            repeated(x, y, k, f"step {step}'s host reads")
            if step is not None
            else same(x, y, "a host read outside the steps")
        )
    return out


_COUNTS = ("allocations", "d2h_copies", "d2h_bytes")  # grow with every block


def _affine(a, b, k: int, what: str, linear_ok: bool):
    """Numbers a + k (b - a) (a peak only when `linear_ok`: else it must be equal in both runs, or a
    third run must show it linear), nested dicts key by key, anything else equal in both runs."""
    if isinstance(a, dict) and isinstance(b, dict):
        same(sorted(a), sorted(b), f"{what}'s keys")
        return {key: _affine(a[key], b[key], k, f"{what} {key!r}", linear_ok) for key in a}
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if a != b and not linear_ok:
            raise ThirdRunNeeded(f"{what} differs between the reduced runs ({a} against {b})")
        return linear(a, b, k)
    return same(a, b, what)


def _extend_requests(a: list | None, b: list | None, k: int) -> tuple[list | None, bool]:
    """The caching allocator's requests (device_stand_in's `requests`) at the full count: each step's
    (cut after its "step" note; the setup with the first) with the blocks the second run inserts
    repeated k times and the runs of a number it moves counted a + k (b - a) (repeats.inserts_repeated),
    the requests after the last step equal in both; and whether a number moved."""
    if a is None or b is None:
        return same(a, b, "the allocator's requests"), False
    ends_a = [i + 1 for i, r in enumerate(a) if r == "step"]
    ends_b = [i + 1 for i, r in enumerate(b) if r == "step"]
    steps_a, tail_a = _steps(a, ends_a)
    steps_b, tail_b = _steps(b, ends_b)
    same(len(steps_a), len(steps_b), "the allocator's steps")
    same(tail_a, tail_b, "the allocator's requests after the last step")
    out, moved = [], False
    for n, (x, y) in enumerate(zip(steps_a, steps_b)):
        step, grew = inserts_repeated(x, y, k, f"step {n + 1}'s allocator requests")
        out, moved = out + step, moved or grew
    return out + tail_a, moved


_RESERVED = ("reserved_peak", "segments")  # and each phase's "reserved": the allocator's, replayed


def _extend_memory(a: dict, b: dict, k: int, peaks_linear: bool, requests: list | None, replayed=None) -> dict:
    """Counts a + k (b - a); peaks equal in both runs (or linear, `peaks_linear`); the caching
    allocator's figures (reserved, segments: they move in 2 MiB and larger steps, no straight line)
    from replaying its requests at the full count (caching_allocator.replay; `replayed`: its result,
    known already)."""
    if requests is not None:
        b = {**b, **{key: a[key] for key in _RESERVED}}
        b["phases"] = {p: {**f, "reserved": a["phases"].get(p, f)["reserved"]} for p, f in b["phases"].items()}
    # (the planner's figures are the job's own: the caller puts job.planner_figures there)
    out = {
        key: a[key]
        if key == "planner"
        else _affine(a[key], b[key], k, f"memory {key!r}", peaks_linear or key in _COUNTS)
        for key in a
    }
    if requests is not None:
        replayed = replayed or replay(requests)
        out.update({key: replayed[key] for key in _RESERVED})
        for phase, figures in out["phases"].items():
            figures["reserved"] = replayed["reserved_at"][phase]
    return out


def _extend_streams(a: dict | None, b: dict | None, k: int) -> dict | None:
    if a is None or b is None:
        return same(a, b, "the stream check")
    return {
        "semantics": same(a["semantics"], b["semantics"], "the stream check's semantics"),
        "side_ops": linear(a["side_ops"], b["side_ops"], k),
        "violations": linear(a["violations"], b["violations"], k),
        "found": list(a["found"]) + [m for m in b["found"] if m not in a["found"]],
    }


REPLAYED = "replayed: the allocator's requests at the full count (caching_allocator.replay)"


def _requests_rule(a, b, k: int, c=None) -> tuple[list | None, str | None]:
    """The allocator's requests at k blocks and the rule the reserved figures follow: replayed, or,
    where the requests do not extend (or, with a third run `c`, their extension at two blocks is not
    its log), counted a + k (b - a) like the peaks, with the reason (None: no allocator, a CPU).
    ThirdRunNeeded where a number in them moves between a and b and no `c` shows it linear."""
    if a.requests is None and b.requests is None:
        return None, None
    try:
        requests, moved = _extend_requests(a.requests, b.requests, k)
        if c is not None and _extend_requests(a.requests, b.requests, 2)[0] != c.requests:
            raise NotPeriodic("its requests at two blocks are not the third run's")
    except NotPeriodic as why:
        return None, f"a + k (b - a), not replayed: {why}"
    if moved and c is None:
        raise ThirdRunNeeded("a number in the allocator's requests moves between the reduced runs (reserved memory)")
    return requests, REPLAYED


def _merge(a, b, k: int, peaks_linear: bool, requests: list | None, reserved: str | None, replayed=None):
    entries, ends, blocks = _extend_entries(a, b, k)
    return dataclasses.replace(
        a,
        entries=entries,
        step_ends=ends,
        host_reads=_extend_reads(a.host_reads, b.host_reads, k),
        memory=_extend_memory(a.memory, b.memory, k, peaks_linear, requests, replayed),
        requests=requests,
        model_states=same(a.model_states, b.model_states, "the engine's model states"),
        stream_check=_extend_streams(a.stream_check, b.stream_check, k),
        trace=extend_trace(a.trace, b.trace, k),
        skipped_steps=same(a.skipped_steps, b.skipped_steps, "the skipped steps"),
        steady_state={"ops_per_block": blocks, **({"reserved": reserved} if reserved else {})},
    )


def _what_differs(x, y) -> str | None:
    fields = (
        "entries",
        "step_ends",
        "host_reads",
        "stream_check",
        "model_states",
        "skipped_steps",
        "trace",
        "requests",
    )
    for field in fields if x.requests is not None else fields[:-1]:
        if getattr(x, field) != getattr(y, field):
            return field
    for key in x.memory:
        if key != "planner" and x.memory[key] != y.memory[key]:
            return f"memory {key!r}"
    return None


def extend(a, b, plan: Plan, stage: int = 0, c=None):
    """The record (job.RankRun) of a rank of pipeline stage `stage` at plan.microbatches from its
    runs at plan.counts(stage) (`a`, `b`); NotPeriodic when they are not one steady block apart;
    ThirdRunNeeded when a peak differs between them, unless `c`, its run one block further, equals
    what a and b predict for it (then every figure is counted a + k (b - a))."""
    for run in (a, b, c):
        if run is not None and run.error:
            raise NotPeriodic(f"a reduced run stopped ({run.error})")
    same(a.coords, b.coords, "the rank's coordinates")
    if c is not None:
        two, reserved = _requests_rule(a, b, 2, c)
        figures = None  # (the requests at two blocks are the third run's own: its figures are their replay)
        if two is not None:
            figures = {key: c.memory[key] for key in _RESERVED}
            figures["reserved_at"] = {p: f["reserved"] for p, f in c.memory["phases"].items()}
        differs = _what_differs(_merge(a, b, 2, True, two, reserved, figures), c)
        if differs:
            raise NotPeriodic(f"{differs}: the third run is not the first with two blocks")
    k = plan.repeats_at(stage)
    run = _merge(a, b, k, c is not None, *_requests_rule(a, b, k, c))
    run.steady_state = {
        "simulated": list(plan.counts(stage)) + ([plan.counts(stage)[1] + plan.period] if c else []),
        "repeats": k,
        **run.steady_state,
    }
    return run
