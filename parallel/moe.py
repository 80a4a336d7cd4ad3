"""Expert (and tensor) parallelism for the pure MoE layer (models/moe.py), applied from outside.

Expert parallelism: each rank of an EP group (parallel/topology.py: ep consecutive ranks of the
dp x cp group) keeps E/ep of every MoE layer's experts; a dispatcher sends each row (a token's
choice, sorted by expert) to the rank holding its expert and brings the outputs back in the same
rows, so the combine (each token's k outputs summed in order, weighted) is the one process's:
- alltoall: the row counts are exchanged, then the rows go by one uneven all-to-all each way;
- allgather: every EP rank gathers all ranks' rows (padded to the longest), computes its experts'
  rows and a reduce-scatter hands each rank back its own (the others' contributions are zeros).
The router, the shared expert and everything outside the MoE layer stay replicated over EP:
they are data parallel. Expert weights are marked (`expert_parallel`), so ZeRO reduces and shards
them over the expert-data-parallel group.

Tensor parallelism (the experts' tensor-parallel size is tp): each expert's weights split as the
dense MLP's (weight1's columns, [gate | up] blocks each split; weight2's rows), the router stays
replicated. Without sequence parallelism every TP rank routes the same tokens; the expert path's
input and probabilities enter through copy_to_tp (their gradients are partial per rank) and the
partial outputs are summed. With sequence parallelism a rank routes its sequence shard (the
router's gradient is then partial: marked sequence_parallel), the tokens and routing are gathered
over TP, and the outputs reduce-scattered back to the shards.

Whole experts (expert tensor-parallel size 1 under tp > 1, Megatron's etp 1): no expert weight is
split over TP and the EP group is cut from all tp x cp x dp ranks of a stage (parallel/topology.py),
so TP ranks hold different experts. Each TP rank sends its own tokens and none twice: under
sequence parallelism its sequence shard as routed (the output is then already in the shard
layout); without it, the TP ranks hold the same tokens, so each takes its 1/tp of the sequence
after the (replicated) routing (scatter: the backward gathers the full gradient of the input and
the probabilities, so the router's gradient stays whole on every rank) and the outputs are
all-gathered back to the replicated layout (whose backward keeps the rank's slice).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megazero.core import comm, host_read
from megazero.core.comm import Group
from megazero.models.moe import AuxLossScaler, GroupedExperts, MoELayer
from megazero.models.param_info import set_param_info
from .layers import TPShard
from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
)


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """This rank's experts [ep_rank x E/ep, ...) along dim 0, cut by `tp` along another dim (a
    TPShard of the whole (E, ., .) weight, or None)."""

    ep_rank: int
    ep: int
    tp: TPShard | None = None

    def local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        mine = full.chunk(self.ep, dim=0)[self.ep_rank]
        return self.tp.local_from_full(mine) if self.tp is not None else mine

    def full_shape(self, local_shape) -> tuple[int, ...]:
        shape = list(self.tp.full_shape(local_shape) if self.tp is not None else local_shape)
        shape[0] *= self.ep
        return tuple(shape)


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks by `send` counts, back by `recv` counts in the backward."""

    @staticmethod
    def forward(ctx, rows, group: Group, send: list[int], recv: list[int]):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        out = rows.new_empty((sum(recv), rows.shape[1]))
        comm.all_to_all_uneven(out, rows.contiguous(), recv, send, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), grad.shape[1]))
        comm.all_to_all_uneven(back, grad.contiguous(), ctx.send, ctx.recv, ctx.group)
        return back, None, None, None


def even_split(rows: int, parts: int) -> list[int]:
    """`rows` spread over `parts` as evenly as they go (the first ones one more): the balanced
    routing the host reads of expert counts answer with where the device's counts have no values
    (the dry run's meta tensors; host_read), so that every shape downstream is known."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


class _ReadsKept:
    """The dispatchers' read of the rows a capacity keeps (models.moe.MoELayer.route, without
    padding to the capacity: the rows' number follows the routing) through host_read; a meta tensor
    reads the count under balanced routing, each expert capped at its capacity."""

    def rows_kept(self, count: torch.Tensor, healthy: int) -> int:
        return host_read.read(count, "expert rows kept", healthy=healthy)


class HostCountsDispatcher(_ReadsKept):
    """Every expert on this device (as models.moe.LocalDispatcher), the per-expert row counts read
    on the host through host_read, where the loop over experts needs them."""

    def __call__(self, experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        sizes = host_read.read(counts, "expert rows", healthy=lambda: even_split(rows.shape[0], len(counts)))
        return experts(rows, counts, sizes)


class AllToAllDispatcher(_ReadsKept):
    """Rows sorted by (global) expert go to the EP rank holding it and come back in place."""

    def __init__(self, group: Group, num_experts: int):
        self.group, self.num_experts = group, num_experts

    def __call__(self, experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.group.size, self.num_experts // self.group.size
        # recv[s, e]: rows source s sends for local expert e (a copy: the exchange needs a device tensor)
        recv = torch.empty_like(counts)
        comm.all_to_all(recv, counts.contiguous(), self.group)
        recv_counts = recv.view(ep, local)
        # Both tables on the host (one read each). Balanced (meta): every rank routes its rows
        # evenly over all experts, so source s sends my local expert e what I send expert e's peer.
        mine = host_read.read(counts, "expert rows sent", healthy=lambda: even_split(rows.shape[0], len(counts)))
        lo = self.group.rank * local
        table = host_read.read(
            recv_counts,
            "expert rows received",
            healthy=lambda: [even_split(rows.shape[0], self.num_experts)[lo : lo + local]] * ep,
        )
        send_host = [sum(mine[j * local : (j + 1) * local]) for j in range(ep)]
        recv_host = [sum(row) for row in table]
        received = _AllToAll.apply(rows, self.group, send_host, recv_host)
        # received: by source, then by local expert; the experts want them by local expert
        order = _by_expert(table, rows.device)
        out = experts(received[order], recv_counts.sum(0), [sum(col) for col in zip(*table)])
        back = torch.empty_like(out).index_copy(0, order, out) if out.shape[0] else out
        return _AllToAll.apply(back, self.group, recv_host, send_host)


def _by_expert(table: list[list[int]], device) -> torch.Tensor:
    """Row order grouping (source, expert)-major rows by expert: `table` [source][expert] counts."""
    flat = [n for row in table for n in row]
    starts = [sum(flat[:i]) for i in range(len(flat))]
    experts = len(table[0]) if table else 0
    pieces = [
        torch.arange(table[s][e], device=device) + starts[s * experts + e]
        for e in range(experts)
        for s in range(len(table))
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


class AllGatherDispatcher(_ReadsKept):
    """Every EP rank gathers every rank's rows, computes its experts' rows, and a reduce-scatter
    returns each rank's rows (summed with the other ranks' zeros there)."""

    def __init__(self, group: Group, num_experts: int):
        self.group, self.num_experts = group, num_experts

    def __call__(self, experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.group.size, self.num_experts // self.group.size
        every = counts.new_empty((ep, counts.numel()))
        comm.all_gather(every, counts.contiguous(), self.group)
        # on the host (one read); balanced (meta): every rank's rows spread evenly over the experts
        table = host_read.read(
            every, "expert rows of every rank", healthy=lambda: [even_split(rows.shape[0], self.num_experts)] * ep
        )
        longest = max(sum(row) for row in table)
        padded = torch.cat([rows, rows.new_zeros(longest - rows.shape[0], rows.shape[1])])
        gathered = gather_from_sequence_region(padded.unsqueeze(0), self.group).squeeze(0)
        # rows of my experts: from each source, its block for experts [ep_rank x local, ...)
        lo = self.group.rank * local
        pick = torch.cat(
            [
                torch.arange(table[s][lo + e], device=rows.device) + s * longest + sum(table[s][: lo + e])
                for e in range(local)
                for s in range(ep)
            ]
            or [counts.new_zeros(0)]
        )
        mine = every[:, lo : lo + local]
        out = experts(gathered[pick], mine.sum(0), [sum(table[s][lo + e] for s in range(ep)) for e in range(local)])
        full = out.new_zeros(gathered.shape[0], out.shape[1]).index_copy(0, pick, out)
        return reduce_scatter_to_sequence_region(full.unsqueeze(0), self.group).squeeze(0)[: rows.shape[0]]


class _SumStats(torch.autograd.Function):
    """Sums routing statistics over the ranks holding other tokens of the same sequences; the
    backward is the identity: every rank computes the same loss from the sums and backpropagates
    it into its own tokens only."""

    @staticmethod
    def forward(ctx, t, groups: tuple[Group, ...]):
        t = t.contiguous().clone()
        for group in groups:
            comm.all_reduce(t, group)
        return t

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ParallelMoELayer(MoELayer):
    """The MoE layer over tensor- and expert-parallel ranks; parameters keep their names."""

    def __init__(
        self,
        moe: MoELayer,
        tp: Group,
        sequence_parallel: bool,
        stats_groups: tuple[Group, ...],
        whole_experts: bool = False,
    ):
        nn.Module.__init__(self)
        for name in (
            "num_experts",
            "topk",
            "capacity_factor",
            "drop_policy",
            "pad_to_capacity",
            "aux_loss_weight",
            "stats",
            "dispatcher",
        ):
            setattr(self, name, getattr(moe, name))
        self.router, self.experts, self.shared_experts = moe.router, moe.experts, moe.shared_experts
        self.tp, self.sp = tp, sequence_parallel and tp.size > 1
        self.whole_experts = whole_experts and tp.size > 1
        stats_groups = tuple(g for g in stats_groups if g.size > 1)
        self.reduce_stats = (lambda t: _SumStats.apply(t, stats_groups)) if stats_groups else moe.reduce_stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h = x.shape[0], x.shape[-1]
        probs, indices, loss = self.router(x.reshape(-1, h), b, self.reduce_stats, self.stats)
        if loss.requires_grad:
            probs = AuxLossScaler.apply(probs, loss, self.aux_loss_weight)
        if self.whole_experts:
            y = self.route_own_tokens(x, probs, indices)
        else:
            y = self.route_tp_split(x, probs, indices)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def route_own_tokens(self, x, probs, indices):
        """Whole experts: this TP rank's own tokens (see the module docstring)."""
        b, h, k = x.shape[0], x.shape[-1], self.topk
        if self.sp:
            return self.route(x.reshape(-1, h), probs, indices, b).view_as(x)
        mine = scatter_to_sequence_region(x, self.tp)
        probs = scatter_to_sequence_region(probs.view(b, -1, k), self.tp)
        indices = indices.view(b, -1, k).chunk(self.tp.size, dim=1)[self.tp.rank]
        y = self.route(mine.reshape(-1, h), probs.reshape(-1, k), indices.reshape(-1, k), b).view_as(mine)
        return gather_from_tp_region(y, self.tp, dim=1)

    def route_tp_split(self, x, probs, indices):
        """Experts split over TP: every TP rank computes its part of every token's expert output."""
        b, h, k = x.shape[0], x.shape[-1], self.topk
        if self.sp:
            full = gather_from_sequence_region(x, self.tp)
            probs = gather_from_sequence_region(probs.view(b, -1, k), self.tp)
            with torch.no_grad():
                indices = gather_from_sequence_region(indices.view(b, -1, k), self.tp)
        elif self.tp.size > 1:
            full, probs = copy_to_tp_region(x, self.tp), copy_to_tp_region(probs, self.tp)
        else:
            full = x
        y = self.route(full.reshape(-1, h), probs.reshape(-1, k), indices.reshape(-1, k), b).view_as(full)
        if self.sp:
            y = reduce_scatter_to_sequence_region(y, self.tp)
        elif self.tp.size > 1:
            y = reduce_from_tp_region(y, self.tp)
        return y


def parallelize_moe(
    moe: MoELayer,
    *,
    tp: Group,
    ep: Group,
    cp: Group,
    sequence_parallel: bool,
    dispatcher: str = "alltoall",
    whole_experts: bool = False,
) -> ParallelMoELayer:
    """`moe` (on the meta device) over `tp` and `ep`: local experts allocated (still meta), the
    dispatcher chosen, the routing statistics summed over the ranks holding other tokens of the
    same sequences (cp, and tp under sequence parallelism). `whole_experts`: the expert
    tensor-parallel size is 1 (the experts are not split over tp; `ep` spans tp ranks)."""
    old, e = moe.experts, moe.num_experts
    h, f = old.weight2.shape[2], old.weight2.shape[1]
    split = tp.size > 1 and not whole_experts
    etp = tp.size if split else 1
    if e % ep.size or f % etp:
        raise ValueError(f"{e} experts of width {f} do not split over ep {ep.size} x etp {etp}")
    w = old.weight1
    experts = GroupedExperts(
        e // ep.size,
        h,
        f // etp,
        swiglu=old.swiglu,
        gelu_approximate=old.gelu_approximate,
        grouped=old.grouped,
        device=w.device,
        dtype=w.dtype,
    )
    for weight, tp_shard in (
        (experts.weight1, TPShard(2, tp.rank, tp.size, 2 if old.swiglu else 1)),
        (experts.weight2, TPShard(1, tp.rank, tp.size)),
    ):
        # one expert-parallel rank: the plain TPShard, which the checkpoint tools read
        shard = (
            ExpertShard(ep.rank, ep.size, tp_shard if split else None) if ep.size > 1 else (tp_shard if split else None)
        )
        set_param_info(weight, tp_shard=shard, tensor_parallel=split, expert_parallel=True)
    moe.experts = experts
    if ep.size > 1:
        moe.dispatcher = (AllGatherDispatcher if dispatcher == "allgather" else AllToAllDispatcher)(ep, e)
    else:
        moe.dispatcher = HostCountsDispatcher()
    sp = sequence_parallel and tp.size > 1
    layer = ParallelMoELayer(moe, tp, sp, (tp, cp) if sp else (cp,), whole_experts=whole_experts)
    if layer.sp:
        set_param_info(layer.router.weight, sequence_parallel=True)
    return layer


def apply_expert_parallel(
    model,
    *,
    tp: Group,
    ep: Group,
    cp: Group,
    sequence_parallel: bool,
    dispatcher: str = "alltoall",
    whole_experts: bool = False,
):
    """Every MoE layer of `model` (a GPT, after the tensor-parallel swap) made a ParallelMoELayer."""
    for layer in model.layers.values():
        if isinstance(layer.mlp, MoELayer) and not isinstance(layer.mlp, ParallelMoELayer):
            layer.mlp = parallelize_moe(
                layer.mlp,
                tp=tp,
                ep=ep,
                cp=cp,
                sequence_parallel=sequence_parallel,
                dispatcher=dispatcher,
                whole_experts=whole_experts,
            )
    return model
