"""One flat buffer of parameters under ZeRO stage 0, 1 or 2 (also stage 3's persistent parameters).

Owns the tensors of a `FlatLayout`: the parameter buffer the model's parameters are views of, the
fp32 master chunks and Adam states of this rank's partition, and the gradients:

  stage 0  full gradient buffer, all-reduced over DP (each rank keeps and updates everything)
  stage 1  full gradient buffer, each bucket reduce-scattered in place; the step updates own chunks
  stage 2  only this rank's gradient partition; gradients are copied into a bucket as autograd
           produces them and the bucket is reduce-scattered when full, then freed

Every collective goes through megazero.comm. In fp32 the master weights are this rank's chunks of
the parameter buffer itself (no copy); with bf16/fp16 they are a separate fp32 partition.
"""
from __future__ import annotations

import torch
from torch import nn

from megazero import comm
from .adam import AdamConfig, adam_update
from .flat import FlatLayout
from .groups import Precision, ZeroGroups, drop_storage, ensure_storage, sum_of_squares


class FlatParamGroup:
    def __init__(self, params: list[nn.Parameter], *, stage: int, weight_decay: float,
                 groups: ZeroGroups, precision: Precision, bucket_size: int, overlap: bool,
                 shared: bool, counted: list[bool], device, allgather_bucket_size: int = 2**62,
                 reduce_scatter: bool = True):
        self.stage, self.weight_decay, self.groups = stage, weight_decay, groups
        self.shared, self.overlap, self.precision = shared, overlap, precision
        self.reduce_scatter = reduce_scatter
        self.allgather_bucket_size, self.bucket_size = allgather_bucket_size, bucket_size
        self.params = params
        shard = groups.shard if stage > 0 else None
        self.shard_group = shard
        self.layout = FlatLayout([p.numel() for p in params], bucket_size,
                                 shard.size if shard else 1, shard.rank if shard else 0)
        L = self.layout
        self.param_flat = torch.zeros(L.total, dtype=precision.param_dtype, device=device)
        self.master = (torch.zeros(L.partition_size, dtype=torch.float32, device=device)
                       if precision.mixed else None)
        self.exp_avg = torch.zeros(L.partition_size, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(L.partition_size, dtype=torch.float32, device=device)
        if stage <= 1:
            self.grad_flat = torch.zeros(L.total, dtype=precision.grad_dtype, device=device)
            self.grad_part = None
        else:
            self.grad_flat = None
            self.grad_part = torch.zeros(L.partition_size, dtype=precision.grad_dtype, device=device)
        self._staging: dict[int, torch.Tensor] = {}
        self._bucket_fresh = [True] * len(L.buckets)   # stage 2: partition holds nothing yet
        self._pending = [0] * len(L.buckets)
        self._reduced = [False] * len(L.buckets)
        self._reducing = False
        self._inflight: list[tuple[comm.Handle, object]] = []
        self._norm_ranges = self._counted_ranges(counted)
        self.index_of = {id(p): i for i, p in enumerate(params)}

    # --- views ------------------------------------------------------------------------------
    def _slot_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        slot = self.layout.slots[i]
        return flat[slot.offset:slot.offset + slot.numel].view(self.params[i].shape)

    def param_view(self, i: int) -> torch.Tensor:
        return self._slot_view(self.param_flat, i)

    def grad_view(self, i: int) -> torch.Tensor:
        return self._slot_view(self.grad_flat, i)

    def master_chunk(self, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        if self.master is None:
            lo, hi = bucket.chunk_range(self.layout.rank)
            return self.param_flat[lo:hi]
        return self.master[bucket.local_offset:bucket.local_offset + bucket.chunk]

    def grad_chunk(self, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        if self.grad_part is None:
            lo, hi = bucket.chunk_range(self.layout.rank)
            return self.grad_flat[lo:hi]
        return self.grad_part[bucket.local_offset:bucket.local_offset + bucket.chunk]

    def state_chunk(self, tensor: torch.Tensor, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        return tensor[bucket.local_offset:bucket.local_offset + bucket.chunk]

    # --- construction -----------------------------------------------------------------------
    def materialize(self, init_fn) -> list[nn.Parameter]:
        """Fills the buffers from init_fn(param) (one full fp32 parameter at a time) and returns
        new Parameters that are views of the flat buffer, in the order given."""
        new_params = []
        for i, p in enumerate(self.params):
            value = init_fn(p).reshape(-1)
            slot = self.layout.slots[i]
            self.param_flat[slot.offset:slot.offset + slot.numel].copy_(value)
            piece = self.layout.local_piece(i)
            if self.master is not None and piece is not None:
                part_off, param_off, length = piece
                self.master[part_off:part_off + length].copy_(value[param_off:param_off + length])
            new = nn.Parameter(self.param_view(i), requires_grad=p.requires_grad)
            new.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
            new_params.append(new)
        self.params = new_params
        self.index_of = {id(p): i for i, p in enumerate(new_params)}
        self.zero_grad()
        return new_params

    def _counted_ranges(self, counted: list[bool]) -> list[list[tuple[int, int]]]:
        """Per bucket, the ranges of this rank's chunk whose gradients count in the global norm."""
        ranges: list[list[tuple[int, int]]] = [[] for _ in self.layout.buckets]
        for i, is_counted in enumerate(counted):
            piece = self.layout.local_piece(i)
            if not is_counted or piece is None:
                continue
            bucket = self.layout.buckets[self.layout.slots[i].bucket]
            lo = piece[0] - bucket.local_offset
            runs = ranges[bucket.index]
            if runs and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], lo + piece[2])
            else:
                runs.append((lo, lo + piece[2]))
        return ranges

    # --- backward ---------------------------------------------------------------------------
    def start_backward(self, reduce: bool) -> None:
        """Arms the per-bucket countdown; stage 0/1 reduce only on the last microbatch (until then
        autograd accumulates into the full gradient buffer), stage 2 on every microbatch."""
        self._reducing = reduce if self.stage <= 1 else True
        for b, bucket in enumerate(self.layout.buckets):
            self._pending[b] = len(bucket.slots)
            self._reduced[b] = False

    def on_grad_ready(self, param: nn.Parameter) -> None:
        i = self.index_of[id(param)]
        b = self.layout.slots[i].bucket
        if self.stage == 2:
            self._stage_grad(i, param)
        if not self._reducing:
            return
        self._pending[b] -= 1
        # Stage 2 reduces a full bucket at once even without overlap, so that staging stays bounded.
        if self._pending[b] == 0 and (self.overlap or self.stage == 2):
            self._reduce_bucket(b)

    def _stage_grad(self, i: int, param: nn.Parameter) -> None:
        slot = self.layout.slots[i]
        bucket = self.layout.buckets[slot.bucket]
        if slot.bucket not in self._staging:
            self._staging[slot.bucket] = torch.zeros(bucket.size, dtype=self.precision.grad_dtype,
                                                     device=self.param_flat.device)
        start = slot.offset - bucket.start
        self._staging[slot.bucket][start:start + slot.numel].copy_(param.grad.reshape(-1))
        param.grad = None

    def end_backward(self) -> None:
        """Reduces buckets still waiting. Stage 0/1: every bucket (the buffer holds the whole step's
        gradients). Stage 2: buckets that got some gradients this backward (unused parameters, or a
        pipeline chunk that shares the buffer with chunks this backward did not run)."""
        if not self._reducing:
            return
        for b in range(len(self.layout.buckets)):
            if not self._reduced[b] and (self.stage <= 1 or b in self._staging):
                self._reduce_bucket(b)
        self._reducing = False

    def _reduce_bucket(self, b: int) -> None:
        self._reduced[b] = True
        bucket = self.layout.buckets[b]
        span = slice(bucket.start, bucket.start + bucket.size)
        if self.stage == 0:
            handle = comm.all_reduce(self.grad_flat[span], self.groups.dp, async_op=True)
            self._inflight.append((handle, None))
        elif self.stage == 1:
            lo, hi = bucket.chunk_range(self.layout.rank)
            if self.reduce_scatter:
                handle = comm.reduce_scatter(self.grad_flat[lo:hi], self.grad_flat[span],
                                             self.shard_group, async_op=True)
            else:          # the whole bucket is summed; this rank then reads its own chunk
                handle = comm.all_reduce(self.grad_flat[span], self.shard_group, async_op=True)
            self._inflight.append((handle, None))
        else:
            self.ensure_grads()
            staging = self._staging.pop(b)
            target = self.grad_chunk(b)
            fresh = self._bucket_fresh[b]
            if self.reduce_scatter:
                out = target if fresh else torch.empty_like(target)
                handle = comm.reduce_scatter(out, staging, self.shard_group, async_op=True)
            else:
                handle = comm.all_reduce(staging, self.shard_group, async_op=True)
                out = staging[self.layout.rank * bucket.chunk:(self.layout.rank + 1) * bucket.chunk]
                fresh = False      # the chunk still has to be copied (added) out of the staging buffer
                if self._bucket_fresh[b]:
                    target.zero_()
            done = None if fresh else (lambda t=target, o=out: t.add_(o))
            self._bucket_fresh[b] = False
            self._inflight.append((handle, (done, staging)))
        if not self.overlap:
            self.wait_reductions()
        else:
            self._bound_inflight()

    def _bound_inflight(self) -> None:
        """Stage 2 staging buffers live until their reduction ends: keep at most about one bucket
        size of them in flight (the newest always goes), waiting on the oldest first."""
        def staged():
            return sum(extra[1].numel() for _, extra in self._inflight if extra is not None)
        while len(self._inflight) > 1 and staged() > self.bucket_size:
            self._finish_one(*self._inflight.pop(0))

    @staticmethod
    def _finish_one(handle, extra) -> None:
        handle.wait()
        if extra is not None and extra[0] is not None:
            extra[0]()

    def wait_reductions(self) -> None:
        inflight, self._inflight = self._inflight, []
        for handle, extra in inflight:
            self._finish_one(handle, extra)

    def ensure_grads(self) -> None:
        if self.grad_part is not None:
            ensure_storage(self.grad_part)

    def finish_gradients(self) -> None:
        """After the last microbatch: all reductions done, MiCS replicas and tied stages summed."""
        self.wait_reductions()
        self.ensure_grads()
        for group in (self.groups.replica if self.stage > 0 else None,
                      self.groups.embedding if self.shared else None):
            if group is None or group.size == 1:
                continue
            if self.grad_part is not None:
                comm.all_reduce(self.grad_part, group)
            else:
                for b in range(len(self.layout.buckets)):
                    comm.all_reduce(self.grad_chunk(b), group)

    # --- step -------------------------------------------------------------------------------
    def grad_sumsq(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for b, runs in enumerate(self._norm_ranges):
            chunk = self.grad_chunk(b)
            for lo, hi in runs:
                total += sum_of_squares(chunk[lo:hi])
        return total

    def has_inf_or_nan(self) -> bool:
        return any(not torch.isfinite(self.grad_chunk(b)).all() for b in range(len(self.layout.buckets)))

    def step(self, step: int, lr: float, config: AdamConfig, grad_scale: float) -> None:
        for b in range(len(self.layout.buckets)):
            adam_update(self.master_chunk(b), self.grad_chunk(b), self.state_chunk(self.exp_avg, b),
                        self.state_chunk(self.exp_avg_sq, b), step=step, lr=lr, config=config,
                        weight_decay=self.weight_decay, grad_scale=grad_scale)
        self.gather_params()

    def gather_params(self) -> None:
        """Copies updated master chunks into the parameter buffer and all-gathers every bucket."""
        inflight, in_flight_elems = [], 0
        for b, bucket in enumerate(self.layout.buckets):
            lo, hi = bucket.chunk_range(self.layout.rank)
            if self.master is not None:
                self.param_flat[lo:hi].copy_(self.master_chunk(b))
            if self.shard_group is None:
                continue
            span = self.param_flat[bucket.start:bucket.start + bucket.size]
            inflight.append(comm.all_gather(span, self.param_flat[lo:hi], self.shard_group, async_op=True))
            in_flight_elems += bucket.size
            if in_flight_elems >= self.allgather_bucket_size:
                for h in inflight:
                    h.wait()
                inflight, in_flight_elems = [], 0
        for h in inflight:
            h.wait()

    def zero_grad(self) -> None:
        if self.grad_flat is not None:
            self.grad_flat.zero_()
            for i, p in enumerate(self.params):
                p.grad = self.grad_view(i)
        else:
            drop_storage(self.grad_part)      # stage 2: no gradient memory between steps
            self._bucket_fresh = [True] * len(self.layout.buckets)
            for p in self.params:
                p.grad = None

    # --- inspection (see megazero.zero.inspect) ---------------------------------------------
    def _kind_chunk(self, kind: str, b: int) -> torch.Tensor:
        if kind == "fp32":
            return self.master_chunk(b)
        if kind == "grad":
            return self.grad_chunk(b)
        return self.state_chunk(getattr(self, kind), b)

    def local_view(self, param: nn.Parameter, kind: str) -> torch.Tensor:
        """This rank's piece of `param` (1-D, possibly empty) in tensor `kind`."""
        i = self.index_of[id(param)]
        b = self.layout.slots[i].bucket
        piece = self.layout.local_piece(i)
        chunk = self._kind_chunk(kind, b)
        if piece is None:
            return chunk[:0]
        rel = piece[0] - self.layout.buckets[b].local_offset
        return chunk[rel:rel + piece[2]]

    def gathered(self, param: nn.Parameter, kind: str) -> torch.Tensor:
        """The whole of `param` in tensor `kind`, assembled from every shard (collective)."""
        i = self.index_of[id(param)]
        slot = self.layout.slots[i]
        bucket = self.layout.buckets[slot.bucket]
        chunk = self._kind_chunk(kind, slot.bucket).contiguous()
        if self.shard_group is None:
            whole = chunk
        else:
            whole = chunk.new_empty(bucket.size)
            comm.all_gather(whole, chunk, self.shard_group)
        start = slot.offset - bucket.start
        return whole[start:start + slot.numel].view(param.shape).to(torch.float32, copy=True)

    def write_full(self, param: nn.Parameter, kind: str, value: torch.Tensor) -> None:
        """Stores this rank's piece of a full value (every rank passes the same value)."""
        i = self.index_of[id(param)]
        flat = value.detach().reshape(-1)
        piece = self.layout.local_piece(i)
        if piece is not None:
            self.local_view(param, kind).copy_(flat[piece[1]:piece[1] + piece[2]])
        if kind == "fp32":
            self.param_view(i).copy_(value.reshape(param.shape))

    def refresh_low_precision(self, param: nn.Parameter) -> None:
        """After a local fp32 write: copy this rank's piece into the computing copy (other ranks
        see it after the next step's all-gather)."""
        i = self.index_of[id(param)]
        piece = self.layout.local_piece(i)
        if piece is not None and self.master is not None:
            slot = self.layout.slots[i]
            at = slot.offset + piece[1]
            self.param_flat[at:at + piece[2]].copy_(self.local_view(param, "fp32"))

    # --- accounting -------------------------------------------------------------------------
    def staging_bytes(self) -> int:
        held = list(self._staging.values()) + [extra[1] for _, extra in self._inflight if extra is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def memory_bytes(self) -> dict[str, int]:
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()
        return {
            "params": nbytes(self.param_flat),
            "grads": nbytes(self.grad_flat) + nbytes(self.grad_part),
            "master": nbytes(self.master),
            "optimizer_states": nbytes(self.exp_avg) + nbytes(self.exp_avg_sq),
        }
