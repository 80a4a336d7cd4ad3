"""The process groups a ZeRO optimizer needs, handed in from outside.

ZeRO knows nothing of tensor or pipeline layers: it gets parameters, these groups and, as data,
which parameters count in the gradient norm (megazero.parallel.finalize decides that).
"""

from __future__ import annotations

import dataclasses

from megazero.core.comm import Group


@dataclasses.dataclass
class ZeroGroups:
    dp: Group  # the whole data-parallel group
    shard: Group  # where states are partitioned (the DP group, or a MiCS shard group)
    replica: Group  # ranks holding the same partition (MiCS replicas; a group of one otherwise)
    model_parallel: Group  # TP x PP: gradient norms are summed over it
    gather: Group | None = None  # same ranks as `shard`, its own communicator, so stage-3 parameter
    #                               gathers never queue behind gradient reductions (None: `shard`)
    # Stage 3 across nodes (ZeRO++, hierarchical MiCS gather): the ranks of `shard` on this rank's
    # node, and the ranks of `shard` at this rank's position on the other nodes (None: not built).
    node_local: Group | None = None
    cross_node: Group | None = None
    hpz: Group | None = None  # hpZ: the node-local ranks sharing a secondary partition (None: off)
    # The tensor-parallel ranks (None: none): ZenFlow chooses the columns of a matrix that tensor
    # parallelism splits by the whole matrix's norms, as one process would.
    tensor: Group | None = None

    @classmethod
    def from_grid(cls, groups) -> "ZeroGroups":
        """ZeRO's groups from the rank grid's (parallel.process_groups.ProcessGroups, read by its
        attributes): the stage-3 gathers' node-local, cross-node and hpZ groups are on the gather
        communicators (hpZ only where the topology was built with a partition size)."""
        hpz = groups.hpz if groups.topology.hpz_partition_size > 1 else None
        return cls(
            dp=groups.dp,
            shard=groups.mics_shard,
            replica=groups.mics_replica,
            model_parallel=groups.mp,
            gather=groups.mics_shard_gather,
            node_local=groups.shard_node_local,
            cross_node=groups.shard_cross_node,
            hpz=hpz,
            tensor=groups.tp,
        )

    @property
    def shard_gather(self) -> Group:
        return self.gather if self.gather is not None else self.shard
