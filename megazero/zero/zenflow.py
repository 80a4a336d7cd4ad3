"""ZenFlow (DeepSpeed's `zenflow` block): ZeRO-Offload without the CPU stall, for one storage.

On top of optimizer offload to host memory (stages 1-3), each parameter is seen as a matrix of
columns (its last dimension; a 1-D parameter is one column). After `full_warm_up_rounds` steps of
plain offload, the columns with the largest gradient norm (`topk_ratio` of each parameter's, at
least one when positive; the norm summed over the shard group, so every rank picks the same) are
*selected*: their master weights and Adam moments are copied to the device and updated there every
step. Every gradient also goes to the host, where it is accumulated in fp32 (`zenflow_acc`); every
`update_interval` steps the CPU Adam applies the window's mean gradient to the host states and the
device weights follow, except the selected ones, which the device keeps. With `overlap_step` the
CPU Adam runs on a background thread while the next window computes; its result is applied at the
end of that next window (a step boundary, on the training thread, after a join), so the device
update and the host update never touch the same tensor at the same time. Selection is renewed at
a window start every `select_interval` steps (or epochs); the old selection's device states go
back to the host first.

The two ends are exact: `topk_ratio` 1 is the device optimizer (every element selected, stepped
with the global step count); `topk_ratio` 0 with `update_interval` 1 and no overlap is plain
optimizer offload. The CPU Adam steps the whole partition (the selected elements' host states are
stale copies, replaced when the selection moves), which wastes `topk_ratio` of its work but keeps
it one contiguous pass per weight-decay run.

Where everything is, given the step count t after the warm-up and the interval k: a window ends
after steps k, 2k, ...; with overlap, a result is pending from the end of window 2 on. A
checkpoint holds the host states of record (the selected ones copied back first), the weights in
use ("param"), the accumulator, the selection mask and the pending result, so a run resumes
exactly mid-window.

Owns the ZenFlow step of one storage; never decides when to step, gather or save.
"""
from __future__ import annotations

import threading
import time

import torch

from megazero.core import comm
from megazero.core.streams import Event, host_thread_work
from megazero.ops.adam import adam_update
from .offload import OFFLOADED_KINDS, OptimizerOffload, _nbytes

ZENFLOW_KINDS = ("zenflow_acc", "zenflow_selected", "zenflow_pending")


def column_sumsq(piece: torch.Tensor, offset: int, columns: int) -> torch.Tensor:
    """Sum of squares per column of a [rows, columns] matrix over the flat elements
    [offset, offset + len(piece)) that `piece` holds (a partial first and last row allowed)."""
    out = torch.zeros(columns, dtype=torch.float32, device=piece.device)
    sq = piece.float().square()
    col0 = offset % columns
    head = min(len(sq), (columns - col0) % columns)
    if head:
        out[col0:col0 + head] += sq[:head]
    rows = (len(sq) - head) // columns
    if rows:
        out += sq[head:head + rows * columns].view(rows, columns).sum(0)
    tail = sq[head + rows * columns:]
    out[:len(tail)] += tail
    return out


def top_columns(sumsq: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices of the `ratio` largest columns (at least one when ratio > 0)."""
    count = 0 if ratio <= 0 else max(1, int(ratio * len(sumsq)))
    return torch.topk(sumsq, min(count, len(sumsq)), sorted=False).indices


class ZenFlowOffload(OptimizerOffload):
    """The ZenFlow step of one storage (see the module docstring)."""
    kinds = OFFLOADED_KINDS + ZENFLOW_KINDS
    checkpoint_kinds = OFFLOADED_KINDS + ("param",) + ZENFLOW_KINDS

    def __init__(self, storage, config, sub_group_size, folder, name, *, zenflow, cpu_threads: int):
        super().__init__(storage, config, sub_group_size, folder, name)
        self.flow, self.cpu_threads = zenflow, cpu_threads
        self.storage = storage
        n = storage.layout.partition_size
        pin = config.pin_memory and storage.device.type == "cuda"
        host = dict(device="cpu", pin_memory=pin)
        self.acc = torch.zeros(n, dtype=torch.float32, **host)
        # The window being stepped by the CPU (overlap: while the next one accumulates).
        self.window_grad = torch.zeros(n, dtype=torch.float32, **host) if zenflow.overlap_step else self.acc
        self.grad_in = torch.empty(n, dtype=storage.precision.grad_accum_dtype, **host)
        # The CPU Adam's output weights: the 16-bit copy, or (fp32 runs) the host master itself.
        self.lp = torch.empty(n, dtype=storage.precision.param_dtype, **host) if storage.precision.mixed else None
        self.mask = torch.zeros(n, dtype=torch.float32, device="cpu")      # 1: selected element
        self.groups: list[dict] = []      # per weight decay: device index and states of the selected
        self.stale = True                 # device states to be taken from the host (after a load)
        self.on_host = True               # host states hold the selected elements' values too
        self.thread: threading.Thread | None = None
        self.thread_done = None
        self.stats = {"cpu_adam_ms": 0.0, "wait_ms": 0.0, "cpu_updates": 0}
        self.partition_runs = [(storage.layout.buckets[b].local_offset + lo,
                                storage.layout.buckets[b].local_offset + hi, wd)
                               for b, lo, hi, wd in storage.runs]

    # --- values of record -------------------------------------------------------------------------
    def _updated(self) -> torch.Tensor:
        return self.host["fp32"] if self.lp is None else self.lp

    def view(self, kind: str, start: int, length: int) -> torch.Tensor:
        """As OptimizerOffload.view, after the host has become the record of every state (the
        CPU Adam joined, the selected elements copied back); the device copies are taken again
        from the host at the next step, as the caller may write the view (a checkpoint load)."""
        self.settle()
        self.stale = True
        extra = {"zenflow_acc": self.acc, "zenflow_selected": self.mask, "zenflow_pending": self._updated()}
        if kind in extra:
            return extra[kind][start:start + length]
        return super().view(kind, start, length)

    def settle(self) -> None:
        """Joins the CPU Adam and copies the selected elements' device states to the host states
        (and to the pending weights, which would otherwise carry the CPU's stale copy of them)."""
        self._join()
        if self.on_host:
            return
        for g in self.groups:
            idx = g["host_index"]
            for kind in OFFLOADED_KINDS:
                self.host[kind].index_copy_(0, idx, g[kind].to("cpu"))
            if self.lp is not None:
                self.lp.index_copy_(0, idx, g["fp32"].to("cpu").to(self.lp.dtype))
        self.on_host = True

    # --- selection --------------------------------------------------------------------------------
    def _select(self, storage) -> None:
        """Chooses the columns by this step's gradient norms, summed over the shard group."""
        pieces, sums = [], []
        for i, param in enumerate(storage.params):
            piece = storage.layout.local_piece(i)
            shape = storage.full_shape(i)
            columns = shape[-1] if len(shape) >= 2 else 1
            grad = storage.local_view(param, "grad") if piece is not None else None
            sums.append(column_sumsq(grad, piece.param_offset, columns) if piece is not None
                        else torch.zeros(columns, device=storage.device))
            pieces.append((piece, columns))
        flat = torch.cat(sums) if sums else torch.zeros(0, device=storage.device)
        if storage.shard is not None and storage.shard.size > 1:
            comm.all_reduce(flat, storage.shard)
        mask = torch.zeros(storage.layout.partition_size, dtype=torch.bool, device=storage.device)
        at = 0
        for piece, columns in pieces:
            chosen = top_columns(flat[at:at + columns], self.flow.topk_ratio)
            at += columns
            if piece is None or len(chosen) == 0:
                continue
            cols = torch.arange(piece.param_offset, piece.param_offset + piece.length,
                                device=storage.device) % columns
            start = piece.partition_offset
            mask[start:start + piece.length] = torch.isin(cols, chosen)
        self.mask.copy_(mask)

    def _take_selection(self, storage) -> None:
        """The device states of the selected elements (per weight decay), from the host states."""
        self.groups = []
        by_wd: dict[float, list[torch.Tensor]] = {}
        for start, end, wd in self.partition_runs:
            hit = torch.nonzero(self.mask[start:end] > 0).view(-1) + start
            if len(hit):
                by_wd.setdefault(wd, []).append(hit)
        bucket_starts = [b.local_offset for b in storage.layout.buckets]
        for wd, hits in by_wd.items():
            idx = torch.cat(hits)
            g = {"wd": wd, "host_index": idx, "index": idx.to(storage.device)}
            for kind in OFFLOADED_KINDS:
                g[kind] = self.host[kind].index_select(0, idx).to(storage.device)
            # Per bucket: the run of `index` inside it, as indices into that bucket's chunk.
            cuts = torch.searchsorted(idx, torch.tensor(bucket_starts + [storage.layout.partition_size])).tolist()
            g["buckets"] = [(b, cuts[b], cuts[b + 1], g["index"][cuts[b]:cuts[b + 1]] - bucket_starts[b])
                            for b in range(len(bucket_starts)) if cuts[b + 1] > cuts[b]]
            self.groups.append(g)
        self.stale, self.on_host = False, not self.groups

    # --- the step ---------------------------------------------------------------------------------
    def step(self, storage, step: int, lr: float, config, grad_scale: float) -> None:
        flow = self.flow
        t = step - flow.full_warm_up_rounds
        if t <= 0:
            self.settle()
            super().step(storage, step, lr, config, grad_scale)
            return
        k = int(flow.update_interval)
        every = flow.select_every()
        window_start = (t - 1) % k == 0
        if t == 1 or (window_start and every > 0 and (t - 1) // every != (t - 1 - k) // every):
            self.settle()
            self._select(storage)
            self._take_selection(storage)
        elif self.stale:
            self.settle()
            self._take_selection(storage)
        for g in self.groups:           # the selected elements: Adam on the device, every step
            grad = torch.cat([storage.grad_chunk(b).index_select(0, rel) for b, _, _, rel in g["buckets"]])
            adam_update(g["fp32"], grad, g["exp_avg"], g["exp_avg_sq"], step=step, lr=lr, config=config,
                        weight_decay=g["wd"], grad_scale=grad_scale)
        self.on_host = self.on_host and not self.groups
        self._write_selected(storage)
        self._accumulate(storage, grad_scale)
        if t % k == 0:
            self._end_window(storage, flow.full_warm_up_rounds + t // k, lr, config, k,
                             pending=flow.overlap_step and t >= 2 * k)

    def _write_selected(self, storage) -> None:
        for g in self.groups:
            for b, lo, hi, rel in g["buckets"]:
                chunk = storage.param_chunk(b)
                chunk.index_copy_(0, rel, g["fp32"][lo:hi].to(chunk.dtype))

    def _accumulate(self, storage, grad_scale: float) -> None:
        """acc += every gradient of this step, unscaled (copied to the host first)."""
        for b, bucket in enumerate(storage.layout.buckets):
            self.grad_in[bucket.local_offset:bucket.local_offset + bucket.chunk].copy_(
                storage.grad_chunk(b), non_blocking=True)
        self.copied.record()
        self.copied.synchronize()
        self.acc.add_(self.grad_in, alpha=grad_scale)

    def _end_window(self, storage, cpu_step: int, lr: float, config, k: int, pending: bool) -> None:
        """The window's CPU Adam: at once, or (overlap) on a thread after applying the last one's."""
        if not self.flow.overlap_step:
            self._cpu_adam(self.acc, cpu_step, lr, config, 1.0 / k, None)   # every thread: nothing beside it
            self._apply(storage)
            self.acc.zero_()
            return
        if pending:
            self._join()
            self._apply(storage)
        self.acc, self.window_grad = self.window_grad, self.acc
        self.acc.zero_()
        # The thread reads and writes host tensors only: what the host queued on them is done.
        done = Event(storage.device).record()
        done.synchronize()
        grad = self.window_grad
        self.thread = threading.Thread(target=self._cpu_adam, name="zenflow-cpu-adam", daemon=True,
                                       args=(grad, cpu_step, lr, config, 1.0 / k, self.cpu_threads))
        self.thread_done = host_thread_work(
            storage.device, "zenflow cpu adam", reads=[grad],
            writes=[t for t in (self.host["fp32"], self.host["exp_avg"], self.host["exp_avg_sq"], self.lp)
                    if t is not None], start=self.thread.start)

    def _cpu_adam(self, grad: torch.Tensor, cpu_step: int, lr: float, config, scale: float,
                  threads: int | None) -> None:
        began = time.perf_counter()
        master, m, v = self.host["fp32"], self.host["exp_avg"], self.host["exp_avg_sq"]
        for start, end, wd in self.partition_runs:
            r = slice(start, end)
            adam_update(master[r], grad[r], m[r], v[r], step=cpu_step, lr=lr, config=config,
                        weight_decay=wd, grad_scale=scale, param_copy=None if self.lp is None else self.lp[r],
                        num_threads=threads)
        self.stats["cpu_adam_ms"] += (time.perf_counter() - began) * 1e3
        self.stats["cpu_updates"] += 1

    def _join(self) -> None:
        if self.thread is None:
            return
        began = time.perf_counter()
        self.thread.join()
        self.thread_done.synchronize()
        self.stats["wait_ms"] += (time.perf_counter() - began) * 1e3
        self.thread = self.thread_done = None

    def _apply(self, storage) -> None:
        """The device weights take the CPU Adam's result, the selected ones the device's own."""
        updated = self._updated()
        for b, bucket in enumerate(storage.layout.buckets):
            storage.param_chunk(b).copy_(updated[bucket.local_offset:bucket.local_offset + bucket.chunk],
                                         non_blocking=True)
        self._write_selected(storage)
        # The host result is overwritten by the next CPU Adam: the copies must have left.
        self.copied.record()
        self.copied.synchronize()

    # --- accounting -------------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        out = super().memory_bytes()
        for g in self.groups:       # the selected elements' device states, and their indices
            out["master"] += _nbytes(g["fp32"])
            out["optimizer_states"] += _nbytes(g["exp_avg"]) + _nbytes(g["exp_avg_sq"]) + _nbytes(
                g["index"]) + sum(_nbytes(rel) for *_, rel in g["buckets"])
        extra = [self.acc, self.grad_in, self.lp] + ([self.window_grad] if self.flow.overlap_step else [])
        out["host_offload_buffers"] += sum(_nbytes(t) for t in extra)
        return out

    def close(self) -> None:
        self._join()
        super().close()
