"""Pipeline messages are matched by order alone (NCCL ignores tags), under every schedule.

Each stage runs its schedule in its own thread over an in-process transport with no tags: between
two ranks, messages are delivered strictly first-in first-out per direction, a send completes only
when the peer has posted the matching receive (the worst case NCCL allows), and a stage's batches
run one after another even when issued without waiting (overlapped schedules), as on one NCCL
communicator; so a schedule whose stages wait on each other in a cycle is reported as a deadlock
instead of passing on buffering. Every schedule runs with and without p2p overlap, and overlap must
actually let some compute run while a transfer is in flight. Every
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
HANG_GUARD_S = 60  # only catches a hang the deadlock check missed; never reached when passing


@dataclasses.dataclass(eq=False)
class _Op:
    peer: int
    message: torch.Tensor | None = None  # a send's copy of its tensor
    target: torch.Tensor | None = None  # a receive's buffer
    done: bool = False


@dataclasses.dataclass(eq=False)
class _Batch:
    rank: int
    ops: list
    active: bool = False  # its ops are offered for matching
    waited: bool = False

    @property
    def done(self) -> bool:
        return self.active and all(op.done for op in self.ops)


class TaglessWire:
    """The transport shared by the stage threads: FIFO per (sender, receiver), no tags, rendezvous.

    A stage's batches run one after another, as on one NCCL communicator's stream: a batch's ops
    are offered for matching only once the stage's previous batch has completed, however early it
    was issued (`post`), so an overlapped schedule that queues a send behind a receive which waits,
    through other stages, for that very send is reported as a deadlock."""

    def __init__(self, size: int):
        self.cond = threading.Condition()
        self.barrier = threading.Barrier(size)
        self.unmatched_sends = collections.defaultdict(collections.deque)  # (src, dst) -> sends
        self.unmatched_recvs = collections.defaultdict(collections.deque)  # (src, dst) -> receives
        self.queued = collections.defaultdict(collections.deque)  # rank -> batches in order
        self.unwaited = collections.defaultdict(set)  # rank -> batches not waited
        self.waiting: dict[int, _Batch] = {}  # rank -> batch it waits on
        self.running = size
        self.failure: str | None = None

    def batch(self, rank: int, sends, recvs) -> None:
        self.wait(self.post(rank, sends, recvs))

    def post(self, rank: int, sends, recvs) -> _Batch:
        with self.cond:
            ops = [_Op(peer, message=tensor.clone()) for tensor, peer in sends]
            ops += [_Op(peer, target=tensor) for tensor, peer in recvs]
            batch = _Batch(rank, ops)
            self.queued[rank].append(batch)
            self.unwaited[rank].add(id(batch))
            self._advance()
            self.cond.notify_all()
            return batch

    def wait(self, batch: _Batch) -> None:
        with self.cond:
            rank = batch.rank
            self.waiting[rank] = batch
            while not batch.done:
                if self.failure is None and self._deadlocked():
                    self.failure = "deadlock: " + self._describe_waits()
                    self.cond.notify_all()
                if self.failure is not None:
                    raise AssertionError(self.failure)
                if not self.cond.wait(timeout=HANG_GUARD_S):
                    raise AssertionError("hang: " + self._describe_waits())
            del self.waiting[rank]
            self.unwaited[rank].discard(id(batch))

    def _advance(self) -> None:
        """Activates each stage's oldest unfinished batch, until matching completes no more."""
        changed = True
        while changed:
            changed = False
            for rank, queue in self.queued.items():
                while queue and queue[0].done:
                    queue.popleft()
                if queue and not queue[0].active:
                    self._activate(queue[0])
                    changed = True

    def _activate(self, batch: _Batch) -> None:
        batch.active = True
        for op in batch.ops:
            if op.message is not None:
                self._post(op, self.unmatched_recvs[(batch.rank, op.peer)], self.unmatched_sends[(batch.rank, op.peer)])
            else:
                self._post(op, self.unmatched_sends[(op.peer, batch.rank)], self.unmatched_recvs[(op.peer, batch.rank)])

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
        return len(self.waiting) == self.running and not any(b.done for b in self.waiting.values())

    def _describe_waits(self) -> str:
        def blocked(rank, batch):
            head = self.queued[rank][0] if self.queued[rank] else batch
            ops = ", ".join(
                f"{'send to' if op.message is not None else 'receive from'} {op.peer}" for op in head.ops if not op.done
            )
            return f"stage {rank} waits to {ops}" + ("" if head is batch else " (queued ahead of its wait)")

        return "; ".join(blocked(rank, batch) for rank, batch in sorted(self.waiting.items()))

    def finish(self, rank: int, error: str | None = None) -> None:
        with self.cond:
            self.running -= 1
            if error is None and self.unwaited[rank]:
                error = f"stage {rank} returned with {len(self.unwaited[rank])} batches never waited"
            if error is not None and self.failure is None:
                self.failure = error
            self.cond.notify_all()

    def leftovers(self) -> list[str]:
        return [
            f"{len(q)} unmatched {kind} {src}->{dst}"
            for kind, queues in (("sends", self.unmatched_sends), ("receives", self.unmatched_recvs))
            for (src, dst), q in queues.items()
            if q
        ]


class _WireHandle:
    def __init__(self, wire: TaglessWire, batch: _Batch):
        self.wire, self.batch = wire, batch

    def wait(self) -> None:
        self.wire.wait(self.batch)


class TaglessP2P(PipelineP2P):
    """The real PipelineP2P (its op order is what is under test) over the in-process wire."""

    def __init__(self, wire: TaglessWire, stage: int, num_stages: int):
        self.wire = wire
        group = type("StageGroup", (), {"rank": stage, "size": num_stages})()
        super().__init__(group, (3,), torch.float64, "cpu")

    def _warm_up(self) -> None:
        self.wire.barrier.wait(timeout=HANG_GUARD_S)

    def _start(self, sends, recvs) -> _WireHandle:
        return _WireHandle(self.wire, self.wire.post(self.group.rank, sends, recvs))


def label(kind: float, microbatch: int, virtual_stage: int) -> torch.Tensor:
    return torch.tensor([kind, microbatch, virtual_stage], dtype=torch.float64)


def read(message: torch.Tensor | None):
    return None if message is None else tuple(int(x) if i else x for i, x in enumerate(message.tolist()))


class FakeStage:
    """forward/backward for one stage: no model, labelled messages, checks on what arrives.

    Chunk c of stage p is virtual stage s = c * pp + p; forward s must receive the activation of
    (microbatch, s - 1), backward s the gradient of (microbatch, s + 1)."""

    def __init__(self, stage: int, pp: int, v: int, m: int, forward_only: bool, wire: TaglessWire):
        self.stage, self.pp, self.v, self.m, self.wire = stage, pp, v, m, wire
        self.computed_in_flight = 0  # forwards/backwards run while a batch of ours was in flight
        self.last_virtual = pp * v - 1
        self.backwards_left = 0 if forward_only else m * v
        self.saved = {}  # id(output) -> (virtual stage, microbatch, input)
        self.forwarded = collections.defaultdict(list)
        self.backwarded = collections.defaultdict(list)

    def forward(self, chunk: int, x, mb: int):
        s = chunk * self.pp + self.stage
        expected = None if s == 0 else (ACTIVATION, mb, s - 1)
        assert read(x) == expected, f"forward of microbatch {mb} at virtual stage {s} got {read(x)}"
        self.forwarded[s].append(mb)
        self.computed_in_flight += bool(self.wire.unwaited[self.stage])
        out = torch.tensor(float(mb)) if s == self.last_virtual else label(ACTIVATION, mb, s)
        self.saved[id(out)] = (s, mb, x)
        return out

    def backward(self, output, output_grad, last: bool) -> None:
        s, mb, x = self.saved.pop(id(output))
        expected = None if s == self.last_virtual else (GRADIENT, mb, s + 1)
        assert read(output_grad) == expected, (
            f"backward of microbatch {mb} at virtual stage {s} got {read(output_grad)}"
        )
        self.backwards_left -= 1
        assert last == (self.backwards_left == 0), "only the step's final backward is marked last"
        self.computed_in_flight += bool(self.wire.unwaited[self.stage])
        self.backwarded[s].append(mb)
        if x is not None:
            x.grad = label(GRADIENT, mb, s)


def run_pipeline(schedule: str, pp: int, v: int, m: int, forward_only: bool, overlap: bool = False) -> list[FakeStage]:
    wire = TaglessWire(pp)
    stages = [FakeStage(p, pp, v, m, forward_only, wire) for p in range(pp)]
    errors = []  # in the order they happened: the first is the cause

    def run_stage(p: int) -> None:
        error = None
        try:
            job = PipelineJob(
                num_microbatches=m,
                num_chunks=v,
                stage=p,
                num_stages=pp,
                forward=stages[p].forward,
                backward=stages[p].backward,
                p2p=TaglessP2P(wire, p, pp),
                overlap_p2p=overlap,
            )
            get_schedule(schedule, pp, v)(job, forward_only=forward_only)
        except BaseException as e:  # reported below, with the stage that raised it
            error = f"stage {p}: {type(e).__name__}: {e}"
            errors.append(error)
        wire.finish(p, error)

    threads = [threading.Thread(target=run_stage, args=(p,), daemon=True) for p in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * HANG_GUARD_S)
    what = f"{schedule} pp {pp} v {v} m {m}{' forward only' if forward_only else ''}{' overlapped' if overlap else ''}"
    assert not any(t.is_alive() for t in threads), f"{what}: a stage never finished"
    assert not errors, f"{what}: {errors[0]}"
    assert not wire.leftovers(), f"{what}: " + ", ".join(wire.leftovers())
    return stages


def cases():
    for pp in (2, 3, 4):
        for m in sorted({1, 2, pp, pp + 1, 2 * pp + 1}):
            yield "gpipe", pp, 1, m, False
            yield "1f1b", pp, 1, m, False
            yield "1f1b", pp, 1, m, True
        for v in (1, 2, 3):
            for m in (pp, 2 * pp, 3 * pp):
                yield "interleaved", pp, v, m, False
                yield "interleaved", pp, v, m, True


@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward_only"])
def test_every_schedule_matches_messages_in_order_without_tags(forward_only):
    for schedule, pp, v, m, overlap in cases():
        stages = run_pipeline(schedule, pp, v, m, forward_only, overlap)
        overlapped = sum(fake.computed_in_flight for fake in stages)
        what = f"{schedule} pp {pp} v {v} m {m}"
        if not overlap:
            assert overlapped == 0, f"{what}: a stage computed with a transfer in flight, without overlap"
        elif not forward_only and m > 1:
            assert overlapped > 0, f"{what}: overlap asked for, yet no compute ran during a transfer"
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
        wire.finish(0)

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    wire.batch(1, [], [(b, 0), (a, 0)])  # grad buffer first: takes the activation
    wire.finish(1)
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
        wire.finish(rank)

    _both_deadlock(send_then_receive, failures)


def test_wire_runs_a_stages_batches_in_order():
    """Issued without waiting, a stage's batches still run one after another (one NCCL stream):
    two stages that each queue a receive ahead of the send the other one waits for deadlock, where
    a transport running batches independently (gloo) would have delivered both."""
    wire = TaglessWire(2)
    failures = []

    def receive_then_send(rank):
        try:
            got = wire.post(rank, [], [(torch.empty(3, dtype=torch.float64), 1 - rank)])
            sent = wire.post(rank, [(label(ACTIVATION, 0, rank), 1 - rank)], [])
            wire.wait(got)
            wire.wait(sent)
        except AssertionError as e:
            failures.append(str(e))
        wire.finish(rank)

    _both_deadlock(receive_then_send, failures)


def _both_deadlock(stage, failures: list[str]) -> None:
    """Runs `stage(rank)` for ranks 0 and 1 in threads; both must have reported a deadlock."""
    threads = [threading.Thread(target=stage, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * HANG_GUARD_S)
    assert len(failures) == 2 and all("deadlock" in f for f in failures), failures
