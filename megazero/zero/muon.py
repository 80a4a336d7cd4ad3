"""Muon under ZeRO 0-3 and tensor parallelism: each weight matrix orthogonalised whole, on one owner.

Newton-Schulz needs a matrix whole, while ZeRO keeps each rank's partition of a flat layout (a matrix
may be cut between shard ranks anywhere) and tensor parallelism splits it between TP ranks. The step,
once per optimizer step (never per microbatch), after the gradients are reduced and clipped:

1. momentum: each rank advances the momentum of its own pieces (elementwise, where the optimizer
   states live: the slot of Adam's first moment holds Muon's momentum, so offload, checkpoints and
   resharding carry it as they carry Adam's) and forms U (the momentum, or Nesterov's look-ahead).
2. gather: every matrix has one owner, a shard rank d and, when tensor parallelism splits it, a TP
   rank t, chosen so the owners' Newton-Schulz work is balanced (largest first onto the least loaded;
   every rank computes the same answer from the shapes). One all-to-all over the shard group sends
   each rank's pieces to their d, where the TP rank's tensor is then whole; a second all-to-all over
   the TP group sends those tensors to t, which joins them into the full matrix.
3. orthogonalise at the owner (per Q/K/V block with split QKV, per expert for grouped experts), times
   the shape's scale (megazero.ops.muon); on the host when the optimizer states are offloaded.
4. scatter: the two all-to-alls backwards; each rank gets the update of its own pieces.
5. apply: W <- W (1 - lr wd) - lr O on this rank's pieces (the fp32 master; the 16-bit copy follows).

Communication per rank and step, in fp32 elements, for Muon matrices of P elements per TP rank over a
shard group of n and a TP group of t: the shard all-to-alls send a rank's pieces of the matrices
others own and, back, the pieces of its own matrices that others hold, 2 P (n - 1) / n^2 when the
owners are balanced; the TP all-to-alls send 2 P (t - 1) / (t n). docs/zero.md has the exact count,
which tests/zero/test_muon_distributed.py checks against the comm log.

A matrix is described from outside (megazero.training.muon_matrices) as a `MuonMatrix`; this module knows no
TP layer, only how to join the TP ranks' tensors and split the full one again.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch

from megazero.core import comm
from megazero.ops.adam import lr_of
from megazero.ops.muon import apply_update, momentum_update, orthogonalized_tensor
from megazero.ops.muon_config import MuonConfig


@dataclasses.dataclass(frozen=True)
class MuonMatrix:
    """A parameter Muon steps. `full_shape`: its tensor-parallel-complete shape; `join(locals)` (the
    TP ranks' tensors in rank order -> the full tensor) and `split(full)` (-> every TP rank's tensor),
    None when tensor parallelism does not split it; `row_blocks`: split QKV's rows per query group;
    `batched`: dim 0 indexes matrices (grouped experts); `transposed`: stored (in, out)."""

    full_shape: tuple[int, ...]
    join: Callable | None = None
    split: Callable | None = None
    row_blocks: tuple[int, ...] = ()
    batched: bool = False
    transposed: bool = False


def ns_cost(matrix: MuonMatrix) -> int:
    """A Newton-Schulz's work up to a constant: m^2 k for each m x k matrix (m <= k) it orthogonalises."""
    shape = matrix.full_shape[1:] if matrix.batched else matrix.full_shape
    count = matrix.full_shape[0] if matrix.batched else 1
    rows, cols = shape
    total = sum(matrix.row_blocks) or rows
    blocks = [rows * b // total for b in matrix.row_blocks] or [rows]
    return count * sum(min(r, cols) ** 2 * max(r, cols) for r in blocks)


def assign_owners(costs: list[int], split: list[bool], shards: int, tp: int) -> list[tuple[int, int | None]]:
    """(shard rank, TP rank or None) owning each matrix: largest first, each onto the least loaded
    owner; a matrix tensor parallelism does not split is orthogonalised by its shard owner on every
    TP rank (each holds a copy), so it loads the whole row of TP ranks. Pure: every rank agrees."""
    load = [[0] * tp for _ in range(shards)]
    owners: list[tuple[int, int | None]] = [(0, None)] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        if split[i]:
            d, t = min(((d, t) for d in range(shards) for t in range(tp)), key=lambda dt: (load[dt[0]][dt[1]], dt))
            load[d][t] += costs[i]
            owners[i] = (d, t)
        else:
            d = min(range(shards), key=lambda d: (max(load[d]), d))
            load[d] = [x + costs[i] for x in load[d]]
            owners[i] = (d, None)
    return owners


def piece_lengths(layout, i: int, shards: int) -> tuple[int, ...]:
    """Elements of parameter i in each shard rank's partition; in rank order they make its flat value."""
    slot = layout.slots[i]
    bucket = layout.buckets[slot.bucket]
    out = []
    for r in range(shards):
        lo, hi = bucket.chunk_range(r)
        out.append(max(0, min(hi, slot.offset + slot.numel) - max(lo, slot.offset)))
    return tuple(out)


class _Entry(NamedTuple):
    index: int  # the parameter's index in its storage
    matrix: MuonMatrix
    local_shape: tuple  # this TP rank's tensor
    lengths: tuple  # elements in each shard rank's partition
    owner: int  # the shard rank that gathers it
    owner_tp: int | None  # the TP rank that orthogonalises it; None: each TP rank its own copy

    def piece_start(self, r: int) -> int:
        return sum(self.lengths[:r])


def exchange(
    group: comm.Group | None, sends: list[list[torch.Tensor]], sizes: list[list[int]], device
) -> list[list[torch.Tensor]]:
    """One all-to-all: `sends[j]`, flat fp32 tensors, go to group rank j; `sizes[j]`, the sizes of
    what rank j sends here, in its order. Returns what came, per rank, in order (views of one buffer)."""
    sent = [t for block in sends for t in block]
    send = torch.cat(sent) if sent else torch.empty(0, dtype=torch.float32, device=device)
    recv = torch.empty(sum(map(sum, sizes)), dtype=torch.float32, device=device)
    if group is None:
        recv.copy_(send)
    else:
        comm.all_to_all_uneven(recv, send, [sum(s) for s in sizes], [sum(t.numel() for t in b) for b in sends], group)
    out, at = [], 0
    for block in sizes:
        out.append([recv[at + sum(block[:k]) : at + sum(block[: k + 1])] for k in range(len(block))])
        at += sum(block)
    return out


class StorageMuon:
    """The Muon matrices of one storage and their step (see the module docstring)."""

    def __init__(
        self,
        storage,
        entries: list[_Entry],
        tensor: comm.Group | None,
        config: MuonConfig,
        ns_device,
        weight_decay_of,
        lr_group_of,
    ):
        self.storage, self.entries, self.tensor, self.config = storage, entries, tensor, config
        self.ns_device = torch.device(ns_device)
        self.me = storage.layout.rank
        self.shards = storage.shard.size if storage.shard is not None else 1
        self.tp_rank = tensor.rank if tensor is not None else 0
        self.by_owner = [[e for e in entries if e.owner == d] for d in range(self.shards)]
        self.mine = self.by_owner[self.me]
        params = storage.params
        self.weight_decay = [weight_decay_of(params[e.index], storage.full_shape(e.index)) for e in entries]
        self.lr_group = [lr_group_of(params[e.index]) for e in entries]

    @classmethod
    def plan(
        cls, storage, matrix_of, tensor: comm.Group | None, config: MuonConfig, ns_device, weight_decay_of, lr_group_of
    ) -> "StorageMuon | None":
        shards = storage.shard.size if storage.shard is not None else 1
        tp = tensor.size if tensor is not None else 1
        found = []
        for i, param in enumerate(storage.params):
            # The storage's record of the shape, not param.shape: a stage-3 parameter between
            # gathers is an empty placeholder (the trap that turned DeepSpeed's Muon off).
            matrix = matrix_of(param, tuple(storage.full_shape(i)))
            if matrix is not None:
                found.append((i, matrix))
        if not found:
            return None
        split = [m.join is not None and tp > 1 for _, m in found]
        owners = assign_owners([ns_cost(m) for _, m in found], split, shards, tp)
        entries = [
            _Entry(i, m, tuple(storage.full_shape(i)), piece_lengths(storage.layout, i, shards), d, t if s else None)
            for (i, m), (d, t), s in zip(found, owners, split)
        ]
        return cls(storage, entries, tensor if tp > 1 else None, config, ns_device, weight_decay_of, lr_group_of)

    def _param(self, e: _Entry):
        return self.storage.params[e.index]

    def step(self, lr, coef: float) -> None:
        device = self.storage.device
        shard = self.storage.shard if self.shards > 1 else None
        ups = self._momentum(coef)
        # 2. each rank's pieces to their shard owner: this rank's TP tensor of the matrices it owns
        got = exchange(
            shard,
            [[ups[e] for e in owned] for owned in self.by_owner],
            [[e.lengths[r] for e in self.mine] for r in range(self.shards)],
            device,
        )
        whole = {e: torch.cat([got[r][k] for r in range(self.shards)]) for k, e in enumerate(self.mine)}
        full = self._join_over_tp(whole, device)
        # 3. orthogonalise what this rank owns
        updates = {
            e: orthogonalized_tensor(
                u.to(self.ns_device),
                self.config,
                row_blocks=e.matrix.row_blocks,
                batched=e.matrix.batched,
                transposed=e.matrix.transposed,
            ).to(device)
            for e, u in full.items()
        }
        local = self._split_over_tp(updates, device)
        # 4. back to the shard ranks holding the pieces
        back = exchange(
            shard,
            [
                [local[e].reshape(-1)[e.piece_start(r) : e.piece_start(r) + e.lengths[r]] for e in self.mine]
                for r in range(self.shards)
            ],
            [[e.lengths[self.me] for e in owned] for owned in self.by_owner],
            device,
        )
        pieces = {e: t for owned, block in zip(self.by_owner, back) for e, t in zip(owned, block)}
        self._apply(pieces, lr)

    def _momentum(self, coef: float) -> dict[_Entry, torch.Tensor]:
        """1. This rank's pieces: momentum advanced in place, U returned on the comm device."""
        out = {}
        for e in self.entries:
            if not e.lengths[self.me]:
                out[e] = torch.empty(0, dtype=torch.float32, device=self.storage.device)
                continue
            param = self._param(e)
            momentum = self.storage.local_view(param, "exp_avg")
            grad = self.storage.local_view(param, "grad").to(momentum.device, torch.float32, copy=True)
            if coef != 1.0:
                grad.mul_(coef)
            out[e] = momentum_update(momentum, grad, self.config).to(self.storage.device, copy=True)
        return out

    def _join_over_tp(self, whole: dict, device) -> dict[_Entry, torch.Tensor]:
        """The matrices this rank orthogonalises, full: its own TP tensor where TP does not split
        them; the TP ranks' tensors joined where it does (sent over the TP group to their owner)."""
        full = {e: u.view(e.local_shape) for e, u in whole.items() if e.owner_tp is None}
        split = [e for e in self.mine if e.owner_tp is not None]
        if not split:
            return full
        size = self.tensor.size
        got = exchange(
            self.tensor,
            [[whole[e] for e in split if e.owner_tp == t] for t in range(size)],
            [[_numel(e.local_shape) for e in split if e.owner_tp == self.tp_rank]] * size,
            device,
        )
        for k, e in enumerate(e for e in split if e.owner_tp == self.tp_rank):
            full[e] = e.matrix.join([got[t][k].view(e.local_shape) for t in range(size)])
        return full

    def _split_over_tp(self, updates: dict, device) -> dict[_Entry, torch.Tensor]:
        """The update of every matrix this rank gathered, as its TP tensor (the reverse of the join)."""
        local = {e: o for e, o in updates.items() if e.owner_tp is None}
        split = [e for e in self.mine if e.owner_tp is not None]
        if not split:
            return local
        size = self.tensor.size
        owned = [e for e in split if e.owner_tp == self.tp_rank]
        parts = {e: e.matrix.split(updates[e]) for e in owned}
        got = exchange(
            self.tensor,
            [[parts[e][t].reshape(-1) for e in owned] for t in range(size)],
            [[_numel(e.local_shape) for e in split if e.owner_tp == t] for t in range(size)],
            device,
        )
        for t in range(size):
            for k, e in enumerate(e for e in split if e.owner_tp == t):
                local[e] = got[t][k]
        return local

    def _apply(self, pieces: dict, lr) -> None:
        """5. W <- W (1 - lr wd) - lr O on this rank's pieces; the 16-bit weights follow."""
        for e, wd, group in zip(self.entries, self.weight_decay, self.lr_group):
            if not e.lengths[self.me]:
                continue
            param = self._param(e)
            weights = self.storage.local_view(param, "fp32")
            apply_update(weights, pieces[e].to(weights.device), lr_of(lr, group), wd)
            self.storage.refresh_low_precision(param)


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


class Muon:
    """Muon over an engine's storages: planned once, stepped once per optimizer step (after the
    gradients are reduced and clipped, before the storages' Adam step of the other parameters)."""

    def __init__(self, storages, matrix_of, config: MuonConfig, *, tensor_of, ns_device, weight_decay_of, lr_group_of):
        """`matrix_of(param, shape) -> MuonMatrix | None` (shape: the storage's, TP-local);
        `tensor_of(storage)`: the TP group its matrices split over (None: not split)."""
        self.config = config
        self.parts = [
            part
            for part in (
                StorageMuon.plan(s, matrix_of, tensor_of(s), config, ns_device, weight_decay_of, lr_group_of)
                for s in storages
            )
            if part is not None
        ]
        self.params = {id(part.storage.params[e.index]) for part in self.parts for e in part.entries}

    @classmethod
    def for_engine(cls, engine, config: MuonConfig, muon_matrix, lr_group_of) -> "Muon":
        """The Muon of a ZeroEngine's storages; `muon_matrix(name, param, shape)` as the engine's."""
        if engine.zero.zenflow is not None:
            raise ValueError("Muon with ZenFlow is not supported: ZenFlow's selection is Adam's")
        return cls(
            engine.storages(),
            lambda p, shape: muon_matrix(engine.names[id(p)], p, shape),
            config,
            tensor_of=lambda s: engine.domain_of(s).groups.tensor,
            ns_device="cpu" if engine.zero.offloads_optimizer else engine.device,
            weight_decay_of=engine._weight_decay_of,
            lr_group_of=lr_group_of,
        )

    def steps(self, param) -> bool:
        """Whether Muon steps `param` (the storages' Adam then leaves it alone)."""
        return id(param) in self.params

    def step(self, lr, coef: float) -> None:
        for part in self.parts:
            part.step(lr, coef)
