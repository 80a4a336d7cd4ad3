"""The process groups a ZeRO optimizer needs, handed in from outside.

ZeRO knows nothing of tensor or pipeline layers: it gets parameters, these groups and, as data,
which parameters count in the gradient norm (megazero.parallel.finalize decides that).
"""
from __future__ import annotations

import dataclasses

from megazero.core.comm import Group


@dataclasses.dataclass
class ZeroGroups:
    dp: Group              # the whole data-parallel group
    shard: Group           # where states are partitioned (the DP group, or a MiCS shard group)
    replica: Group         # ranks holding the same partition (MiCS replicas; a group of one otherwise)
    model_parallel: Group  # TP x PP: gradient norms are summed over it
    gather: Group | None = None  # same ranks as `shard`, its own communicator, so stage-3 parameter
    #                               gathers never queue behind gradient reductions (None: `shard`)
    # Stage 3 across nodes (ZeRO++, hierarchical MiCS gather): the ranks of `shard` on this rank's
    # node, and the ranks of `shard` at this rank's position on the other nodes (None: not built).
    node_local: Group | None = None
    cross_node: Group | None = None
    hpz: Group | None = None   # hpZ: the node-local ranks sharing a secondary partition (None: off)
    # The tensor-parallel ranks (None: none): ZenFlow chooses the columns of a matrix that tensor
    # parallelism splits by the whole matrix's norms, as one process would.
    tensor: Group | None = None

    @property
    def shard_gather(self) -> Group:
        return self.gather if self.gather is not None else self.shard
