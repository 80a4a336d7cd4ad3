"""The dry run's op trace: per rank, in issue order, what the timeline (megazero.dry_run.timeline)
places on a device's streams.

`TracingChecker` is the stream checker (megazero.core.stream_check) that also writes down, as it
models the streams: every aten op that makes or writes data (views and metadata ops are no
kernels), with its stream, FLOPs (torch.utils.flop_counter's per-op formulas; a causal attention
kernel at half), bytes read and written, dtype, and for the FLOP-carrying ones its call site; every
collective and p2p batch as the comm layer issues it (the stream it runs on and the stream it was
issued from; what it is, its group and size are the rank's CommLog entries, joined by order in
`joined`); event records and waits; host syncs (an event synchronized, a host read through
megazero.core.host_read); the training steps' starts and ends. It changes nothing the checker does.

Records are tuples (cheap to make and to send back from a rank's process):
    ("k", stream, op, flops, bytes, dtype, dims, site)   a device kernel (dims: a matmul's m, n, k)
    ("h", stream, op, bytes)                             a host op (host tensors only)
    ("x", stream, bytes, site)                           a host<->device copy
    ("c", stream, issuing stream, CommEntry...)          a collective (after `joined`)
    ("p", stream, issuing stream, ((kind, peer, bytes), ...), site)   a p2p batch (after `joined`)
    ("r", stream, event) / ("w", stream, event)          an event recorded / waited on by a stream
    ("e", event) / ("s", stream)                         the host waits for an event / a stream
    ("m", "start" | "end")                               a training step's bounds
Must not touch what the run computes, nor the checker's findings.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import flop_registry

from megazero.core import source_paths, stream_check
from megazero.core.stream_check import STASH
from megazero.training import phases

from megazero.core.op_access import AccessMode  # an op's reads and writes, by its schema

aten = torch.ops.aten
_MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
# causal flag's position among a kernel's arguments (the kernel computes half of the scores)
_CAUSAL_AT = {
    aten._scaled_dot_product_flash_attention: 4,
    aten._scaled_dot_product_flash_attention_backward: 11,
    aten._scaled_dot_product_efficient_attention: 6,
    aten._scaled_dot_product_efficient_attention_backward: 11,
}


stream_check.skip_frames_of(__file__)

# Ops the aten level shows with fresh outputs that are views or no-ops on a GPU: no kernel.
_NO_KERNEL = {aten._unsafe_view.default, aten.lift_fresh.default, aten.alias.default, aten.detach.default}
_HERE = str(Path(__file__).resolve().parent)


def _site() -> str:
    """file:line (function) of the op's caller: the first frame outside torch, the stream layer and
    the dry run's own stand-ins."""
    frame = sys._getframe(3)
    while frame is not None and (
        stream_check._skipped(frame.f_code.co_filename)
        or frame.f_code.co_filename.startswith(_HERE)
        or frame.f_code.co_name == "__torch_function__"
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{source_paths.shown(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _dims(packet, args) -> tuple | None:
    """(m, n, k) of a matmul, (query rows, key rows, head dim) of an attention kernel: the smallest
    of them bounds its efficiency."""
    if packet in _MATMULS:
        a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
        return (a.shape[-2], b.shape[-1], a.shape[-1])
    if packet in _CAUSAL_AT:  # forward: query, key; backward: grad_out (the query's shape), query
        return (args[0].shape[-2], args[1].shape[-2], args[0].shape[-1])
    return None


def _flops(packet, args, kwargs, out) -> float:
    formula = flop_registry.get(packet)
    if formula is None:
        return 0.0
    try:
        flops = float(formula(*args, out_val=out, **kwargs))
    except Exception:  # noqa: BLE001 - a formula that does not take this overload: no FLOPs
        return 0.0
    at = _CAUSAL_AT.get(packet)
    causal = kwargs.get("is_causal", args[at] if at is not None and len(args) > at else False)
    return flops / 2 if causal is True else flops


class _TracingMode(AccessMode):
    """The checker's dispatch mode (every aten op to `checker.op`, as core's) that also traces it."""

    def accessed(self, func, args, kwargs, out, reads, writes, fresh) -> None:
        super().accessed(func, args, kwargs, out, reads, writes, fresh)
        if (writes or fresh) and func not in _NO_KERNEL:
            self.checker.kernel(func, args, kwargs, out, reads, writes + fresh)


class TracingChecker(stream_check.StreamChecker):
    """The stream checker writing the rank's trace (`records`) as it goes. `reads`: host_read's
    open recording (each new read is a host sync on the current stream)."""

    def __init__(self, *args, reads: list | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._mode = _TracingMode(self)
        self.records: list = []
        self.threads: set[int] = set()  # streams of host threads (their ops are host work)
        self._reads, self._reads_seen = reads, 0
        self._events: dict[int, int] = {}  # id(event) -> the serial of its latest record
        self._serial = 0
        self._listening = None

    def __enter__(self):
        super().__enter__()
        self._listening = phases.listening(self)
        self._listening.__enter__()
        return self

    def __exit__(self, kind, value, tb):
        self._listening.__exit__(None, None, None)
        super().__exit__(kind, value, tb)

    def phase_started(self, name: str) -> None:
        if name == "train step":
            self.records.append(("m", "start"))

    def phase_ended(self, name: str, error) -> None:
        if name == "train step":
            self._host_reads()
            self.records.append(("m", "end"))

    def _host_reads(self) -> None:
        if self._reads is not None and len(self._reads) > self._reads_seen:
            self._reads_seen = len(self._reads)
            self.records.append(("s", self.current.id))

    def kernel(self, func, args, kwargs, out, reads, written) -> None:
        self._host_reads()
        kinds = {t.device.type for t in reads} | {t.device.type for t in written}
        nbytes = _nbytes(reads) + _nbytes(written)
        stream = self.current.id
        if "meta" not in kinds:
            self.records.append(("h", stream, func.__name__, nbytes))
        elif "cpu" in kinds:
            self.records.append(("x", stream, nbytes, _site()))
        else:
            packet = func.overloadpacket
            flops = _flops(packet, args, kwargs, out) if packet in flop_registry else 0.0
            site = _site() if flops else ""
            # a matmul's inputs say which units run it (bf16 inputs with an fp32 output: tensor cores)
            dtype = (reads[0] if flops and reads else written[0]).dtype
            self.records.append(("k", stream, func.__name__, flops, nbytes, str(dtype)[6:], _dims(packet, args), site))

    def collective(self, key, name, reads, writes, issue, async_op: bool = True):
        self._host_reads()
        record = ["c", None, self.current.id, len(reads) + len(writes)]  # a p2p batch: its messages
        self.records.append(record)
        result = super().collective(key, name, reads, writes, issue, async_op)
        sync_here = self.semantics == STASH and not async_op
        record[1] = record[2] if sync_here else self._communicators[key].id
        return result

    def host_thread(self, name, reads, writes, issue):
        done = super().host_thread(name, reads, writes, issue)
        self.threads.add(self._communicators[("host thread", name)].id)
        return done

    def record_event(self, event, stream) -> None:
        super().record_event(event, stream)
        self._serial += 1
        self._events[id(event)] = self._serial
        self.records.append(("r", stream.id, self._serial))

    def wait_event(self, stream, event) -> None:
        super().wait_event(stream, event)
        if event.clock is not None:
            self._host_reads()
            self.records.append(("w", stream.id, self._events.get(id(event), 0)))

    def synchronize_event(self, event) -> None:
        super().synchronize_event(event)
        if event.clock is not None:
            self.records.append(("e", self._events.get(id(event), 0)))

    def result(self, entries: list) -> dict:
        """What the rank sends back: its last training step's records (collectives joined with the
        rank's CommLog `entries`; the earlier steps and the setup are left here: a large job's
        trace is mostly them), host-thread streams and stream names."""
        try:
            records = last_step(joined([tuple(r) for r in self.records], entries))
        except ValueError:  # a rank that stopped mid-op: no step to time (its error says why)
            records = []
        return {"records": records, "threads": sorted(self.threads), "streams": {s.id: s.name for s in self.streams}}


@contextlib.contextmanager
def tracing(reads: list | None = None, **kwargs):
    """stream_check.checking's block with the trace written (`checker.result(entries)` at the end)."""
    with TracingChecker(reads=reads, **kwargs) as checker:
        yield checker


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 0


def joined(records: list, entries: list) -> list:
    """The records with each collective's CommEntry (and a p2p batch's entries, one per message)
    taken from the rank's CommLog `entries`, in order: the comm layer records an op's entries just
    before it issues it; barriers are recorded without an issue and are left out."""
    out, at = [], 0
    todo = [e for e in entries if e.op != "barrier"]
    for r in records:
        if r[0] != "c":
            out.append(r)
            continue
        if at >= len(todo):
            raise ValueError("the trace has more collectives than the CommLog: they cannot be joined")
        first = todo[at]
        if first.op in ("send", "recv"):
            batch = tuple((e.op, e.peer, e.numel * _itemsize(e.dtype)) for e in todo[at : at + r[3]])
            at += r[3]
            out.append(("p", r[1], r[2], batch, first.site))
        else:
            out.append(("c", r[1], r[2], first))
            at += 1
    return out


def last_step(records: list) -> list:
    """The records of the last complete training step (steady state), between its marks."""
    ends = [i for i, r in enumerate(records) if r[0] == "m" and r[1] == "end"]
    if not ends:
        return []
    starts = [i for i, r in enumerate(records[: ends[-1]]) if r[0] == "m" and r[1] == "start"]
    return records[starts[-1] + 1 : ends[-1]] if starts else []
