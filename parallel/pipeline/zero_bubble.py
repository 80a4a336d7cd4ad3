"""The zero-bubble schedules, each written as its list of actions per rank (actions.py).

A backward split in two (B: the input's gradient, which the previous stage waits for; W: the
weights', which nobody waits for; models/split_backward.py) lets a schedule move W into the time a
stage would otherwise idle. With p stages, m microbatches and equal times for F, B and W (the
zero-bubble paper's T_F = T_B = T_W), the idle share of a step is (p - 1) / (m + p - 1) for 1F1B
and, for these:

  zb-h1           ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 3.1): 1F1B's
                  order of forwards and input gradients; stage r keeps r Ws waiting (one is run
                  after each B once r wait), which fills the cool-down. Holds at most p microbatches'
                  activations (W's inputs included) on any stage: 1F1B's peak. Idle (p - 1) /
                  (3 m + p - 1).
  zbv             ZB-V (the same paper, section 6): two chunks per stage placed in a V (stage r runs
                  virtual stages r and 2p - 1 - r, so the first and the last are both on stage 0,
                  and the middle hand-off stays on stage p - 1); 1F1B's activation memory; about no
                  idle time from m >= 2p on.
  interleaved-zb  interleaved 1F1B over v looped chunks with its backwards split (the paper's ZB-1P
                  over chunks, as torch.distributed.pipelining's ScheduleInterleavedZeroBubble): a
                  warm-up of (v - 1) p + p - 1 - r forwards (one hop per stage, as a B is half a
                  backward), stage r keeping r Ws waiting.
  dualpipev       DualPipeV (DeepSeek-V3's DualPipe "cut in half", deepseek-ai/DualPipe): two chunks in
                  a V; in its middle phase every step runs one chunk's forward together with the
                  other chunk's whole backward (`Action.overlapped`: on GPUs their communication and
                  compute overlap; here they run one after the other), and it splits backwards only
                  at the start and the end, where Ws fill the gaps. Needs m >= 2p.

Each generator returns every rank's list, phase by phase as the comments name them; `check` in
actions.py proves each list runs (every action's inputs come) and the tests compare them with the
orders torch.distributed.pipelining generates for its schedules of the same name.
"""

from __future__ import annotations

import collections

from megazero.core.errors import UsageError
from .actions import Action, ListSchedule, PipelineLayout

ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zbv", "interleaved-zb", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")


class _Rank:
    """One rank's list being written: per-chunk counters of the next microbatch of each kind, and the
    queue of B's whose W waits (oldest first)."""

    def __init__(self):
        self.actions: list[Action] = []
        self.next = collections.Counter()
        self.waiting: collections.deque = collections.deque()

    def forward(self, chunk: int, overlapped: bool = False) -> None:
        self._add("F", chunk, overlapped)

    def input_grad(self, chunk: int) -> None:
        self.waiting.append((chunk, self.next["B", chunk]))
        self._add("B", chunk)

    def whole_backward(self, chunk: int) -> None:
        self._add("BW", chunk)

    def backward(self, chunk: int, split: bool) -> None:
        self.input_grad(chunk) if split else self.whole_backward(chunk)

    def weight_grad(self, chunk: int | None = None) -> None:
        """W of the oldest waiting B (of `chunk`'s oldest, if given); nothing if none waits."""
        for k, (c, mb) in enumerate(self.waiting):
            if chunk is None or c == chunk:
                del self.waiting[k]
                self.actions.append(Action("W", c, mb))
                return

    def _add(self, kind: str, chunk: int, overlapped: bool = False) -> None:
        key = ("B" if kind == "BW" else kind, chunk)
        self.actions.append(Action(kind, chunk, self.next[key], overlapped))
        self.next[key] += 1


def zb_h1(pp: int, microbatches: int) -> list[list[Action]]:
    return interleaved_zb(pp, 1, microbatches)


def interleaved_zb(pp: int, chunks: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1 (one chunk) and its interleaved form: the k-th forward of a rank runs chunk
    (k // p) % v, the k-th backward chunk v - 1 - (k // p) % v; rank r keeps r Ws waiting."""
    total = chunks * microbatches
    out = []
    for r in range(pp):
        rank = _Rank()
        warmup = min((chunks - 1) * pp + pp - 1 - r, total)
        forwards = backwards = 0

        def forward_next():
            nonlocal forwards
            rank.forward((forwards // pp) % chunks)
            forwards += 1

        def backward_next():
            nonlocal backwards
            rank.input_grad(chunks - 1 - (backwards // pp) % chunks)
            backwards += 1
            if len(rank.waiting) > r:  # r Ws wait; the oldest one runs now
                rank.weight_grad()

        for _ in range(warmup):  # warm-up: forwards only
            forward_next()
        while forwards < total:  # steady: one forward, one input gradient
            forward_next()
            backward_next()
        while backwards < total:  # cool-down: the input gradients left
            backward_next()
        while rank.waiting:  # the Ws still waiting
            rank.weight_grad()
        out.append(rank.actions)
    return out


def zbv(pp: int, microbatches: int) -> list[list[Action]]:
    """ZB-V. Written for n = max(m, 2p - 1) microbatches (the V's warm-up needs that many), then the
    actions of microbatches m .. n - 1 dropped: what is left still runs, in the same order."""
    n = max(microbatches, 2 * pp - 1)
    out = []
    for r in range(pp):
        rank = _Rank()
        for _ in range(2 * (pp - r) - 1):  # warm-up: chunk 0 forwards down the V
            rank.forward(0)
        for _ in range(r):  # chunk 1's first forwards come back up
            rank.forward(1)
            rank.forward(0)
        for _ in range(pp - r):  # chunk 1's first backwards, each W at once
            rank.forward(1)
            rank.input_grad(1)
            rank.weight_grad(1)
        while rank.next["F", 1] < rank.next["F", 0] or rank.next["F", 0] < n:  # steady
            if rank.next["F", 0] < n:
                rank.forward(0)
            rank.input_grad(0)
            rank.weight_grad(0)
            rank.forward(1)
            rank.input_grad(1)
            rank.weight_grad(1)
        for _ in range(r):  # cool-down: input gradients first ...
            rank.input_grad(0)
            rank.input_grad(1)
        for _ in range(pp - r):  # ... chunk 0's with its Ws ...
            rank.input_grad(0)
            rank.weight_grad(0)
        while rank.waiting:  # ... then every W left, chunk 1's first
            rank.weight_grad(1) if any(c == 1 for c, _ in rank.waiting) else rank.weight_grad(0)
        out.append([a for a in rank.actions if a.microbatch < microbatches])
    return out


def dualpipev(pp: int, microbatches: int) -> list[list[Action]]:
    """DualPipeV in its eight phases (deepseek-ai/DualPipe's dualpipev.py); chunk 0 runs down the V,
    chunk 1 back up. Needs m >= 2p."""
    m = microbatches
    out = []
    for r in range(pp):
        rank = _Rank()
        for _ in range(2 * (pp - r - 1)):  # 1: chunk 0 forwards
            rank.forward(0)
        for _ in range(r + 1):  # 2: both chunks' forwards
            rank.forward(0)
            rank.forward(1)
        for _ in range(pp - r - 1):  # 3: chunk 1's input gradients, Ws in between
            rank.input_grad(1)
            rank.weight_grad()
            rank.forward(1)
        for i in range(m - 2 * pp + r + 1):  # 4: main: a forward with the other chunk's backward
            first_on_last = i == 0 and r == pp - 1  # the bubble is smaller run apart
            rank.forward(0, overlapped=not first_on_last)
            rank.whole_backward(1)
            rank.forward(1, overlapped=True)
            rank.whole_backward(0)
        for _ in range(pp - r - 1):  # 5: chunk 1's backwards, chunk 1's forwards left
            rank.whole_backward(1)
            rank.forward(1, overlapped=True)
            rank.whole_backward(0)
        split, half = False, (r + 1) // 2  # 6: the last backwards; split from half-way on
        for i in range(r + 1):
            split = split or (i == half and r % 2 == 1)
            rank.backward(1, split)
            split = split or (i == half and r % 2 == 0)
            rank.backward(0, split)
        for _ in range(pp - r - 1):  # 7: Ws fill in between chunk 0's last backwards
            rank.weight_grad()
            rank.backward(0, split)
        while rank.waiting:  # 8: the Ws left
            rank.weight_grad()
        out.append(rank.actions)
    return out


def zero_bubble_schedule(name: str, pp: int, chunks: int, microbatches: int) -> ListSchedule:
    """The ListSchedule of zero-bubble schedule `name` (one of ZERO_BUBBLE_SCHEDULES)."""
    check_shape(name, pp, chunks, microbatches)
    if name == "zb-h1":
        ranks = zb_h1(pp, microbatches)
    elif name == "interleaved-zb":
        ranks = interleaved_zb(pp, chunks, microbatches)
    elif name == "zbv":
        ranks = zbv(pp, microbatches)
    else:
        ranks = dualpipev(pp, microbatches)
    layout = PipelineLayout(pp, chunks, v_shape=name in V_SHAPED)
    return ListSchedule(name, layout, microbatches, tuple(tuple(r) for r in ranks))


def check_shape(name: str, pp: int, chunks: int, microbatches: int) -> None:
    """UsageError unless `name` can run pp stages x `chunks` chunks with these microbatches."""
    if name not in ZERO_BUBBLE_SCHEDULES:
        raise UsageError(f"--pipeline-schedule {name}: not a zero-bubble schedule ({', '.join(ZERO_BUBBLE_SCHEDULES)})")
    if pp < 2:
        raise UsageError(f"--pipeline-schedule {name} needs --pipeline-model-parallel-size > 1")
    if name in V_SHAPED and chunks != 2:
        raise UsageError(
            f"--pipeline-schedule {name} runs two model chunks per stage in a V; set "
            f"--num-layers-per-virtual-pipeline-stage to half a stage's layers "
            f"(--num-layers / (2 x pipeline size))"
        )
    if name == "zb-h1" and chunks != 1:
        raise UsageError(
            "--pipeline-schedule zb-h1 runs one model chunk per stage; drop "
            "--num-layers-per-virtual-pipeline-stage or use interleaved-zb"
        )
    if name == "interleaved-zb" and (chunks < 2 or microbatches % pp):
        raise UsageError(
            f"--pipeline-schedule interleaved-zb needs --num-layers-per-virtual-pipeline-stage "
            f"(two or more chunks per stage; {chunks} now) and a number of microbatches "
            f"({microbatches}) that is a multiple of the pipeline size {pp}"
        )
    if name == "dualpipev" and microbatches < 2 * pp:
        raise UsageError(
            f"--pipeline-schedule dualpipev needs at least 2 x pipeline size = {2 * pp} "
            f"microbatches per step, got {microbatches}; raise --global-batch-size or lower "
            f"--micro-batch-size"
        )


def one_f_one_b(pp: int, microbatches: int) -> ListSchedule:
    """1F1B as a list (whole backwards: BW), the baseline the bench and the tests set beside the
    zero-bubble schedules; schedules.py runs 1F1B itself."""
    ranks = []
    for r in range(pp):
        rank = _Rank()
        warmup = min(pp - 1 - r, microbatches)
        for _ in range(warmup):
            rank.forward(0)
        for _ in range(microbatches - warmup):
            rank.forward(0)
            rank.whole_backward(0)
        for _ in range(warmup):
            rank.whole_backward(0)
        ranks.append(tuple(rank.actions))
    return ListSchedule("1f1b", PipelineLayout(pp, 1), microbatches, tuple(ranks))
