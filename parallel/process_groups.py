"""Turns a `Topology` into this rank's torch.distributed groups, wrapped as `megazero.core.comm.Group`.

Owns group creation only. torch requires every process of the default group to enter `new_group` for
every group, members or not, in the same order; `GroupFactory` does that and caches groups by their
rank tuple (and purpose), so several topologies over one world (tests run many layouts in one process
group) reuse the same communicators. No module-level state: the factory and the groups are passed around.

Every `Group` carries the device its collectives use (`collective_device`): the rank's current CUDA
device under NCCL, the CPU otherwise. Stage-3 parameter gathers get their own communicator
(`mics_shard_gather`, same ranks as `mics_shard`): one NCCL communicator runs its ops in issue order,
so prefetch all-gathers sharing one with gradient reduce-scatters would wait behind them. The groups a
gather uses across nodes (the shard group's node-local and cross-node parts, hpZ's blocks) are on that
purpose's communicators too.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megazero.core.comm import CommLog, Group
from .topology import Coords, Topology


class GroupFactory:
    """Creates (or reuses) torch process groups; every process must make the same calls in order."""

    def __init__(self, rank: int, initialized: bool | None = None, timeout=None, stands_for: str | None = None):
        self.rank = rank
        # The backend whose semantics the groups' collectives follow when the process group is a
        # stand-in (the dry run's fake backend standing for the flags' nccl); None: its own.
        self.stands_for = stands_for
        self.initialized = dist.is_initialized() if initialized is None else initialized
        # torch gives new groups its default timeout, not the default group's: pass the run's on
        self.timeout = timeout
        self._cache: dict[tuple[tuple[int, ...], str], object] = {}

    def torch_group(self, ranks: tuple[int, ...], purpose: str = "shared"):
        """The communicator for `ranks`; a different `purpose` gets a separate one over the same ranks."""
        if len(ranks) == 1:
            return None  # groups of one never communicate
        if not self.initialized:
            raise RuntimeError(f"group {ranks} needs torch.distributed, which is not initialized")
        key = (tuple(ranks), purpose)
        if key not in self._cache:
            self._cache[key] = dist.new_group(list(ranks), timeout=self.timeout, pg_options=_options(purpose))
        return self._cache[key]


def _options(purpose: str):
    """Stage-3 gathers are what the next layer waits for: under NCCL their communicator's internal
    stream gets high priority (torch's side streams cannot reach NCCL's own kernels)."""
    if purpose != "stage3_gather" or str(dist.get_backend()) != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def collective_device(device=None) -> torch.device:
    """The device this process's collectives use: `device` if given, else the current CUDA device
    under an NCCL default group, else the CPU."""
    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else "cpu"
    device = torch.device(device)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"process groups on {device} cannot use the nccl backend, which moves CUDA "
            f"tensors only; pass a cuda device or initialise torch.distributed with gloo"
        )
    return device


@dataclasses.dataclass
class ProcessGroups:
    """This rank's view of the grid: its coordinates and one `Group` per kind."""

    topology: Topology
    rank: int
    coords: Coords
    tp: Group
    dp: Group  # gradient reduction: data parallel x context parallel ranks
    pp: Group
    cp: Group  # the context-parallel ring (this rank alone without context parallelism)
    mp: Group  # tp x pp: one model replica
    embedding: Group  # first+last pipeline stage (this rank alone on middle stages)
    mics_shard: Group
    mics_replica: Group
    mics_shard_gather: Group  # mics_shard's ranks on a separate communicator, for stage-3 gathers
    shard_node_local: Group  # the ranks of mics_shard on this rank's node (gather communicator)
    shard_cross_node: Group  # the ranks of mics_shard at this rank's node position on each node
    hpz: Group  # hpZ: this rank's block of shard_node_local (topology.hpz_partition_size)
    ep: Group  # expert parallel: the ranks holding the other experts (topology.ep_groups)
    edp: Group  # expert data parallel: the ranks holding the same experts
    expert_shard: Group  # the edp ranks expert states shard over (edp itself without MiCS)
    expert_replica: Group  # the edp ranks holding the same expert shard (this rank alone without MiCS)
    edp_gather: Group  # expert_shard's ranks on a separate communicator, for stage-3 expert gathers
    log: CommLog

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.topology.pp - 1

    @classmethod
    def build(
        cls, topology: Topology, rank: int, factory: GroupFactory | None = None, log: CommLog | None = None, device=None
    ) -> "ProcessGroups | None":
        """Creates every group of the topology (collectively) and keeps the ones holding `rank`.

        `device` is where the groups' tensors live (see `collective_device` for the default). A
        process outside the topology's world (a test running a smaller layout inside a larger world)
        still takes part in creating the groups, and gets None back.
        """
        factory = factory or GroupFactory(rank)
        log = log or CommLog()
        device = collective_device(device)
        # (name, rank lists, communicator purpose), walked in the same order by every process.
        kinds = [(kind, rank_lists, "shared") for kind, rank_lists in topology.all_group_kinds().items()]
        kinds += [
            (kind, rank_lists, "stage3_gather") for kind, rank_lists in topology.stage3_gather_group_kinds().items()
        ]
        mine: dict[str, Group] = {}
        for kind, rank_lists, purpose in kinds:
            for ranks in rank_lists:
                ranks = tuple(ranks)
                pg = factory.torch_group(ranks, purpose)
                if rank in ranks:
                    mine[kind] = Group(
                        kind,
                        ranks,
                        ranks.index(rank),
                        pg,
                        topology.is_intra_node(ranks),
                        log,
                        device,
                        factory.stands_for,
                    )
            if kind not in mine:  # middle pipeline stages belong to no embedding group
                mine[kind] = Group(kind, (rank,), 0, None, True, log, device)
        if rank >= topology.world_size:
            return None
        return cls(topology=topology, rank=rank, coords=topology.coords(rank), log=log, **mine)

    @classmethod
    def single(cls, device=None) -> "ProcessGroups":
        """The trivial grid of one process; needs no torch.distributed."""
        return cls.build(Topology(world_size=1), 0, GroupFactory(0, initialized=False), device=device)
