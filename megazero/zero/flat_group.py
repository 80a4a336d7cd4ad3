"""One flat buffer of parameters under ZeRO stage 0, 1 or 2 (also stage 3's persistent parameters).

A `PartitionedStorage` whose weights are always full on every rank: the parameters the model sees
are views of one flat buffer cut into size-bounded buckets. Gradients:

  stage 0  full gradient buffer, all-reduced over DP (each rank keeps and updates everything)
  stage 1  full gradient buffer, each bucket reduce-scattered; the step updates own chunks
  stage 2  only this rank's gradient partition; gradients are copied into a staging bucket as
           autograd produces them and the bucket is reduced when full, then freed

The full gradient buffer (stage 0/1) and the partition (stage 2) are in the gradient accumulation
dtype (fp32 unless configured otherwise). When that is the weights' dtype, autograd accumulates
straight into the buffer (each parameter's .grad is a view of it); otherwise a hook adds each
microbatch's 16-bit gradient into it. After the step, updated chunks are all-gathered.
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.core import comm
from megazero.core.streams import label
from .flat import FlatLayout
from .precision import Precision, take_grad
from .storage import PartitionedStorage, ReductionQueue
from .tensor_memory import drop_storage, ensure_storage
from megazero.models.param_info import carry_param_info


class FlatParamGroup(PartitionedStorage):
    weights_always_full = True

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        stage: int,
        dp: comm.Group,
        shard: comm.Group | None,
        replica: comm.Group | None,
        precision: Precision,
        bucket_size: int,
        device,
        queue: ReductionQueue,
        allgather_bucket_size: int = 2**62,
        reduce_scatter: bool = True,
        streams=None,
        state_device=None,
        param_align: int = 1,
    ):
        layout = FlatLayout(
            [p.numel() for p in params],
            bucket_size,
            shard.size if shard else 1,
            shard.rank if shard else 0,
            param_align=param_align,
        )
        super().__init__(
            layout, shard, precision, device, queue, reduce_scatter, streams=streams, state_device=state_device
        )
        self.stage, self.dp, self.replica = stage, dp, replica
        self.allgather_bucket_size = allgather_bucket_size
        self.params = params
        self.index_of = {id(p): i for i, p in enumerate(params)}
        L = layout
        self.param_flat = label(
            torch.zeros(L.total, dtype=precision.param_dtype, device=self.device), f"stage-{stage} flat parameters"
        )
        accum = precision.grad_accum_dtype
        if stage <= 1:
            self.grad_flat = label(
                torch.zeros(L.total, dtype=accum, device=self.device), f"stage-{stage} flat gradients"
            )
            self.grad_part = None
        else:
            self.grad_flat = None
            self.grad_part = label(
                torch.zeros(L.partition_size, dtype=accum, device=self.device), f"stage-{stage} gradient partition"
            )
        # Autograd can accumulate into the buffer directly only when the dtypes agree.
        self.grads_are_views = stage <= 1 and accum == precision.param_dtype
        self._staging: dict[int, torch.Tensor] = {}
        self._pending = [0] * len(L.buckets)
        self._reduced = [False] * len(L.buckets)
        self._reducing = False
        self.sequencer = None  # an InOrderReductions (in_order.py): buckets reduced in its order

    # --- where things live --------------------------------------------------------------------
    def _slot_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        slot = self.layout.slots[i]
        return flat[slot.offset : slot.offset + slot.numel].view(self.params[i].shape)

    def param_view(self, i: int) -> torch.Tensor:
        return self._slot_view(self.param_flat, i)

    def grad_view(self, i: int) -> torch.Tensor:
        return self._slot_view(self.grad_flat, i)

    def _chunk_range(self, b: int) -> slice:
        lo, hi = self.layout.buckets[b].chunk_range(self.layout.rank)
        return slice(lo, hi)

    def param_chunk(self, b: int) -> torch.Tensor:
        return self.param_flat[self._chunk_range(b)]

    def grad_chunk(self, b: int) -> torch.Tensor:
        if self.grad_part is None:
            return self.grad_flat[self._chunk_range(b)]
        return self._part(self.grad_part, b)

    def _bucket_span(self, flat: torch.Tensor, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        return flat[bucket.start : bucket.start + bucket.size]

    # --- construction -------------------------------------------------------------------------
    def materialize(self, init_fn) -> list[nn.Parameter]:
        """Fills the buffers from init_fn(param) (one full fp32 parameter at a time) and returns
        new Parameters that are views of the flat buffer, in the order given."""
        new_params = []
        for i, p in enumerate(self.params):
            value = init_fn(p).reshape(-1)
            self.param_view(i).view(-1).copy_(value)
            self._write_initial_piece(i, value)
            new = nn.Parameter(self.param_view(i), requires_grad=p.requires_grad)
            carry_param_info(p, new)
            new_params.append(new)
        self.params = new_params
        self.index_of = {id(p): i for i, p in enumerate(new_params)}
        self.zero_grad()
        return new_params

    def write_full_weights(self, i: int, flat: torch.Tensor) -> None:
        self.param_view(i).view(-1).copy_(flat)

    def wrote_weights(self, i: int, flat: torch.Tensor) -> None:
        self.param_view(i).view(-1).copy_(flat)

    # --- backward -----------------------------------------------------------------------------
    def start_backward(self, reduce: bool) -> None:
        """Arms the per-bucket countdown; stage 0/1 reduce only on the last microbatch (until then
        gradients accumulate in the full buffer), stage 2 on every microbatch."""
        self._reducing = reduce if self.stage <= 1 else True
        for b, bucket in enumerate(self.layout.buckets):
            self._pending[b] = len(bucket.slots)
            self._reduced[b] = False

    def on_grad_ready(self, param: nn.Parameter) -> None:
        i = self.index_of[id(param)]
        b = self.layout.slots[i].bucket
        if self.stage == 2:
            self._stage_grad(i, param)
        elif not self.grads_are_views:
            self.grad_view(i).add_(take_grad(param))
        if not self._reducing:
            return
        self._pending[b] -= 1
        # Stage 2 reduces a full bucket at once even without overlap, so that staging stays bounded.
        if self._pending[b] == 0 and (self.queue.overlap or self.stage == 2):
            if self.sequencer is not None:
                self.sequencer.ready(self, b)
            else:
                self._reduce(b)

    def _stage_grad(self, i: int, param: nn.Parameter) -> None:
        b = self.layout.slots[i].bucket
        if b not in self._staging:
            self._staging[b] = self.new_staging(b)
        start = self.layout.slots[i].offset - self.layout.buckets[b].start
        self._staging[b][start : start + param.numel()].copy_(take_grad(param).reshape(-1))

    def end_backward(self) -> None:
        """Reduces buckets still waiting. Stage 0/1: every bucket (the buffer holds the whole step's
        gradients). Stage 2: buckets that got some gradients this backward (unused parameters, or a
        pipeline chunk that shares the buffer with chunks this backward did not run)."""
        if not self._reducing or self.sequencer is not None:  # the sequencer's flush ends it
            return
        for b in range(len(self.layout.buckets)):
            if not self._reduced[b] and (self.stage <= 1 or b in self._staging):
                self._reduce(b)
        self._reducing = False

    def reduce_in_turn(self, b: int) -> None:
        """The sequencer's call: reduces bucket b (zeros where no gradient came: at the backward's
        end every rank reduces every bucket)."""
        if not self._reducing or self._reduced[b]:
            return
        if self.stage == 2 and b not in self._staging:
            self._staging[b] = self.new_staging(b)
        self._reduce(b)

    def end_in_order(self) -> None:
        self._reducing = False

    def _reduce(self, b: int) -> None:
        self._reduced[b] = True
        if self.stage == 2:
            self.ensure_grads()
            self.reduce_bucket(b, self._staging.pop(b))
            return
        # Stage 0/1: the full buffer holds the step's gradients; reduce the bucket where it lies
        # (in the reduce dtype: through a temporary when that differs from the buffer's, made on
        # the compute stream, which reads the result when the handle is waited).
        span = self._bucket_span(self.grad_flat, b)
        chunk = self.grad_chunk(b)
        wire = (
            span
            if span.dtype == self.precision.reduce_dtype
            else label(span.to(self.precision.reduce_dtype), f"bucket {b}: gradients in the reduce dtype")
        )
        lo = self.layout.rank * self.layout.buckets[b].chunk
        if self.stage == 0:
            result, target = wire, span
        elif self.reduce_scatter:
            result = (
                chunk
                if wire is span
                else label(torch.empty_like(chunk, dtype=wire.dtype), f"bucket {b}: reduce-scatter output")
            )
            target = chunk
        else:  # the whole bucket is summed; this rank then reads its own chunk
            result, target = wire[lo : lo + chunk.numel()], chunk
        with self.reduce_stream():
            if self.stage == 0:
                handle = comm.all_reduce(wire, self.dp, async_op=True)
            elif self.reduce_scatter:
                handle = comm.reduce_scatter(result, wire, self.shard, async_op=True)
            else:
                handle = comm.all_reduce(wire, self.shard, async_op=True)
        same = result.data_ptr() == target.data_ptr() and result.dtype == target.dtype
        then = None if same else (lambda: target.copy_(result))
        self.queue.push(comm.Handle([handle], then), None if wire is span else wire)

    def ensure_grads(self) -> None:
        if self.grad_part is not None:
            ensure_storage(self.grad_part)

    def finish_gradients(self) -> None:
        """After the last microbatch and the queue's wait: MiCS replicas summed."""
        self.ensure_grads()
        if self.stage == 0 or self.replica is None or self.replica.size == 1:
            return
        if self.grad_part is not None:
            comm.all_reduce(self.grad_part, self.replica)
        else:
            for b in range(len(self.layout.buckets)):
                comm.all_reduce(self.grad_chunk(b), self.replica)

    # --- step ---------------------------------------------------------------------------------
    def after_step(self) -> None:
        self.gather_params()

    def gather_params(self) -> None:
        """All-gathers every bucket's updated chunks (the step wrote them) into the full buffer."""
        inflight, in_flight_elems = [], 0
        for b, bucket in enumerate(self.layout.buckets):
            if self.shard is None:
                continue
            span = self._bucket_span(self.param_flat, b)
            inflight.append(comm.all_gather(span, self.param_chunk(b), self.shard, async_op=True))
            in_flight_elems += bucket.size
            if in_flight_elems >= self.allgather_bucket_size:
                for h in inflight:
                    h.wait()
                inflight, in_flight_elems = [], 0
        for h in inflight:
            h.wait()

    def zero_grad(self) -> None:
        super().zero_grad()
        if self.grad_flat is not None:
            self.grad_flat.zero_()
            for i, p in enumerate(self.params):
                p.grad = self.grad_view(i) if self.grads_are_views else None
        else:
            drop_storage(self.grad_part)  # stage 2: no gradient memory between steps
            for p in self.params:
                p.grad = None

    # --- accounting ---------------------------------------------------------------------------
    def staging_bytes(self) -> int:
        return sum(self.nbytes(t) for t in self._staging.values())

    def memory_bytes(self) -> dict[str, int]:
        return {
            "params": self.nbytes(self.param_flat),
            "grads": self.nbytes(self.grad_flat) + self.nbytes(self.grad_part),
            **super().memory_bytes(),
        }
