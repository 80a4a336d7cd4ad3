"""The timeline: every rank's traced step (megazero.dry_run.trace) placed on a device's streams
(megazero.dry_run.devices), and what it says: step time, MFU, compute / exposed communication /
bubble / host time, the most exposed ops. Pure: records and a Device in, numbers out.

The model, GPU (CUDA's): the host issues the rank's ops in trace order, paying `launch_us` each; a
kernel starts when it is issued and its stream is free; an event recorded on a stream completes
when the work queued there so far does; a stream's wait delays its later work to the event; a host
sync (an event synchronized, a host read) holds the host until the event (the stream) is done. A
collective runs on the stream the code put it on, after the work queued on the issuing stream, and
starts when every simulated member of its group has reached it (its k-th op on that group: NCCL
matches by position); all members end together. A p2p message starts when both its send and its
matching receive (the k-th between the pair) are posted; a batch holds its stream until its last
message is through. The CPU: one host thread runs every op (ranks sharing a host's cores, see
devices.py); gloo's collectives run beside it, and a wait blocks the host.

Per rank, over the job's step time T (the last rank's end: the critical path across ranks):
compute is the union of compute kernels' intervals; exposed communication the time communication
runs with no compute; host the time the host works with the device idle; bubble the rest (waiting
for a peer: a pipeline stage for its p2p, a collective for its slowest member). The four sum to T.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict

COMPUTE, COMM, HOST = "compute", "communication", "host"


class TimelineStuck(RuntimeError):
    """Ranks wait on each other with no rank able to go on (a hang the trace shows)."""


@dataclasses.dataclass
class RankTimeline:
    rank: int
    end: float = 0.0
    intervals: list = dataclasses.field(default_factory=list)  # (start, end, kind, label, site)
    flops: float = 0.0  # the trace's kernels' FLOPs


class _Lane:
    """One rank's simulation state: its host clock, each stream's next free time, its events."""

    def __init__(self, rank: int, records: list, threads, device):
        self.rank, self.records, self.threads, self.device = rank, records, set(threads), device
        self.cpu = device.kind == "cpu"
        self.at, self.host = 0, 0.0
        self.free: dict[int, float] = defaultdict(float)
        self.events: dict[int, float] = {}
        self.out = RankTimeline(rank)
        self.seq: dict[tuple, int] = defaultdict(int)  # (group, ranks) or (src, dst) -> ops so far

    def add(self, start, end, kind, label, site="") -> None:
        if end > start:
            self.out.intervals.append((start, end, kind, label, site))

    def issue(self) -> float:
        """The host issues one op (its launch cost); returns when it is issued."""
        # the CPU: the host's per-op cost is its thread's work too, shared like a kernel's when the
        # host's ranks outnumber its cores (1 on a GPU)
        launch = self.device.launch_us * 1e-6 * self.device.cpu_share()
        self.add(self.host, self.host + launch, HOST, "launch")
        self.host += launch
        return self.host

    def run(self, stream: int, seconds: float, kind: str, label: str, site: str = "") -> None:
        """A kernel (or copy, or a thread's host op) on `stream`."""
        issued = self.issue()
        if self.cpu and stream not in self.threads:
            start = max(issued, self.free[stream])
            self.host = self.free[stream] = start + seconds
        else:
            start = max(issued, self.free[stream])
            self.free[stream] = start + seconds
        self.add(start, start + seconds, kind, label, site)


def _comm_ready(lane: _Lane, stream: int, issuing: int) -> float:
    issued = lane.issue()
    return max(issued, lane.free[stream], lane.free[issuing])


class Simulation:
    """Every rank's records advanced together (see the module docstring); `run()` -> RankTimelines."""

    def __init__(self, traces: dict[int, dict], device):
        self.device = device
        self.lanes = {r: _Lane(r, t["records"], t.get("threads", ()), device) for r, t in sorted(traces.items())}
        self.posted: dict[tuple, dict[int, float]] = defaultdict(dict)  # collective key -> rank -> ready
        self.pending: dict[int, tuple] = {}  # rank -> (key, ready) of its blocked op
        self.p2p: dict[tuple, float] = {}  # (src, dst, k, side) -> ready
        self.seconds: dict[tuple, float] = {}  # a kernel's numbers -> its duration

    def run(self) -> dict[int, RankTimeline]:
        live = set(self.lanes)
        while live:
            moved = False
            for rank in sorted(live):
                lane = self.lanes[rank]
                start = lane.at
                while lane.at < len(lane.records) and self._step(lane, lane.records[lane.at]):
                    lane.at += 1
                moved |= lane.at > start
                if lane.at == len(lane.records):
                    live.discard(rank)
                    lane.out.end = max([lane.host, *lane.free.values()])
            if live and not moved:
                raise TimelineStuck(
                    "; ".join(
                        f"rank {r} waits at {_describe(self.lanes[r].records[self.lanes[r].at])}" for r in sorted(live)
                    )
                )
        return {r: lane.out for r, lane in self.lanes.items()}

    def _step(self, lane: _Lane, rec) -> bool:
        """Applies one record; False: it waits for a peer (the record is tried again later)."""
        kind, dev = rec[0], self.device
        if kind == "k":
            _, stream, op, flops, nbytes, dtype, dims, site = rec
            lane.out.flops += flops
            key = (flops, nbytes, dtype, dims)
            seconds = self.seconds.get(key)
            if seconds is None:  # a step repeats its kernels' shapes: each costed once
                seconds = self.seconds[key] = (
                    dev.matmul_seconds(flops, nbytes, dtype, dims) if flops else dev.memory_seconds(nbytes)
                )
            lane.run(stream, seconds, COMPUTE, op, site)
        elif kind == "h":
            seconds = dev.memory_seconds(rec[3]) if lane.cpu else dev.host_seconds(rec[3])
            if lane.cpu or rec[1] in lane.threads:
                lane.run(rec[1], seconds, COMPUTE if rec[1] in lane.threads else HOST, rec[2])
            else:
                lane.add(lane.host, lane.host + seconds, HOST, rec[2])
                lane.host += seconds
        elif kind == "x":
            lane.run(rec[1], dev.copy_seconds(rec[2]), COMM, "host<->device copy", rec[3])
        elif kind == "c":
            return self._collective(lane, rec)
        elif kind == "p":
            return self._p2p(lane, rec)
        elif kind == "r":
            stream = rec[1]
            lane.events[rec[2]] = (
                max(lane.host, lane.free[stream]) if lane.cpu and stream not in lane.threads else lane.free[stream]
            )
        elif kind == "w":
            done = lane.events.get(rec[2], 0.0)
            if lane.cpu:
                lane.host = max(lane.host, done)  # gloo's wait blocks the host thread
            lane.free[rec[1]] = max(lane.free[rec[1]], done)
        elif kind == "e":
            lane.host = max(lane.host, lane.events.get(rec[1], 0.0))
        elif kind == "s":
            lane.host = max(lane.host, lane.free[rec[1]])
        return True

    def _collective(self, lane: _Lane, rec) -> bool:
        _, stream, issuing, entry = rec
        if lane.rank not in self.pending:
            group = (entry.group, entry.ranks)
            key = (*group, lane.seq[group])
            lane.seq[group] += 1
            ready = _comm_ready(lane, stream, issuing)
            self.posted[key][lane.rank] = ready
            self.pending[lane.rank] = (key, ready)
        key, _ = self.pending[lane.rank]
        members = [r for r in entry.ranks if r in self.lanes]
        if len(self.posted[key]) < len(members):
            return False
        start = max(self.posted[key].values())
        nbytes = entry.numel * _itemsize(entry.dtype)
        end = start + self.device.collective_seconds(entry.op, nbytes, entry.ranks)
        del self.pending[lane.rank]
        lane.free[stream] = end
        if lane.cpu and stream == issuing:
            lane.host = end  # a synchronous gloo op: the host is in the call
        else:
            _poll(lane, end - start)
        lane.add(start, end, COMM, f"{entry.op} {entry.group}[{len(entry.ranks)}]", entry.site)
        return True

    def _p2p(self, lane: _Lane, rec) -> bool:
        _, stream, issuing, batch, site = rec
        if lane.rank not in self.pending:
            ready = _comm_ready(lane, stream, issuing)
            keys = []
            for kind, peer, nbytes in batch:
                src, dst = (lane.rank, peer) if kind == "send" else (peer, lane.rank)
                k = lane.seq[(src, dst, kind)]
                lane.seq[(src, dst, kind)] += 1
                self.p2p[(src, dst, k, kind)] = ready
                keys.append((src, dst, k, kind, peer, nbytes))
            self.pending[lane.rank] = (keys, ready)
        keys, ready = self.pending[lane.rank]
        others = [self.p2p.get((src, dst, k, "recv" if kind == "send" else "send")) for src, dst, k, kind, *_ in keys]
        if any(other is None and key[4] in self.lanes for other, key in zip(others, keys)):
            return False  # retried once every peer has posted: nothing of the batch is placed before that
        starts, ends = [], []
        for (src, dst, k, kind, peer, nbytes), other in zip(keys, others):
            start = max(ready, other if other is not None else ready)
            seconds = self.device.collective_seconds(kind, nbytes, (src, dst))
            lane.add(start, start + seconds, COMM, f"{kind} {'to' if kind == 'send' else 'from'} {peer}", site)
            starts.append(start)
            ends.append(start + seconds)
        del self.pending[lane.rank]
        lane.free[stream] = max([ready, *ends])
        if lane.cpu and stream == issuing:
            lane.host = lane.free[stream]
        elif ends:
            _poll(lane, max(ends) - min(starts))
        return True


def _poll(lane: _Lane, seconds: float) -> None:
    """An async gloo op beside the host thread: gloo's threads poll for the op's whole duration (in
    a real step the ranks' processes spend ~1 ms of CPU beyond their main thread per collective or
    p2p exchange, about the op's time), so with no idle core (the host's ranks at least its cores)
    that time is taken from the rank's host thread. A GPU's, or a CPU with a core to spare: free."""
    dev = lane.device
    if lane.cpu and dev.ranks_on_host >= dev.cores:
        lane.host += seconds


def _describe(rec) -> str:
    if rec[0] == "c":
        e = rec[3]
        return f"{e.op} on {e.group} {list(e.ranks)} at {e.site}"
    if rec[0] == "p":
        return f"p2p {[(k, p) for k, p, _ in rec[3]]} at {rec[4]}"
    return str(rec[:3])


def _itemsize(dtype: str) -> int:
    import torch

    return getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 0


# --- what a rank's intervals say ------------------------------------------------------------------
def _union(spans) -> list:
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(spans) -> float:
    return sum(e - s for s, e in spans)


def _minus(a, b, ends=None) -> list:
    """The parts of the (sorted, disjoint) spans `a` outside the (sorted, disjoint) spans `b`
    (`ends`: b's ends, to start at the first span of b that ends after a's first start)."""
    out = []
    j = bisect.bisect_right(ends, a[0][0]) if ends is not None and a else 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append([cur, b[k][0]])
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append([cur, e])
    return out


def breakdown(line: RankTimeline, step: float, top: int = 5) -> dict:
    """A rank's compute / exposed communication / host / bubble over the job's `step` seconds, and
    its `top` most exposed ops (communication not hidden by compute), summed by op and call site."""
    by = defaultdict(list)
    for s, e, kind, _, _ in line.intervals:
        by[kind].append((s, e))
    compute = _union(by[COMPUTE])
    ends = [e for _, e in compute]
    exposed = _minus(_union(by[COMM]), compute)
    host = _minus(_minus(_union(by[HOST]), compute), _union(by[COMM]))
    busy = _length(compute) + _length(exposed) + _length(host)
    worst: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for s, e, kind, label, site in line.intervals:
        if kind == COMM:
            hidden = _length(_minus([[s, e]], compute, ends))
            row = worst[(label, site)]
            row[0] += hidden
            row[1] += 1
    ranked = sorted(worst.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "compute_s": _length(compute),
        "exposed_comm_s": _length(exposed),
        "host_s": _length(host),
        "bubble_s": max(0.0, step - busy),
        "top_exposed": [
            {"op": label, "site": site, "exposed_s": sec, "calls": n} for (label, site), (sec, n) in ranked if sec > 0
        ],
    }


def schedule(
    traces: dict[int, dict], device, model_flops_per_rank: float | None = None, peak_flops: float | None = None
) -> dict:
    """The per-rank result of one step: `traces` rank -> {"records" (the step's, joined),
    "threads"}; `model_flops_per_rank`: megazero's FLOPs of the step (megazero.training.flops) over
    the job's ranks, for MFU against `peak_flops` (FLOP/s)."""
    lines = Simulation(traces, device).run()
    step = max((line.end for line in lines.values()), default=0.0)
    ranks = []
    for rank, line in sorted(lines.items()):
        parts = breakdown(line, step)
        mfu = model_flops_per_rank / (step * peak_flops) if model_flops_per_rank and peak_flops and step > 0 else None
        ranks.append(
            {
                "rank": rank,
                "step_s": line.end,
                "mfu": mfu,
                **{k: parts[k] for k in ("compute_s", "exposed_comm_s", "bubble_s", "host_s", "top_exposed")},
                "trace_tflop": line.flops / 1e12,
            }
        )
    return {"device": device.key, "device_name": device.name, "step_s": step, "ranks": ranks}
