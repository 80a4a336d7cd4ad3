"""megazero/dry_run/steady_state.py: a step of many microbatches simulated at two small counts, its
steady state counted as often as the schedule runs it, equals the simulation of every microbatch.

- 1F1B (pp 4 x tp 2 x dp 2, 16 microbatches, dropout 0.1: simulated at 4 and 5, and 6 where a
  peak moved, through job.simulate's plan) and interleaved (pp 2 x 2 chunks x dp 2, 12 microbatches: at 4 and 6): every
  rank's collectives and p2p ops (sequence, group, ranks, dtype, size, call site), host reads, memory
  (peak, reserved, per owner, per phase, allocations), stream-check counts and the report's per-rank
  record (its per-group totals included) equal the full simulation's, and the cross-rank checks pass;
- the op trace of the last step (megazero.dry_run.trace: kernels, collectives, events, waits)
  equals the full simulation's record for record, and so does the timeline on an H100 (step time,
  compute / exposed communication / bubble / host time per rank);
- planted: the steady block counted once too few makes them differ (the ops, the totals, the
  timeline's step);
- the caching allocator's figures: a synthetic log whose blocks held to the step's end fill a second
  2 MiB segment at 40 microbatches but not at 4 or 5, extended and replayed, equals the log at 40
  and its replay; planted: the old rule (reserved and segments as the two runs show them) is a
  segment short;
- the plan: GPipe and a batch ramp fall back to every microbatch with the line saying why, the
  zero-bubble schedules' lists extend (their lists at the full count are the reduced ones' with the
  block repeated), Megatron's GPT-3 175B recipe at global batch 1536 runs 16 and 17 of its 192.
"""

from __future__ import annotations

import dataclasses

import pytest

from megazero.config.train_config import topology_of
from megazero.dry_run import repeats, steady_state
from megazero.dry_run.caching_allocator import replay
from megazero.dry_run.cross_rank_checks import check_all
from megazero.dry_run.job import RankRun, job_config, simulate
from megazero.dry_run.report import rank_record, table
from megazero.dry_run.speed import timeline_of

BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "2",
    "--log-interval",
    "1",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "101",
    "--lr",
    "1e-3",
    "--bf16",
    "--zero-stage",
    "1",
]


def _record(run) -> dict:
    out = rank_record(run)
    out.pop("steady_state")
    return out


def _assert_equal(full, fast) -> None:
    assert [r.rank for r in full] == [r.rank for r in fast]
    for f, s in zip(full, fast):
        assert f.error is None and s.error is None, (f.error, s.error)
        assert s.entries == f.entries, f"rank {f.rank}: the ops differ"
        assert s.step_ends == f.step_ends and s.host_reads == f.host_reads
        assert s.memory == f.memory, f"rank {f.rank}: the memory differs"
        assert s.stream_check == f.stream_check and s.model_states == f.model_states
        assert s.trace == f.trace, f"rank {f.rank}: the traced step differs"
        assert _record(s) == _record(f), f"rank {f.rank}: the report's record differs"
    assert check_all(fast) == []


def _one_per_stage(argv, world) -> list[int]:
    topology = topology_of(job_config(argv, world), world)
    return [r for r in range(world) if topology.coords(r).tp == 0 and topology.coords(r).dp == 0]


def test_1f1b_counted_from_4_and_5_microbatches_equals_every_microbatch_simulated():
    argv = BASE + [
        "--global-batch-size",
        "32",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "4",
    ]
    plan = steady_state.plan(job_config(argv, 16), 16, argv)
    assert (plan.microbatches, plan.schedule, plan.simulated, plan.repeats) == (16, "1f1b", (4, 5), 12)
    assert plan.by_stage is None
    ranks = _one_per_stage(argv, 16) + [13]  # and the last stage's other tensor-parallel rank
    fast = simulate(argv, 16, ranks, processes=2, plan=plan)
    # (a step's losses stay until its end, 512 bytes a microbatch: where that moves a peak, a third
    # run at 6 shows it linear)
    assert all(r.steady_state["simulated"][:2] == [4, 5] for r in fast), [r.steady_state for r in fast]
    full = simulate(argv, 16, ranks, processes=2)
    _assert_equal(full, fast)
    # every rank's reserved figures replayed from its allocator log at 16, the last stage's (12, 13)
    # too: its log grows in a steady block, a request and a free per microbatch, the stacked losses'
    # sizes and the place of the frees after them (repeats._pieces); the log equals the full one's
    for f, s in zip(full, fast):
        assert s.steady_state["reserved"] == steady_state.REPLAYED, (s.rank, s.steady_state)
        assert s.requests == f.requests, f"rank {f.rank}: the allocator's requests differ"
    cfg = job_config(argv, 16)
    assert timeline_of(fast, cfg, 16, "h100") == timeline_of(full, cfg, 16, "h100")


def test_interleaved_counted_from_4_and_6_equals_every_microbatch_and_a_wrong_count_differs():
    argv = BASE + [
        "--global-batch-size",
        "24",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
    ]
    cfg = job_config(argv, 4)
    plan = steady_state.plan(cfg, 4, argv)
    assert (plan.microbatches, plan.schedule, plan.simulated, plan.period, plan.repeats) == (
        12,
        "interleaved",
        (4, 6),
        2,
        4,
    )
    ranks = _one_per_stage(argv, 4)
    # (a peak moves by 512 bytes a microbatch here: the third run, one block further, shows it linear)
    a, b, c = (simulate(steady_state.reduced_argv(argv, cfg, 4, m), 4, ranks, processes=2) for m in (4, 6, 8))
    with pytest.raises(steady_state.ThirdRunNeeded, match="memory"):
        steady_state.extend(a[0], b[0], plan)
    full = simulate(argv, 4, ranks, processes=2)
    _assert_equal(full, [steady_state.extend(x, y, plan, 0, z) for x, y, z in zip(a, b, c)])
    # planted: the block counted once too few (a wrong repetition count)
    short = dataclasses.replace(plan, microbatches=10)
    wrong = [steady_state.extend(x, y, short, 0, z) for x, y, z in zip(a, b, c)]
    with pytest.raises(AssertionError, match="the ops differ"):
        _assert_equal(full, wrong)
    assert [_record(w)["step_comm"] for w in wrong] != [_record(f)["step_comm"] for f in full]
    right = timeline_of(full, cfg, 4, "h100")
    assert timeline_of([steady_state.extend(x, y, plan, 0, z) for x, y, z in zip(a, b, c)], cfg, 4, "h100") == right
    assert timeline_of(wrong, cfg, 4, "h100")["step_s"] < right["step_s"]


def test_plan_falls_back_where_the_steady_state_does_not_repeat_and_the_lists_extend():
    def plan_of(flags, world=8):
        argv = BASE + ["--num-layers", "8"] + flags
        return steady_state.plan(job_config(argv, world), world, argv)

    gpipe = plan_of(
        ["--global-batch-size", "64", "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "gpipe"]
    )
    assert gpipe.simulated is None and "holds every microbatch before its first backward" in gpipe.note
    ramp = plan_of(
        ["--global-batch-size", "64", "--rampup-batch-size", "16", "16", "64", "--pipeline-model-parallel-size", "4"]
    )
    assert ramp.simulated is None and "--rampup-batch-size" in ramp.note
    few = plan_of(["--global-batch-size", "16", "--pipeline-model-parallel-size", "4"])  # 8: 4 + 5 is more
    assert few.simulated is None and "every one of its 8 microbatches" in few.note
    for name, chunks, expected in (
        ("zb-h1", [], (8, 9)),
        ("zbv", ["--num-layers-per-virtual-pipeline-stage", "1"], (8, 9)),
        ("dualpipev", ["--num-layers-per-virtual-pipeline-stage", "1"], (8, 9)),
        ("interleaved-zb", ["--num-layers-per-virtual-pipeline-stage", "1"], (8, 12)),
    ):
        got = plan_of(
            ["--global-batch-size", "96", "--pipeline-model-parallel-size", "4", "--pipeline-schedule", name] + chunks
        )
        assert (got.schedule, got.simulated) == (name, expected), got.note
    # the lists' check can fail: below stage 0's warm-up (3 forwards) 1F1B's list has no steady pair
    assert steady_state._list_repeats("1f1b", 4, 1, [4, 4, 4, 4], 1, 16)
    assert not steady_state._list_repeats("1f1b", 4, 1, [2, 2, 2, 2], 1, 16)
    # Megatron's GPT-3 175B recipe as written: global batch 1536 at dp 8, 192 microbatches a step
    gpt3 = [
        "--num-layers",
        "96",
        "--hidden-size",
        "12288",
        "--num-attention-heads",
        "96",
        "--seq-length",
        "2048",
        "--max-position-embeddings",
        "2048",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1536",
        "--tensor-model-parallel-size",
        "8",
        "--pipeline-model-parallel-size",
        "16",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "50257",
    ]
    big = steady_state.plan(job_config(gpt3, 1024), 1024, gpt3)
    assert (big.microbatches, big.simulated, big.repeats) == (192, (16, 17), 176)
    assert big.by_stage is None


def test_repeated_inserts_the_block_where_the_runs_part_and_refuses_two_blocks():
    assert repeats.repeated(list("wFBc"), list("wFBFBc"), 3, "x") == list("wFBFBFBFBc")
    assert repeats.repeated(list("abc"), list("abc"), 5, "x") == list("abc")
    with pytest.raises(steady_state.NotPeriodic, match="differ past one inserted block"):
        repeats.repeated(list("aXbY"), list("aXXbYY"), 2, "x")  # two places grow


def test_a_traced_step_grows_in_several_places_and_its_events_are_renumbered():
    # a slot per microbatch where the step starts, the warm-up, the steady block; a kernel over
    # every microbatch's loss whose bytes grow (8 a microbatch)
    a = [
        ("s",),
        ("k", "slot", 8),
        ("k", "W", 0),
        ("k", "F", 1),
        ("k", "B", 2),
        ("k", "zeros", 8),
        ("k", "stack", 32),
        ("e",),
    ]
    b = [
        ("s",),
        ("k", "slot", 8),
        ("k", "slot", 8),
        ("k", "W", 0),
        ("k", "F", 1),
        ("k", "B", 2),
        ("k", "F", 1),
        ("k", "B", 2),
        ("k", "zeros", 8),
        ("k", "stack", 40),
        ("e",),
    ]
    assert repeats.blocks_repeated(a, b, 2, "x") == [("s",)] + [("k", "slot", 8)] * 3 + [("k", "W", 0)] + [
        ("k", "F", 1),
        ("k", "B", 2),
    ] * 3 + [("k", "zeros", 8), ("k", "stack", 48), ("e",)]
    assert repeats.blocks_repeated(a, b, 1, "x") == b and repeats.blocks_repeated(a, b, 0, "x") == a
    with pytest.raises(steady_state.NotPeriodic, match="past two inserted blocks"):
        repeats.blocks_repeated(list("aXbYc"), list("aXXbYYcZ"), 2, "x")  # three places grow

    # events: a block records one (#n) and waits on it; the wait after the block on the last one;
    # one recorded before the step (#3) and an unknown one (0) stay as they are
    def step(blocks: int, base: int):
        out = [("w", 1, 3)]
        for n in range(blocks):
            out += [("r", 0, base + n + 1), ("w", 1, base + n + 1)]
        return out + [("e", base + blocks), ("w", 1, 0)]

    trace = {"threads": [], "streams": {0: "default", 1: "side"}}
    got = repeats.extend_trace({**trace, "records": step(2, 10)}, {**trace, "records": step(3, 12)}, 5)
    assert got == {**trace, "records": step(7, 10 + 5 * 2)}


def _requests(m: int, steps: int = 2) -> list:
    """A 1F1B-like rank's allocator requests (caching_allocator.replay's form) at m microbatches:
    model states, then per step each microbatch's activations (3 MiB, freed two microbatches later)
    and its loss (64 KiB, a small block held to the step's end, freed newest first), phase notes."""
    out, live = [100 << 20, "setup"], ["states"]

    def free(name):
        out.append(live.index(name) - len(live))
        live.remove(name)

    for _ in range(steps):
        for i in range(m):
            out.append(3 << 20)
            live.append(("act", i))
            out.append(64 << 10)
            live.append(("loss", i))
            if i == 1:
                out.append("forward")
            if i >= 2:
                free(("act", i - 2))
        for i in (m - 2, m - 1):
            free(("act", i))
        out.append("backward")
        for i in reversed(range(m)):
            free(("loss", i))
        out.append("step")
    return out


def _synthetic_run(m: int) -> RankRun:
    requests = _requests(m)
    replayed = replay(requests)
    phases = {p: {"reserved": r} for p, r in replayed["reserved_at"].items()}
    memory = {
        "allocations": sum(1 for r in requests if type(r) is int and r >= 0),
        "reserved_peak": replayed["reserved_peak"],
        "segments": replayed["segments"],
        "phases": phases,
    }
    return RankRun(rank=0, coords=(0, 0, 0), step_ends=[0, 0], memory=memory, requests=requests)


def test_reserved_memory_replayed_at_the_full_count_steps_where_a_straight_line_does_not():
    # 40 microbatches hold 40 x 64 KiB of losses to the step's end: more than the 2 MiB small-block
    # segment that 4 and 5 fill, so the full step opens a second one (and the large pool's 20 MiB
    # segment, six 3 MiB blocks, is enough in every run)
    plan = steady_state.Plan(40, "1f1b", (4, 5))
    a, b, full = _synthetic_run(4), _synthetic_run(5), _synthetic_run(40)
    assert (a.memory["segments"], b.memory["segments"], full.memory["segments"]) == (3, 3, 4)
    fast = steady_state.extend(a, b, plan)
    assert fast.requests == full.requests
    assert fast.memory == full.memory
    # planted: the old rule (reserved equal in both runs counted as the full step's): a segment short
    old = steady_state.extend(dataclasses.replace(a, requests=None), dataclasses.replace(b, requests=None), plan)
    assert old.memory["segments"] == 3 and old.memory["reserved_peak"] == full.memory["reserved_peak"] - (2 << 20)


def _last_stage_requests(m: int, steps: int = 2) -> list:
    """A last stage's allocator requests at m microbatches (caching_allocator.replay's form): a slot
    per microbatch made where the step starts (264 bytes), each microbatch's activations (3 MiB,
    freed by its backward) and loss (64 KiB, held), at the step's end the losses stacked (4 m bytes)
    and as doubles (8 m), then the slots freed newest first (each behind the m losses and the two
    stacks: -(m + 3)), the stacks, the losses (-1 each)."""
    out, live = [100 << 20, "setup"], ["states"]

    def alloc(name, nbytes):
        out.append(nbytes)
        live.append(name)

    def free(name):
        out.append(live.index(name) - len(live))
        live.remove(name)

    for _ in range(steps):
        for i in range(m):
            alloc(("slot", i), 264)
        for i in range(m):
            alloc(("act", i), 3 << 20)
            alloc(("loss", i), 64 << 10)
            if i == 0:
                out.append("forward")
            free(("act", i))
        out.append("backward")
        alloc("stack", 4 * m)
        alloc("double", 8 * m)
        for i in reversed(range(m)):
            free(("slot", i))
        free("double")
        free("stack")
        for i in reversed(range(m)):
            free(("loss", i))
        out.append("step")
    return out


def test_a_last_stage_log_whose_numbers_move_extends_to_the_full_one_checked_by_a_third_run():
    logs = {m: _last_stage_requests(m) for m in (4, 5, 6, 40)}
    assert logs[4][2:6] == [264] * 4 and -7 in logs[4] and -8 in logs[5]  # the slots' frees move
    runs = {m: dataclasses.replace(_synthetic_run(m), requests=log) for m, log in logs.items()}
    for m, run in runs.items():  # (_synthetic_run's figures are of its own log: replay this one)
        replayed = replay(run.requests)
        run.memory.update(reserved_peak=replayed["reserved_peak"], segments=replayed["segments"])
        run.memory["phases"] = {p: {"reserved": r} for p, r in replayed["reserved_at"].items()}
        run.memory["allocations"] = sum(1 for r in run.requests if type(r) is int and r >= 0)
    plan = steady_state.Plan(40, "1f1b", (4, 5))
    # a number that moves is a line through two points: the third run must show it
    with pytest.raises(steady_state.ThirdRunNeeded, match="allocator's requests"):
        steady_state.extend(runs[4], runs[5], plan)
    fast = steady_state.extend(runs[4], runs[5], plan, 0, runs[6])
    assert fast.steady_state["reserved"] == steady_state.REPLAYED
    assert fast.requests == logs[40] and fast.memory == runs[40].memory
    # planted: difflib's inserts (no moved runs) do not align it
    with pytest.raises(steady_state.NotPeriodic, match="differ past inserted blocks"):
        repeats._difflib_inserts(logs[4], logs[5], "x", 4)


def test_where_the_log_does_not_extend_the_record_and_the_report_say_the_reserved_rule_and_why():
    a, b = _synthetic_run(4), _synthetic_run(5)
    b.requests = b.requests[1:]  # without a's first request: b is no log of a's with blocks inserted
    plan = steady_state.Plan(40, "1f1b", (4, 5))
    run = steady_state.extend(a, b, plan)
    why = run.steady_state["reserved"]
    assert run.requests is None and why.startswith("a + k (b - a), not replayed: step 1's allocator requests")
    assert run.memory["segments"] == 3  # the two runs' (the old rule)
    result = {"ok": True, "problems": [], "world_size": 1, "seconds": 0.0, "microbatches": None}
    result["ranks"] = [rank_record(run)]
    assert f"rank 0: reserved memory counted {why}" in table(result)
    assert "reserved memory counted" not in table({**result, "ranks": [rank_record(steady_state.extend(a, a, plan))]})
