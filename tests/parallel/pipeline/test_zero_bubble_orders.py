"""The zero-bubble schedules' lists of actions (parallel/pipeline/zero_bubble.py, actions.py),
against what we do not own: torch.distributed.pipelining's own schedules of the same name, and the
zero-bubble paper's closed forms of the idle time.

torch's orders come from its schedule classes' per-rank generator (`_calculate_single_rank_operations`,
plus the bubbles ScheduleInterleavedZeroBubble inserts, dropped here: they are idle slots, not actions),
called without a process group. Its action names map onto ours: F -> F, I (input) -> B, W -> W,
B (full backward) -> BW, OVERLAP_F_B(F; B) -> F& BW; its stage index -> our (rank, chunk) by the
layout (looped, or the V). ZB-H1 is torch's ScheduleInterleavedZeroBubble with one stage per rank
(the paper's ZB-1P). No intended difference: every list is torch's, action for action.
Planted, failing here: zb-h1's (and interleaved-zb's) rank r keeping r + 1 Ws waiting instead of r
(10 of 23 fail: the orders, the closed form, the memory bound).
"""

import re

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from megazero.parallel.pipeline.actions import Action, ListSchedule, check, holdings, simulate
from megazero.parallel.pipeline.zero_bubble import one_f_one_b, zero_bubble_schedule

TORCH = {
    "zb-h1": torch_schedules.ScheduleInterleavedZeroBubble,
    "zbv": torch_schedules.ScheduleZBVZeroBubble,
    "interleaved-zb": torch_schedules.ScheduleInterleavedZeroBubble,
    "dualpipev": torch_schedules.ScheduleDualPipeV,
}
SHAPES = [(2, 4), (2, 8), (4, 8), (4, 16)]  # (stages, microbatches)
KIND = {"F": "F", "I": "B", "W": "W", "B": "BW"}
CHUNKS = {"zb-h1": 1, "zbv": 2, "interleaved-zb": 2, "dualpipev": 2}


def torch_order(name: str, pp: int, microbatches: int) -> dict[int, list]:
    """torch's per-rank action list for its schedule `name`, built without stages or a group."""
    cls, chunks = TORCH[name], CHUNKS[name]
    sched = cls.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, chunks, microbatches
    sched.num_stages = sched._num_stages = pp * chunks
    sched.number_of_rounds = max(1, microbatches // pp)
    sched.microbatches_per_round = microbatches // sched.number_of_rounds
    sched.stage_index_to_group_rank = torch_schedules.generate_stage_to_rank_mapping(
        pp, pp * chunks, style="v" if name in ("zbv", "dualpipev") else "loop"
    )
    sched.pipeline_order = {r: sched._calculate_single_rank_operations(r) for r in range(pp)}
    if cls is torch_schedules.ScheduleInterleavedZeroBubble:
        sched.pipeline_order = sched._add_bubbles_to_actions(pp * chunks)
    return {r: [a for a in actions if a is not None] for r, actions in sched.pipeline_order.items()}


def ours_from_torch(schedule: ListSchedule, actions) -> list[Action]:
    out = []
    for a in actions:
        if a.sub_actions is not None:  # OVERLAP_F_B: a forward together with a backward
            (f, b) = a.sub_actions
            out += [to_action(schedule, f, overlapped=True), to_action(schedule, b)]
        else:
            out.append(to_action(schedule, a))
    return out


def to_action(schedule: ListSchedule, a, overlapped: bool = False) -> Action:
    _, chunk = schedule.layout.place(a.stage_index)
    return Action(KIND[a.computation_type.value], chunk, a.microbatch_index, overlapped)


@pytest.mark.parametrize("name", list(TORCH))
@pytest.mark.parametrize("pp,microbatches", SHAPES)
def test_order_is_torchs(name, pp, microbatches):
    ours = zero_bubble_schedule(name, pp, CHUNKS[name], microbatches)
    theirs = torch_order(name, pp, microbatches)
    for rank in range(pp):
        want = ours_from_torch(ours, theirs[rank])
        assert list(ours.ranks[rank]) == want, (
            f"{name} pp {pp} m {microbatches} rank {rank}:\n ours  {' '.join(map(str, ours.ranks[rank]))}\n"
            f" torch {' '.join(map(str, want))}"
        )
    check(ours)


@pytest.mark.parametrize("pp,microbatches", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_idle_fractions_are_the_papers(pp, microbatches):
    """T_F = T_B = T_W: 1F1B idles (p-1)/(m+p-1) of the step, ZB-H1 (p-1)/(3m+p-1); ZB-V at m >= 2p
    less than a third of 1F1B (the issue's bar)."""
    baseline = simulate(one_f_one_b(pp, microbatches)).idle_fraction()
    assert baseline == pytest.approx((pp - 1) / (microbatches + pp - 1))
    h1 = simulate(zero_bubble_schedule("zb-h1", pp, 1, microbatches)).idle_fraction()
    assert h1 == pytest.approx((pp - 1) / (3 * microbatches + pp - 1))
    if microbatches >= 2 * pp:
        assert simulate(zero_bubble_schedule("zbv", pp, 2, microbatches)).idle_fraction() < baseline / 3


def test_zb_h1_holds_what_1f1b_holds():
    """ZB-H1's activations plus deferred W inputs (each counted as a whole microbatch)
    peak at p microbatches, on every stage: 1F1B's peak (its first stage's); stage r keeps r Ws
    waiting, plus the one its last B just made."""
    pp, microbatches = 4, 8
    ours = holdings(zero_bubble_schedule("zb-h1", pp, 1, microbatches))
    base = holdings(one_f_one_b(pp, microbatches))
    assert max(h for rank in base for h, _ in rank) == pp
    for rank in range(pp):
        assert max(h + d for h, d in ours[rank]) == pp, rank
        assert max(d for _, d in ours[rank]) == rank + 1, rank


def test_a_list_that_cannot_run_is_refused():
    good = zero_bubble_schedule("zb-h1", 2, 1, 2)
    swapped = list(good.ranks[1])
    b = next(k for k, a in enumerate(swapped) if a.kind == "B")
    w = next(k for k, a in enumerate(swapped) if a.kind == "W" and a.microbatch == swapped[b].microbatch)
    swapped[b], swapped[w] = swapped[w], swapped[b]
    bad = ListSchedule("bad", good.layout, 2, (good.ranks[0], tuple(swapped)))
    with pytest.raises(ValueError, match="cannot run: waiting forever at rank 0: B0.0; rank 1: W0.0"):
        check(bad)
    missing = ListSchedule("short", good.layout, 2, (good.ranks[0], good.ranks[1][:-1]))
    with pytest.raises(ValueError, match="rank 1 lacks W of chunk 0, microbatch 1"):
        check(missing)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--pipeline-model-parallel-size", "1", "--pipeline-schedule", "zb-h1"],
            "needs --pipeline-model-parallel-size > 1",
        ),
        (["--pipeline-schedule", "zbv"], "runs two model chunks per stage in a V"),
        (["--pipeline-schedule", "zb-h1", "--num-layers-per-virtual-pipeline-stage", "2"], "use interleaved-zb"),
        (
            [
                "--pipeline-schedule",
                "dualpipev",
                "--num-layers-per-virtual-pipeline-stage",
                "2",
                "--global-batch-size",
                "2",
            ],
            "at least 2 x pipeline size = 4 microbatches per step, got 2",
        ),
        (["--pipeline-schedule", "zb-h1", "--overlap-p2p-communication"], "--overlap-p2p-communication works with"),
        (["--pipeline-schedule", "zb-h1", "--compile"], "drop --compile"),
    ],
)
def test_bad_zero_bubble_flags_are_one_line(flags, message):
    from megazero.config.flags import parse_args
    from megazero.config.train_flags import config_from_args
    from megazero.core.errors import UsageError

    base = [
        "--num-layers",
        "8",
        "--pipeline-model-parallel-size",
        "2",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
    ]
    world = 1 if "1" == flags[1] else 2
    with pytest.raises(UsageError, match=re.escape(message)):
        config_from_args(parse_args(base + flags), world_size=world)
    good = base + ["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "2"]
    assert config_from_args(parse_args(good), world_size=2).parallel.schedule == "zbv"
