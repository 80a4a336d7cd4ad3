"""Turns a `Topology` into this rank's torch.distributed groups, wrapped as `megazero.comm.Group`.

Owns group creation only. torch requires every process of the default group to enter `new_group` for
every group, members or not, in the same order; `GroupFactory` does that and caches groups by their
rank tuple, so several topologies over one world (tests run many layouts in one process group) reuse
the same communicators. No module-level state: the factory and the groups are passed around.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from megazero.comm import CommLog, Group
from .topology import Coords, Topology


class GroupFactory:
    """Creates (or reuses) torch process groups; every process must make the same calls in order."""

    def __init__(self, rank: int, initialized: bool | None = None):
        self.rank = rank
        self.initialized = dist.is_initialized() if initialized is None else initialized
        self._cache: dict[tuple[int, ...], object] = {}

    def torch_group(self, ranks: tuple[int, ...]):
        if len(ranks) == 1:
            return None          # groups of one never communicate
        if not self.initialized:
            raise RuntimeError(f"group {ranks} needs torch.distributed, which is not initialized")
        if ranks not in self._cache:
            self._cache[ranks] = dist.new_group(list(ranks))
        return self._cache[ranks]


@dataclasses.dataclass
class ProcessGroups:
    """This rank's view of the grid: its coordinates and one `Group` per kind."""
    topology: Topology
    rank: int
    coords: Coords
    tp: Group
    dp: Group
    pp: Group
    mp: Group                 # tp x pp: one model replica
    embedding: Group          # first+last pipeline stage (this rank alone on middle stages)
    mics_shard: Group
    mics_replica: Group
    log: CommLog

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.topology.pp - 1

    @classmethod
    def build(cls, topology: Topology, rank: int, factory: GroupFactory | None = None,
              log: CommLog | None = None) -> "ProcessGroups | None":
        """Creates every group of the topology (collectively) and keeps the ones holding `rank`.

        A process outside the topology's world (a test running a smaller layout inside a larger
        world) still takes part in creating the groups, and gets None back.
        """
        factory = factory or GroupFactory(rank)
        log = log or CommLog()
        mine: dict[str, Group] = {}
        for kind, rank_lists in topology.all_group_kinds().items():
            for ranks in rank_lists:
                ranks = tuple(ranks)
                pg = factory.torch_group(ranks)
                if rank in ranks:
                    mine[kind] = Group(kind, ranks, ranks.index(rank), pg,
                                       topology.is_intra_node(ranks), log)
            if kind not in mine:   # middle pipeline stages belong to no embedding group
                mine[kind] = Group(kind, (rank,), 0, None, True, log)
        if rank >= topology.world_size:
            return None
        return cls(topology=topology, rank=rank, coords=topology.coords(rank), log=log, **mine)

    @classmethod
    def single(cls) -> "ProcessGroups":
        """The trivial grid of one process; needs no torch.distributed."""
        return cls.build(Topology(world_size=1), 0, GroupFactory(0, initialized=False))
