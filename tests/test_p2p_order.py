"""Pipeline messages are matched by order alone (NCCL ignores tags), under every schedule.

Each stage runs its schedule in its own thread over an in-process transport with no tags: between
two ranks, messages are delivered strictly first-in first-out per direction, and a send completes
only when the peer has posted the matching receive (the worst case NCCL allows), so a schedule whose
stages wait on each other in a cycle is reported as a deadlock instead of passing on buffering. Every
message carries its kind (activation or gradient), microbatch and virtual stage; the fake forward
and backward check what they receive against what the pipeline must deliver there. No model, no
processes: the whole grid runs in about a second.
"""
from __future__ import annotations

import collections
import dataclasses
import threading

import pytest
import torch

from megazero.parallel.pipeline.p2p import PipelineP2P
from megazero.parallel.pipeline.schedules import PipelineJob, get_schedule

ACTIVATION, GRADIENT = 1.0, 2.0
HANG_GUARD_S = 60        # only catches a hang the deadlock check missed; never reached when passing


@dataclasses.dataclass(eq=False)
class _Op:
    peer: int
    message: torch.Tensor | None = None      # a send's copy of its tensor
    target: torch.Tensor | None = None       # a receive's buffer
    done: bool = False


class TaglessWire:
    """The transport shared by the stage threads: FIFO per (sender, receiver), no tags, rendezvous."""

    def __init__(self, size: int):
        self.cond = threading.Condition()
        self.barrier = threading.Barrier(size)
        self.unmatched_sends = collections.defaultdict(collections.deque)   # (src, dst) -> sends
        self.unmatched_recvs = collections.defaultdict(collections.deque)   # (src, dst) -> receives
        self.waiting: dict[int, list[_Op]] = {}                             # rank -> its open batch
        self.running = size
        self.failure: str | None = None

    def batch(self, rank: int, sends, recvs) -> None:
        with self.cond:
            ops = []
            for tensor, peer in sends:
                op = _Op(peer, message=tensor.clone())
                self._post(op, self.unmatched_recvs[(rank, peer)], self.unmatched_sends[(rank, peer)])
                ops.append(op)
            for tensor, peer in recvs:
                op = _Op(peer, target=tensor)
                self._post(op, self.unmatched_sends[(peer, rank)], self.unmatched_recvs[(peer, rank)])
                ops.append(op)
            self.cond.notify_all()
            self.waiting[rank] = ops
            while not all(op.done for op in ops):
                if self.failure is None and self._deadlocked():
                    self.failure = "deadlock: " + self._describe_waits()
                    self.cond.notify_all()
                if self.failure is not None:
                    raise AssertionError(self.failure)
                if not self.cond.wait(timeout=HANG_GUARD_S):
                    raise AssertionError("hang: " + self._describe_waits())
            del self.waiting[rank]

    @staticmethod
    def _post(op: _Op, partners: collections.deque, pending: collections.deque) -> None:
        """Matches `op` with the oldest unmatched op of the other side, or queues it."""
        if not partners:
            pending.append(op)
            return
        other = partners.popleft()
        send, recv = (op, other) if op.message is not None else (other, op)
        assert send.message.shape == recv.target.shape, "message and receive buffer differ in shape"
        recv.target.copy_(send.message)
        send.done = recv.done = True

    def _deadlocked(self) -> bool:
        return len(self.waiting) == self.running and not any(
            all(op.done for op in ops) for ops in self.waiting.values())

    def _describe_waits(self) -> str:
        return "; ".join(
            f"stage {rank} waits to " + ", ".join(
                f"{'send to' if op.message is not None else 'receive from'} {op.peer}"
                for op in ops if not op.done)
            for rank, ops in sorted(self.waiting.items()))

    def finish(self, error: str | None = None) -> None:
        with self.cond:
            self.running -= 1
            if error is not None and self.failure is None:
                self.failure = error
            self.cond.notify_all()

    def leftovers(self) -> list[str]:
        return [f"{len(q)} unmatched {kind} {src}->{dst}"
                for kind, queues in (("sends", self.unmatched_sends), ("receives", self.unmatched_recvs))
                for (src, dst), q in queues.items() if q]


class TaglessP2P(PipelineP2P):
    """The real PipelineP2P (its op order is what is under test) over the in-process wire."""

    def __init__(self, wire: TaglessWire, stage: int, num_stages: int):
        self.wire = wire
        group = type("StageGroup", (), {"rank": stage, "size": num_stages})()
        super().__init__(group, (3,), torch.float64, "cpu")

    def _warm_up(self) -> None:
        self.wire.barrier.wait(timeout=HANG_GUARD_S)

    def _send_recv(self, sends, recvs) -> None:
        self.wire.batch(self.group.rank, sends, recvs)


def label(kind: float, microbatch: int, virtual_stage: int) -> torch.Tensor:
    return torch.tensor([kind, microbatch, virtual_stage], dtype=torch.float64)


def read(message: torch.Tensor | None):
    return None if message is None else tuple(int(x) if i else x for i, x in enumerate(message.tolist()))


class FakeStage:
    """forward/backward for one stage: no model, labelled messages, checks on what arrives.

    Chunk c of stage p is virtual stage s = c * pp + p; forward s must receive the activation of
    (microbatch, s - 1), backward s the gradient of (microbatch, s + 1)."""

    def __init__(self, stage: int, pp: int, v: int, m: int, forward_only: bool):
        self.stage, self.pp, self.v, self.m = stage, pp, v, m
        self.last_virtual = pp * v - 1
        self.backwards_left = 0 if forward_only else m * v
        self.saved = {}                   # id(output) -> (virtual stage, microbatch, input)
        self.forwarded = collections.defaultdict(list)
        self.backwarded = collections.defaultdict(list)

    def forward(self, chunk: int, x, mb: int):
        s = chunk * self.pp + self.stage
        expected = None if s == 0 else (ACTIVATION, mb, s - 1)
        assert read(x) == expected, f"forward of microbatch {mb} at virtual stage {s} got {read(x)}"
        self.forwarded[s].append(mb)
        out = torch.tensor(float(mb)) if s == self.last_virtual else label(ACTIVATION, mb, s)
        self.saved[id(out)] = (s, mb, x)
        return out

    def backward(self, output, output_grad, last: bool) -> None:
        s, mb, x = self.saved.pop(id(output))
        expected = None if s == self.last_virtual else (GRADIENT, mb, s + 1)
        assert read(output_grad) == expected, \
            f"backward of microbatch {mb} at virtual stage {s} got {read(output_grad)}"
        self.backwards_left -= 1
        assert last == (self.backwards_left == 0), "only the step's final backward is marked last"
        self.backwarded[s].append(mb)
        if x is not None:
            x.grad = label(GRADIENT, mb, s)


def run_pipeline(schedule: str, pp: int, v: int, m: int, forward_only: bool) -> list[FakeStage]:
    wire = TaglessWire(pp)
    stages = [FakeStage(p, pp, v, m, forward_only) for p in range(pp)]
    errors = []                                    # in the order they happened: the first is the cause

    def run_stage(p: int) -> None:
        error = None
        try:
            job = PipelineJob(num_microbatches=m, num_chunks=v, stage=p, num_stages=pp,
                              forward=stages[p].forward, backward=stages[p].backward,
                              p2p=TaglessP2P(wire, p, pp))
            get_schedule(schedule, pp, v)(job, forward_only=forward_only)
        except BaseException as e:                 # reported below, with the stage that raised it
            error = f"stage {p}: {type(e).__name__}: {e}"
            errors.append(error)
        wire.finish(error)

    threads = [threading.Thread(target=run_stage, args=(p,), daemon=True) for p in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * HANG_GUARD_S)
    what = f"{schedule} pp {pp} v {v} m {m}{' forward only' if forward_only else ''}"
    assert not any(t.is_alive() for t in threads), f"{what}: a stage never finished"
    assert not errors, f"{what}: {errors[0]}"
    assert not wire.leftovers(), f"{what}: " + ", ".join(wire.leftovers())
    return stages


def cases():
    for pp in (2, 3, 4):
        for m in sorted({1, 2, pp, pp + 1, 2 * pp + 1}):
            yield "gpipe", pp, 1, m
            yield "1f1b", pp, 1, m
        for v in (1, 2, 3):
            for m in (pp, 2 * pp, 3 * pp):
                yield "interleaved", pp, v, m


@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward_only"])
def test_every_schedule_matches_messages_in_order_without_tags(forward_only):
    for schedule, pp, v, m in cases():
        stages = run_pipeline(schedule, pp, v, m, forward_only)
        for fake in stages:
            for c in range(v):
                s = c * pp + fake.stage
                assert fake.forwarded[s] == list(range(m)), f"{schedule} pp {pp}: forwards at {s}"
                expected = [] if forward_only else list(range(m))
                assert fake.backwarded[s] == expected, f"{schedule} pp {pp}: backwards at {s}"


def test_wire_reports_crossed_messages_and_deadlocks():
    """The transport itself: without tags, two sends that the receiver takes in the other order
    arrive crossed; two stages that each send first, in separate batches, wait on each other."""
    wire = TaglessWire(2)
    a, b = torch.empty(3, dtype=torch.float64), torch.empty(3, dtype=torch.float64)

    def sender():
        wire.batch(0, [(label(ACTIVATION, 0, 0), 1), (label(GRADIENT, 0, 0), 1)], [])
        wire.finish()

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    wire.batch(1, [], [(b, 0), (a, 0)])         # grad buffer first: takes the activation
    wire.finish()
    t.join()
    got = read(b)[0], read(a)[0]
    assert got == (ACTIVATION, GRADIENT), "FIFO per direction, whatever the receiver meant"

    wire = TaglessWire(2)
    failures = []

    def send_then_receive(rank):
        try:
            wire.batch(rank, [(label(ACTIVATION, 0, rank), 1 - rank)], [])
            wire.batch(rank, [], [(torch.empty(3, dtype=torch.float64), 1 - rank)])
        except AssertionError as e:
            failures.append(str(e))
        wire.finish()

    threads = [threading.Thread(target=send_then_receive, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * HANG_GUARD_S)
    assert len(failures) == 2 and all("deadlock" in f for f in failures), failures
