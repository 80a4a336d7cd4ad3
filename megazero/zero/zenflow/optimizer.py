"""ZenFlow (DeepSpeed's `zenflow` block): ZeRO-Offload without the CPU stall, for one storage.

On top of optimizer offload to host memory (stages 1-3), each parameter is seen as a matrix of
columns (its last dimension, a linear layer's input channels, an embedding's hidden channels, as
DeepSpeed's `weight[:, j]`, embeddings and the tied output layer included; a 1-D parameter is one
column, so it is always selected whole).
After `full_warm_up_rounds` steps of plain offload, the columns with the largest gradient L1 norm
(`topk_ratio` of each parameter's, at least one when positive; the norm summed over the shard
group, so every rank picks the same, and taken over the whole matrix where tensor parallelism splits
it: summed over the tensor-parallel ranks where its rows are split, gathered where its columns are,
so a layout picks the columns one process would) are *selected*: they are updated on the device every step by
an Adam of their own, as DeepSpeed's selective optimizer: its master starts from the master of
record, its moments from zero at every selection, and its step count from the end of the warm-up
(it is not reset at a re-selection). Every gradient also goes to the host, where it is
accumulated in fp32 (`zenflow_acc`); every `update_interval` steps (with "auto": when the engine's
AutoWindows, zenflow/windows.py, says the window ends) the CPU Adam applies the window's mean
gradient (DeepSpeed divides the loss by update_interval, its gradient accumulation steps) to the
host states, with the step count and lr of the step that ends the window (as DeepSpeed's
`step_id = micro_step + 1`: a window's bias correction is that of the global step, not of the
number of windows), and the device weights follow, except the selected ones, which the
device keeps. The CPU Adam's moments are its own for every column: a selection never copies them
to or from the device. With `overlap_step` the CPU Adam runs on a background thread while the next
window computes; its result is applied at the end of that next window (a step boundary, on the
training thread, after a join), so the device update and the host update never touch the same
tensor at the same time. Selection is renewed at a window start every `select_interval` steps (or
epochs); the old selection's master goes back to the host first. With `offload` the selected
columns' moments live in host memory and visit the device for their step (DeepSpeed's
`zenflow.offload`): the same numbers, less device memory, two copies per step.

Not followed: DeepSpeed's overlapped CPU process keeps two sets of Adam moments, one per gradient
buffer, so each sees every other window; here one set sees every window (one optimizer, as its
sequential mode, half the host memory). Its re-selection copies the device weights over the CPU
master while the CPU may still be stepping it; here the CPU Adam is joined first. Its selective
Adam takes the unclipped gradient; here both parts take the clipped one the step applies. It
selects int(topk_ratio x columns), none for a narrow matrix; here at least one. Under tensor
parallelism (Megatron-DeepSpeed) it sees each rank's shard as a matrix; here the whole matrix.

The two ends are exact: `topk_ratio` 1 is the device optimizer (every element selected, stepped
with the global step count, moments from zero at step 1); `topk_ratio` 0 with `update_interval` 1
and no overlap is plain optimizer offload. The CPU Adam steps the whole partition (the selected
elements' host master is a stale copy, replaced when the selection moves), which wastes
`topk_ratio` of its work but keeps it one contiguous pass per weight-decay run.

Where everything is, given the step count t after the warm-up: a window of u steps ends at t (at
t = k, 2k, ... for a fixed interval k); with overlap, a result is pending at a window's end when an
earlier window ended (t > u). A checkpoint holds the host states of record (the selected master
copied back first), the weights in use ("param"), the accumulator, the selection mask, the pending
result and the selected columns' device moments (and, with "auto", the engine's AutoWindows its
open window), so a run resumes exactly mid-window.

Owns the ZenFlow step of one storage; never decides when to step, gather or save.
"""

from __future__ import annotations

import threading
import time

import torch

from megazero.core import comm, host_read
from megazero.core.streams import Event, host_thread_work
from megazero.ops.adam import adam_update
from ..offload import OFFLOADED_KINDS, OptimizerOffload, _nbytes
from .columns import column_abs_sums, first_columns, matrix_splits, selection_mask

ZENFLOW_KINDS = ("zenflow_acc", "zenflow_selected", "zenflow_pending")
# The selected columns' device moments, at their elements of the partition (zero elsewhere).
SELECTED_MOMENTS = {"zenflow_exp_avg": "exp_avg", "zenflow_exp_avg_sq": "exp_avg_sq"}


class ZenFlowOffload(OptimizerOffload):
    """The ZenFlow step of one storage (see the module docstring)."""

    kinds = OFFLOADED_KINDS + ZENFLOW_KINDS + tuple(SELECTED_MOMENTS)
    checkpoint_kinds = OFFLOADED_KINDS + ("param",) + ZENFLOW_KINDS + tuple(SELECTED_MOMENTS)

    def __init__(
        self,
        storage,
        config,
        sub_group_size,
        folder,
        name,
        *,
        zenflow,
        cpu_threads: int,
        windows=None,
        tensor=None,
        counted=None,
    ):
        super().__init__(storage, config, sub_group_size, folder, name)
        self.flow, self.cpu_threads = zenflow, cpu_threads
        self.windows = windows  # update_interval "auto": the engine's AutoWindows
        self.storage = storage
        # Tensor parallelism: the matrices it splits (their shard, else None), whose column norms
        # and "auto" sums are taken over the whole matrix, on every tensor-parallel rank alike.
        self.tensor = tensor if tensor is not None and tensor.size > 1 else None
        # and the matrices "auto" counts (columns.matrix_splits; `counted`: the gradient norm's rule)
        self.tp_split, self.columns_split, self.matrices = matrix_splits(
            storage, self.tensor, counted or (lambda p: True)
        )
        self.split_rows = torch.tensor([s is not None for s in self.tp_split], device=storage.device).unsqueeze(1)
        n = storage.layout.partition_size
        pin = config.pin_memory and storage.device.type == "cuda"
        host = dict(device="cpu", pin_memory=pin)
        self.acc = torch.zeros(n, dtype=torch.float32, **host)
        # The window being stepped by the CPU (overlap: while the next one accumulates).
        self.window_grad = torch.zeros(n, dtype=torch.float32, **host) if zenflow.overlap_step else self.acc
        self.grad_in = torch.empty(n, dtype=storage.precision.grad_accum_dtype, **host)
        # The CPU Adam's output weights: the 16-bit copy, or (fp32 runs) the host master itself.
        self.lp = torch.empty(n, dtype=storage.precision.param_dtype, **host) if storage.precision.mixed else None
        self.mask = torch.zeros(n, dtype=torch.float32, device="cpu")  # 1: selected element
        self.groups: list[dict] = []  # per weight decay: device index and states of the selected
        self.stale = True  # device states to be taken from the host (after a load)
        self.on_host = True  # the host master holds the selected elements' values too
        # The selected moments spread over the partition, while a checkpoint reads or writes them.
        self.moments: dict[str, torch.Tensor] | None = None
        self.moments_host = dict(device="cpu", pin_memory=pin) if zenflow.offload else None
        self.thread: threading.Thread | None = None
        self.thread_done = None
        self.stats = {"cpu_adam_ms": 0.0, "wait_ms": 0.0, "cpu_updates": 0}
        self.partition_runs = [
            (storage.layout.buckets[b].local_offset + lo, storage.layout.buckets[b].local_offset + hi, wd)
            for b, lo, hi, wd, _ in storage.runs
        ]
        # Where each parameter's piece starts in the partition, in order: an element's parameter.
        pieces = sorted(
            (piece.partition_offset, i)
            for i in range(len(storage.params))
            if (piece := storage.layout.local_piece(i)) is not None
        )
        self.piece_starts = torch.tensor([start for start, _ in pieces], dtype=torch.long)
        self.piece_params = torch.tensor([i for _, i in pieces], dtype=torch.long)

    # --- values of record -------------------------------------------------------------------------
    def _updated(self) -> torch.Tensor:
        return self.host["fp32"] if self.lp is None else self.lp

    def view(self, kind: str, start: int, length: int) -> torch.Tensor:
        """As OptimizerOffload.view, after the host has become the record of every state (the
        CPU Adam joined, the selected master copied back, the selected moments spread over two
        partition-sized host buffers); the device copies are taken again from the host at the
        next step, as the caller may write the view (a checkpoint load)."""
        self.settle()
        if self.moments is None:
            self.moments = {kind: torch.zeros_like(self.acc) for kind in SELECTED_MOMENTS}
            for g in self.groups:
                for name, state in SELECTED_MOMENTS.items():
                    self.moments[name].index_copy_(0, g["host_index"], g[state].to("cpu"))
        self.stale = True
        extra = {
            "zenflow_acc": self.acc,
            "zenflow_selected": self.mask,
            "zenflow_pending": self._updated(),
            **self.moments,
        }
        if kind in extra:
            return extra[kind][start : start + length]
        return super().view(kind, start, length)

    def settle(self) -> None:
        """Joins the CPU Adam and copies the selected elements' device master to the host master
        (and to the pending weights, which would otherwise carry the CPU's stale copy of them)."""
        self._join()
        if self.on_host:
            return
        for g in self.groups:
            idx = g["host_index"]
            self.host["fp32"].index_copy_(0, idx, g["fp32"].to("cpu"))
            if self.lp is not None:
                self.lp.index_copy_(0, idx, g["fp32"].to("cpu").to(self.lp.dtype))
        self.on_host = True

    # --- selection --------------------------------------------------------------------------------
    def _select(self, storage) -> None:
        """Chooses the columns by this step's gradient L1 norms, summed over the shard group."""
        pieces, sums = [], []
        for i, param in enumerate(storage.params):
            piece = storage.layout.local_piece(i)
            shape = storage.full_shape(i)
            columns = shape[-1] if len(shape) >= 2 else 1
            grad = storage.local_view(param, "grad") if piece is not None else None
            sums.append(
                column_abs_sums(grad, piece.param_offset, columns)
                if piece is not None
                else torch.zeros(columns, device=storage.device)
            )
            pieces.append((piece, columns))
        flat = torch.cat(sums) if sums else torch.zeros(0, device=storage.device)
        if storage.shard is not None and storage.shard.size > 1:
            comm.all_reduce(flat, storage.shard)
        per_rank = None
        if self.tensor is not None:  # every tensor-parallel rank's sums, to see whole matrices
            per_rank = torch.empty(self.tensor.size * len(flat), dtype=flat.dtype, device=flat.device)
            comm.all_gather(per_rank, flat, self.tensor)
            per_rank = per_rank.view(self.tensor.size, -1)
        mask = selection_mask(
            pieces,
            flat,
            per_rank,
            self.tp_split,
            self.columns_split,
            self.flow.topk_ratio,
            storage.layout.partition_size,
        )
        host_read.copy_into(
            self.mask, mask, "zenflow selection", healthy=lambda: first_columns(pieces, self.flow.topk_ratio, self.mask)
        )

    def _take_selection(self, storage) -> None:
        """The device states of the selected elements (per weight decay): the master from the host
        master, the moments from a checkpoint's (`self.moments`) or zero (a new selection)."""
        self.groups = []
        by_wd: dict[float, list[torch.Tensor]] = {}
        for start, end, wd in self.partition_runs:
            hit = torch.nonzero(self.mask[start:end] > 0).view(-1) + start
            if len(hit):
                by_wd.setdefault(wd, []).append(hit)
        bucket_starts = [b.local_offset for b in storage.layout.buckets]
        for wd, hits in by_wd.items():
            idx = torch.cat(hits)
            param_of = self.piece_params[torch.searchsorted(self.piece_starts, idx, right=True) - 1]
            g = {
                "wd": wd,
                "host_index": idx,
                "index": idx.to(storage.device),
                "fp32": self.host["fp32"].index_select(0, idx).to(storage.device),
                "param_of": param_of.to(storage.device),
            }
            where = self.moments_host or dict(device=storage.device)
            for kind, state in SELECTED_MOMENTS.items():
                g[state] = torch.zeros(len(idx), dtype=torch.float32, **where)
                if self.moments is not None:
                    g[state].copy_(self.moments[kind].index_select(0, idx))
            # Per bucket: the run of `index` inside it, as indices into that bucket's chunk.
            cuts = torch.searchsorted(idx, torch.tensor(bucket_starts + [storage.layout.partition_size])).tolist()
            g["buckets"] = [
                (b, cuts[b], cuts[b + 1], g["index"][cuts[b] : cuts[b + 1]] - bucket_starts[b])
                for b in range(len(bucket_starts))
                if cuts[b + 1] > cuts[b]
            ]
            self.groups.append(g)
        self.stale, self.on_host, self.moments = False, not self.groups, None

    # --- the step ---------------------------------------------------------------------------------
    def step(self, storage, step: int, lr: float, config, grad_scale: float) -> None:
        flow = self.flow
        t = step - flow.full_warm_up_rounds
        if t <= 0:
            self.settle()
            super().step(storage, step, lr, config, grad_scale)
            return
        if self.windows is None:  # "auto": the engine's AutoWindows prepared the step
            self.prepare(storage, t)
        self._step_selected(storage, t, lr, config, grad_scale)
        self._accumulate(storage, grad_scale)
        if self.windows is not None:
            ends, steps = self.windows.ends, self.windows.steps
        else:
            steps = int(flow.update_interval)
            ends = t % steps == 0
        if ends:
            self._end_window(storage, step, lr, config, steps, pending=flow.overlap_step and t > steps)

    def prepare(self, storage, t: int) -> None:
        """The selection step t (after the warm-up) works with: chosen anew when due, at a window
        start; taken again from the host after a checkpoint wrote it."""
        if self._selection_due(t):
            self.settle()
            self.moments = None  # a new selection's moments start from zero
            self._select(storage)
            self._take_selection(storage)
        elif self.stale:
            self.settle()
            self._take_selection(storage)

    def _selection_due(self, t: int) -> bool:
        every = self.flow.select_every()
        if t == 1 or every <= 0:
            return t == 1
        if self.windows is not None:  # "auto" ends a window at every multiple of `every`
            return (t - 1) % every == 0
        k = int(self.flow.update_interval)
        return (t - 1) % k == 0 and (t - 1) // every != (t - 1 - k) // every

    def column_l1(self, storage, grad_scale: float) -> torch.Tensor:
        """[parameters, 2]: the L1 norms of each parameter's selected and other elements' gradient
        this step, as applied (times grad_scale), summed over the shard group ("auto"'s measure)."""
        total = torch.zeros(len(storage.params), dtype=torch.float32, device=storage.device)
        for i, param in enumerate(storage.params):
            if storage.layout.local_piece(i) is not None:
                total[i] = storage.local_view(param, "grad").float().abs().sum()
        selected = torch.zeros_like(total)
        for g in self.groups:
            selected.index_add_(0, g["param_of"], self._selected_grad(storage, g).float().abs())
        out = torch.stack([selected, (total - selected).clamp_min_(0.0)], 1).mul_(grad_scale)
        if storage.shard is not None and storage.shard.size > 1:
            comm.all_reduce(out, storage.shard)
        if self.tensor is not None:  # a split matrix's sums over its whole
            whole = out * self.split_rows
            comm.all_reduce(whole, self.tensor)
            out = torch.where(self.split_rows, whole, out)
        return out

    @staticmethod
    def _selected_grad(storage, g: dict) -> torch.Tensor:
        return torch.cat([storage.grad_chunk(b).index_select(0, rel) for b, _, _, rel in g["buckets"]])

    def _step_selected(self, storage, t: int, lr: float, config, grad_scale: float) -> None:
        """Adam on the device for the selected elements, the t-th step of their own optimizer
        (their moments fetched from and returned to the host with `offload`)."""
        for g in self.groups:
            grad = self._selected_grad(storage, g)
            m, v = (g[state].to(storage.device, non_blocking=True) for state in ("exp_avg", "exp_avg_sq"))
            adam_update(
                g["fp32"], grad, m, v, step=t, lr=lr, config=config, weight_decay=g["wd"], grad_scale=grad_scale
            )
            if m is not g["exp_avg"]:  # offload: back to the host (waited on in _accumulate)
                g["exp_avg"].copy_(m, non_blocking=True)
                g["exp_avg_sq"].copy_(v, non_blocking=True)
        self.on_host = self.on_host and not self.groups
        self._write_selected(storage)

    def _write_selected(self, storage) -> None:
        for g in self.groups:
            for b, lo, hi, rel in g["buckets"]:
                chunk = storage.param_chunk(b)
                chunk.index_copy_(0, rel, g["fp32"][lo:hi].to(chunk.dtype))

    def _accumulate(self, storage, grad_scale: float) -> None:
        """acc += every gradient of this step, unscaled (copied to the host first)."""
        for b, bucket in enumerate(storage.layout.buckets):
            self.grad_in[bucket.local_offset : bucket.local_offset + bucket.chunk].copy_(
                storage.grad_chunk(b), non_blocking=True
            )
        self.copied.record()  # the gradients and (offload) the selected moments have arrived
        self.copied.synchronize()
        self.acc.add_(self.grad_in, alpha=grad_scale)

    def _end_window(self, storage, cpu_step: int, lr: float, config, steps: int, pending: bool) -> None:
        """The window's CPU Adam, with the step count of the step that ends it: at once, or
        (overlap) on a thread after applying the last window's."""
        if not self.flow.overlap_step:
            self._cpu_adam(self.acc, cpu_step, lr, config, 1.0 / steps, None)  # every thread: nothing beside it
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
        self.thread = threading.Thread(
            target=self._cpu_adam,
            name="zenflow-cpu-adam",
            daemon=True,
            args=(grad, cpu_step, lr, config, 1.0 / steps, self.cpu_threads),
        )
        self.thread_done = host_thread_work(
            storage.device,
            "zenflow cpu adam",
            reads=[grad],
            writes=[
                t for t in (self.host["fp32"], self.host["exp_avg"], self.host["exp_avg_sq"], self.lp) if t is not None
            ],
            start=self.thread.start,
        )

    def _cpu_adam(
        self, grad: torch.Tensor, cpu_step: int, lr: float, config, scale: float, threads: int | None
    ) -> None:
        began = time.perf_counter()
        master, m, v = self.host["fp32"], self.host["exp_avg"], self.host["exp_avg_sq"]
        for start, end, wd in self.partition_runs:
            r = slice(start, end)
            adam_update(
                master[r],
                grad[r],
                m[r],
                v[r],
                step=cpu_step,
                lr=lr,
                config=config,
                weight_decay=wd,
                grad_scale=scale,
                param_copy=None if self.lp is None else self.lp[r],
                num_threads=threads,
            )
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
            storage.param_chunk(b).copy_(
                updated[bucket.local_offset : bucket.local_offset + bucket.chunk], non_blocking=True
            )
        self._write_selected(storage)
        # The host result is overwritten by the next CPU Adam: the copies must have left.
        self.copied.record()
        self.copied.synchronize()

    # --- accounting -------------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        out = super().memory_bytes()
        for g in self.groups:  # the selected elements' device states, and their indices
            moments = _nbytes(g["exp_avg"]) + _nbytes(g["exp_avg_sq"])
            out["master"] += _nbytes(g["fp32"])
            out["optimizer_states"] += (
                (0 if self.flow.offload else moments)
                + _nbytes(g["index"])
                + sum(_nbytes(rel) for *_, rel in g["buckets"])
            )
            if self.flow.offload:
                out["host_optimizer_states"] += moments
        extra = [self.acc, self.grad_in, self.lp] + ([self.window_grad] if self.flow.overlap_step else [])
        extra += list((self.moments or {}).values())
        out["host_offload_buffers"] += sum(_nbytes(t) for t in extra)
        return out

    def close(self) -> None:
        self._join()
        super().close()
