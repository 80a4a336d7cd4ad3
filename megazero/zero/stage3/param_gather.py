"""ZeRO stage 3: how a unit's full buffer is assembled from the partitions, across nodes.

Owns the collectives of a parameter gather; `units.UnitStorage` says which unit and where its
partition chunk is, `coordinator` says when. Three ways, chosen by the ZeroConfig:

- flat: one all-gather over the shard group (`ZeroGroups.shard_gather`).
- two hops (`mics_hierarchical_params_gather`, a shard group spanning nodes): an all-gather among
  the ranks at this rank's position on every node (`cross_node`: one rank per node, so only this
  hop crosses nodes, moving (nodes - 1) chunks per rank instead of (shard - 1)), then one inside the
  node (`node_local`) of what the first hop brought; the result is in (position, node) order and is
  put back in shard-rank order by one copy. A pure copy of the same values as the flat gather.
- hpZ (`zero_hpz_partition_size` h > 1): the first gather of a unit after its partition changed
  (the forward after an optimizer step) is one of the above; from its result each rank keeps its
  1/h slice (the secondary partition, node-local). Every later gather of the unit until the next
  change (the backward's, other microbatches') is an all-gather of the secondary partitions over the
  `hpz` group, which never leaves the node.

qwZ (`zero_quantized_weights`): gathers from the primary partition move int8 block-quantized weights
(`megazero.zero.quantized_comm.quantized_all_gather`); with two hops only the cross-node hop is
quantized; secondary gathers are never quantized.

Every gather returns a `comm.Handle`; what must follow the collectives (the reorder copy, keeping the
secondary slice) runs when it is waited for, on the waiting (compute) stream.
"""

from __future__ import annotations

import collections
import itertools

import torch

from megazero.core import comm
from megazero.core.errors import UsageError
from megazero.core.streams import Event, label
from ..config import ZeroConfig
from ..zero_groups import ZeroGroups


class ParamGather:
    """Gathers stage-3 units into their full buffers; holds the hpZ secondary partitions."""

    def __init__(self, groups: ZeroGroups, zero: ZeroConfig, unit_totals: list[int], dtype, device, streams):
        self.groups, self.zero, self.streams = groups, zero, streams
        self.shard = groups.shard_gather
        self.two_hop = zero.mics_hierarchical_params_gather and _worth_two_hops(groups)
        self.hpz = _hpz_group(groups, zero.zero_hpz_partition_size)
        self.secondary: torch.Tensor | None = None
        self.secondary_offsets: list[int] = []
        if self.hpz is not None:
            sizes = [total // self.hpz.size for total in unit_totals]
            self.secondary_offsets = [0, *itertools.accumulate(sizes)][:-1]
            self.secondary = label(torch.empty(sum(sizes), dtype=dtype, device=device), "hpZ secondary partition")
        self.fresh = [False] * len(unit_totals)  # secondary slice holds the current weights
        self.generation = 0  # partition writes so far
        self.secondary_ready = Event(device)  # the last secondary write, on its stream
        self.gathered_numel: collections.Counter = collections.Counter()  # elements, by "primary"/"secondary"
        if zero.zero_quantized_weights:
            from megazero.ops.quantize import kernel_info, triton_info

            # A missing megazero._quant build (CPU) or Triton (GPU) fails here, naming the fix.
            kernel_info() if torch.device(device).type == "cpu" else triton_info(device)

    # --- the one entry point ------------------------------------------------------------------
    def start(self, unit, chunk: torch.Tensor) -> comm.Handle:
        """Issues the gather of `unit.full` (on the current stream: the unit storage's prefetch stream);
        `chunk` is this rank's partition chunk of the unit."""
        if self.hpz is not None and self.fresh[unit.index]:
            self.gathered_numel["secondary"] += unit.total
            self.secondary_ready.wait()
            return comm.all_gather(unit.full, self._secondary(unit), self.hpz, async_op=True)
        self.gathered_numel["primary"] += unit.total
        handle = (
            self._two_hop(unit.full, chunk)
            if self.two_hop
            else self._all_gather(unit.full, chunk, self.shard, quantized=self.zero.zero_quantized_weights)
        )
        if self.hpz is None:
            return handle
        generation = self.generation
        return comm.Handle([handle], then=lambda: self._keep_secondary(unit, generation))

    def partition_changed(self) -> None:
        """The primary partition was written (optimizer step, loaded weights): secondaries are stale."""
        self.fresh = [False] * len(self.fresh)
        self.generation += 1

    # --- the ways ----------------------------------------------------------------------------
    def _all_gather(self, out: torch.Tensor, chunk: torch.Tensor, group: comm.Group, quantized: bool):
        if quantized:
            from megazero.zero.quantized_comm import quantized_all_gather  # loads the C++ kernels

            return quantized_all_gather(out, chunk, group, async_op=True)
        return comm.all_gather(out, chunk, group, async_op=True)

    def _two_hop(self, full: torch.Tensor, chunk: torch.Tensor) -> comm.Handle:
        cross, local = self.groups.cross_node, self.groups.node_local
        nodes, per_node, n = cross.size, local.size, chunk.numel()
        # Hop 1 (across nodes) must land before hop 2 sends it on; under NCCL this wait only orders
        # the streams, under gloo it blocks until the inter-node hop is done.
        inter = label(
            torch.empty(nodes * n, dtype=full.dtype, device=full.device), "two-hop gather: the cross-node hop's result"
        )
        self._all_gather(inter, chunk, cross, quantized=self.zero.zero_quantized_weights).wait()
        staging = label(torch.empty_like(full), "two-hop gather: the node hop's result")
        handle = comm.all_gather(staging, inter, local, async_op=True)

        def to_shard_order():
            # staging holds (position, node) blocks; shard rank = node * per_node + position.
            full.view(nodes, per_node, n).copy_(staging.view(per_node, nodes, n).transpose(0, 1))
            for buffer in (inter, staging):  # allocated on the prefetch stream
                self.streams.prefetch.keep_alive(buffer)

        return comm.Handle([handle], then=to_shard_order)

    def _secondary(self, unit) -> torch.Tensor:
        size = unit.total // self.hpz.size
        start = self.secondary_offsets[unit.index]
        return self.secondary[start : start + size]

    def _keep_secondary(self, unit, generation: int) -> None:
        if generation != self.generation:
            return  # issued before the partition changed (waited for after it): stale
        size = unit.total // self.hpz.size
        mine = self.hpz.rank * size
        self._secondary(unit).copy_(unit.full[mine : mine + size])
        self.secondary_ready.record()
        self.fresh[unit.index] = True

    # --- accounting ---------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        if self.secondary is None:
            return {}
        return {"secondary_params": self.secondary.numel() * self.secondary.element_size()}


def _worth_two_hops(groups: ZeroGroups) -> bool:
    """Whether the shard group spans nodes with several of its ranks on each (with one rank per node,
    or all on one node, the flat gather moves the same bytes over the same links)."""
    cross, local, shard = groups.cross_node, groups.node_local, groups.shard_gather
    if cross is None or local is None:
        raise UsageError(
            "mics_hierarchical_params_gather needs ZeroGroups.node_local and cross_node "
            "(megazero.training.assembly.zero_groups builds them from the process groups)"
        )
    if cross.size * local.size != shard.size:
        raise UsageError(
            f"mics_hierarchical_params_gather needs the shard group {list(shard.ranks)} to "
            f"have the same number of ranks on every node it spans; change ranks_per_node "
            f"or mics_shard_size, or turn the hierarchical gather off"
        )
    return cross.size > 1 and local.size > 1


def _hpz_group(groups: ZeroGroups, size: int) -> comm.Group | None:
    if size == 1:
        return None
    if groups.hpz is None or groups.hpz.size != size or groups.shard_gather.size % size:
        have = "no hpZ group" if groups.hpz is None else f"an hpZ group of {groups.hpz.size}"
        raise UsageError(
            f"zero_hpz_partition_size {size} needs process groups built with "
            f"Topology(hpz_partition_size={size}), but the ZeRO groups have {have}; "
            f"pass the config's zero_hpz_partition_size to the Topology"
        )
    return groups.hpz
