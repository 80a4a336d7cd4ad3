"""The rank grid: pure arithmetic from (world, tp, cp, pp, dp, mics, ranks_per_node, hpz) to coordinates and groups.

Owns validation of the parallel degrees and the rank layout. Must not create process groups or import
torch.distributed: `parallel.groups` turns the rank lists here into groups. Everything here is testable
without processes.

Layout (Megatron's default order "tp-cp-dp-pp"): TP varies fastest, then CP (context parallel), then
DP, then PP:
    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
Without context parallelism (cp = 1) this is Megatron's "tp-dp-pp". `dp` is the data-parallel degree
(how many different samples a step sees at once); the group kind "dp" is the data-parallel group
*with* context parallelism, dp x cp ranks, because that is the group gradients are reduced over and
ZeRO shards over (Megatron's distributed optimizer uses the same dp-cp group): each CP rank computes
the gradient of its own part of every sequence. `coords(rank).dp` is the pure data-parallel index
(which samples a rank reads), `cp_of(rank)` its place in the CP ring.
MiCS: inside each DP group, shard groups are contiguous blocks of `mics_shard_size` DP ranks and replica
groups are the ranks at the same position across blocks.
Nodes: a node is `ranks_per_node` consecutive global ranks. Each shard group splits into its ranks on
each node (node-local groups) and, when every node holds the same number of them, into the ranks at
the same position on each node (cross-node groups): a stage-3 gather can then cross nodes in one hop
of (nodes) ranks and finish inside the node. hpZ groups are blocks of `hpz_partition_size` ranks of a
node-local group, over which stage 3 keeps its secondary partition.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from megazero.core.errors import UsageError
from megazero.parallel.pipeline.split import stage_layer_ranges


class Coords(NamedTuple):
    tp: int
    dp: int
    pp: int


@dataclasses.dataclass(frozen=True)
class Topology:
    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int = 0  # 0: derived as world // (tp * cp * pp)
    mics_shard_size: int = 0  # 0 or -1: the whole DP group is one shard group
    ranks_per_node: int = 0  # 0: the whole world is one node
    hpz_partition_size: int = 1  # stage-3 hpZ: ranks of a node-local shard group per secondary partition
    cp: int = 1  # context parallel: ranks splitting each sequence
    ep: int = 1  # expert parallel: ranks of the dp x cp group the experts split over
    etp: int = 0  # expert tensor parallel: 0 or tp (experts split as the dense MLP), or 1

    def __post_init__(self):
        for name in ("world_size", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        model = self.tp * self.cp * self.pp
        if self.world_size % model:
            cp_text = f"context-parallel size {self.cp} x " if self.cp > 1 else ""
            raise UsageError(
                f"world size {self.world_size} is not divisible by tensor-parallel size {self.tp} x "
                f"{cp_text}pipeline-parallel size {self.pp} = {model}; launch a multiple of "
                f"{model} processes or change the parallel sizes"
            )
        derived_dp = self.world_size // model
        if self.dp == 0:
            object.__setattr__(self, "dp", derived_dp)
        elif self.dp != derived_dp:
            raise UsageError(
                f"data-parallel size {self.dp} does not match world size {self.world_size} "
                f"/ (tp {self.tp} x cp {self.cp} x pp {self.pp}) = {derived_dp}"
            )
        dp_cp = self.dp_cp
        if self.mics_shard_size in (0, -1):
            object.__setattr__(self, "mics_shard_size", dp_cp)
        if self.mics_shard_size < 1 or dp_cp % self.mics_shard_size:
            what = "data-parallel size" if self.cp == 1 else "data-parallel x context-parallel size"
            raise UsageError(
                f"mics_shard_size {self.mics_shard_size} must divide the {what} "
                f"{dp_cp}; choose a divisor of {dp_cp} or -1 for no MiCS"
            )
        if self.ranks_per_node == 0:
            object.__setattr__(self, "ranks_per_node", self.world_size)
        if self.ranks_per_node < 1:
            raise UsageError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if self.hpz_partition_size > 1:
            self._check_hpz()
        if self.etp == 0:
            object.__setattr__(self, "etp", self.tp)
        if self.etp not in (1, self.tp):
            raise UsageError(
                f"--expert-tensor-parallel-size {self.etp} must be 1 or --tensor-model-parallel-size {self.tp}"
            )
        if self.experts_fold_tp:
            if self.ep < 1 or (self.tp * dp_cp) % self.ep:
                raise UsageError(
                    f"--expert-model-parallel-size {self.ep} must divide tensor-parallel x "
                    f"data-parallel x context-parallel size {self.tp * dp_cp} (with "
                    f"--expert-tensor-parallel-size 1 experts fold into those ranks); choose a "
                    f"divisor of {self.tp * dp_cp}"
                )
        elif self.ep < 1 or dp_cp % self.ep:
            raise UsageError(
                f"--expert-model-parallel-size {self.ep} must divide the data-parallel x "
                f"context-parallel size {dp_cp} (experts fold into those ranks); choose a "
                f"divisor of {dp_cp}"
            )

    def _check_hpz(self) -> None:
        hpz = self.hpz_partition_size
        if self.ranks_per_node % hpz:
            raise UsageError(
                f"zero_hpz_partition_size {hpz} must divide ranks_per_node "
                f"{self.ranks_per_node}; choose a divisor of {self.ranks_per_node}"
            )
        for parts in self.shard_groups_by_node():
            if len({len(part) for part in parts}) != 1 or len(parts[0]) % hpz:
                raise UsageError(
                    f"zero_hpz_partition_size {hpz} must divide the ranks each node holds of "
                    f"stage-3 shard group {sum(parts, [])} ({[len(p) for p in parts]}); "
                    f"change it, ranks_per_node or mics_shard_size"
                )

    @property
    def experts_fold_tp(self) -> bool:
        """Expert tensor-parallel size 1 under tp > 1: experts are whole on each rank and the expert
        groups are cut from all tp x cp x dp ranks of a pipeline stage (Megatron's etp x ep x edp)."""
        return self.etp == 1 and self.tp > 1

    @property
    def dp_cp(self) -> int:
        """Ranks of one gradient-reduction (ZeRO) group: data parallel x context parallel."""
        return self.dp * self.cp

    # --- coordinates -------------------------------------------------------------------------
    def rank_of(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        column = rank // self.tp  # cp + cp_size * (dp + dp_size * pp)
        return Coords(tp=rank % self.tp, dp=(column // self.cp) % self.dp, pp=rank // (self.tp * self.dp_cp))

    def cp_of(self, rank: int) -> int:
        """The rank's place in its context-parallel ring."""
        return (rank // self.tp) % self.cp

    def _columns(self):
        """(dp, cp) pairs in rank order: the index of a pair in this list is the rank's index in
        its dp x cp group."""
        return [(d, c) for d in range(self.dp) for c in range(self.cp)]

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def is_intra_node(self, ranks) -> bool:
        return len({self.node_of(r) for r in ranks}) == 1

    # --- groups (each a list of rank lists covering the world) --------------------------------
    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p, c) for t in range(self.tp)] for p in range(self.pp) for d, c in self._columns()]

    def dp_groups(self) -> list[list[int]]:
        """The gradient-reduction groups: dp x cp ranks (just dp without context parallelism)."""
        return [[self.rank_of(t, d, p, c) for d, c in self._columns()] for p in range(self.pp) for t in range(self.tp)]

    def cp_groups(self) -> list[list[int]]:
        """The context-parallel rings: ranks holding parts of the same sequences."""
        return [
            [self.rank_of(t, d, p, c) for c in range(self.cp)]
            for p in range(self.pp)
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p, c) for p in range(self.pp)] for d, c in self._columns() for t in range(self.tp)]

    def model_parallel_groups(self) -> list[list[int]]:
        """TP x PP ranks holding one full model replica (for norms and losses over the whole model)."""
        return [[self.rank_of(t, d, p, c) for p in range(self.pp) for t in range(self.tp)] for d, c in self._columns()]

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each (tp, dp) column: they share tied embeddings."""
        groups = []
        for ranks in self.pp_groups():
            groups.append(sorted({ranks[0], ranks[-1]}))
        return groups

    def mics_shard_groups(self) -> list[list[int]]:
        m = self.mics_shard_size
        return [dp_ranks[i : i + m] for dp_ranks in self.dp_groups() for i in range(0, self.dp_cp, m)]

    def mics_replica_groups(self) -> list[list[int]]:
        m = self.mics_shard_size
        return [dp_ranks[j::m] for dp_ranks in self.dp_groups() for j in range(m)]

    # --- the shard groups across nodes (stage-3 gathers) ---------------------------------------
    def shard_groups_by_node(self) -> list[list[list[int]]]:
        """Each shard group as its ranks on each node it spans, nodes in order."""
        out = []
        for ranks in self.mics_shard_groups():
            by_node: dict[int, list[int]] = {}
            for r in ranks:
                by_node.setdefault(self.node_of(r), []).append(r)
            out.append(list(by_node.values()))
        return out

    def shard_node_local_groups(self) -> list[list[int]]:
        """The ranks of each shard group on one node."""
        return [part for parts in self.shard_groups_by_node() for part in parts]

    def shard_cross_node_groups(self) -> list[list[int]]:
        """The ranks of a shard group at the same position on each node it spans (one rank per node).
        A shard group with unequal counts on its nodes has none: each of its ranks is a group of one."""
        groups = []
        for parts in self.shard_groups_by_node():
            if len({len(part) for part in parts}) != 1:
                groups.extend([r] for part in parts for r in part)
                continue
            groups.extend([part[j] for part in parts] for j in range(len(parts[0])))
        return groups

    def _expert_domains(self) -> list[list[int]]:
        """The ranks the expert groups are cut from: each (tp, pp) column's dp x cp ranks, or with
        experts folding tp (etp 1) each pipeline stage's tp x cp x dp ranks in rank order."""
        if self.experts_fold_tp:
            n = self.tp * self.dp_cp
            return [list(range(p * n, (p + 1) * n)) for p in range(self.pp)]
        return self.dp_groups()

    def ep_groups(self) -> list[list[int]]:
        """Expert parallel: blocks of `ep` consecutive ranks of each expert domain (dp x cp ranks of
        one tp rank, or all tp x cp x dp ranks of a stage with etp 1); each holds 1/ep of every MoE
        layer's experts and they trade tokens (Megatron's tp-ep-dp-pp folding)."""
        return [ranks[i : i + self.ep] for ranks in self._expert_domains() for i in range(0, len(ranks), self.ep)]

    def edp_groups(self) -> list[list[int]]:
        """Expert data parallel: the ranks at the same place of every EP block, holding the same
        experts: expert gradients are reduced, and ZeRO shards expert states, over these."""
        return [ranks[j :: self.ep] for ranks in self._expert_domains() for j in range(self.ep)]

    def ep_of(self, rank: int) -> int:
        """The rank's place in its expert-parallel group (which experts it holds)."""
        if self.experts_fold_tp:
            return (rank % (self.tp * self.dp_cp)) % self.ep
        return ((rank // self.tp) % self.dp_cp) % self.ep

    @property
    def expert_shard_size(self) -> int:
        """Ranks of an expert-data-parallel group that expert states shard over: all of them, or
        with MiCS those inside this rank's MiCS shard group (mics_shard_size / ep of them when ep
        divides it, one when mics_shard_size divides ep; validate_expert_parallel refuses others)."""
        edp = len(self.edp_groups()[0])
        if self.mics_shard_size == self.dp_cp:
            return edp
        m = self.mics_shard_size
        return m // self.ep if m % self.ep == 0 else 1 if self.ep % m == 0 else 0

    def expert_shard_groups(self) -> list[list[int]]:
        """MiCS over experts: blocks of expert_shard_size consecutive ranks of each edp group (the
        edp group itself without MiCS)."""
        m = self.expert_shard_size or 1
        return [ranks[i : i + m] for ranks in self.edp_groups() for i in range(0, len(ranks), m)]

    def expert_replica_groups(self) -> list[list[int]]:
        """The edp ranks at the same place of every expert shard block (each rank alone without MiCS)."""
        m = self.expert_shard_size or 1
        return [ranks[j::m] for ranks in self.edp_groups() for j in range(m)]

    def hpz_groups(self) -> list[list[int]]:
        """Blocks of hpz_partition_size consecutive ranks of each node-local shard group."""
        h = self.hpz_partition_size
        return [part[i : i + h] for part in self.shard_node_local_groups() for i in range(0, len(part), h)]

    def stage3_gather_group_kinds(self) -> dict[str, list[list[int]]]:
        """The groups stage-3 parameter gathers run on (each kind covers the world once)."""
        return {
            "mics_shard_gather": self.mics_shard_groups(),
            "shard_node_local": self.shard_node_local_groups(),
            "shard_cross_node": self.shard_cross_node_groups(),
            "hpz": self.hpz_groups(),
            "edp_gather": self.expert_shard_groups(),
        }

    def all_group_kinds(self) -> dict[str, list[list[int]]]:
        return {
            "tp": self.tp_groups(),
            "dp": self.dp_groups(),
            "pp": self.pp_groups(),
            "cp": self.cp_groups(),
            "mp": self.model_parallel_groups(),
            "embedding": self.embedding_groups(),
            "mics_shard": self.mics_shard_groups(),
            "mics_replica": self.mics_replica_groups(),
            "ep": self.ep_groups(),
            "edp": self.edp_groups(),
            "expert_shard": self.expert_shard_groups(),
            "expert_replica": self.expert_replica_groups(),
        }

    def groups_of(self, rank: int) -> dict[str, list[int]]:
        """For each kind, the one group containing `rank`."""
        mine = {}
        for kind, groups in self.all_group_kinds().items():
            matches = [g for g in groups if rank in g]
            # The embedding group only contains first/last stages; middle stages have none.
            mine[kind] = matches[0] if matches else [rank]
        return mine

    def describe(self) -> str:
        return (
            f"world={self.world_size} tp={self.tp} "
            + (f"cp={self.cp} " if self.cp > 1 else "")
            + (f"ep={self.ep} " if self.ep > 1 else "")
            + ("etp=1 " if self.experts_fold_tp else "")
            + f"pp={self.pp} dp={self.dp} "
            f"mics_shard={self.mics_shard_size} ranks_per_node={self.ranks_per_node}"
            + (f" hpz={self.hpz_partition_size}" if self.hpz_partition_size > 1 else "")
        )


def validate_model_fits(
    topology: Topology,
    *,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
    ffn_hidden_size: int,
    virtual_stages: int = 1,
    layer_split: list[int] | None = None,
) -> None:
    """Checks that the model divides evenly over the grid; raises UsageError naming the numbers."""
    tp, pp = topology.tp, topology.pp
    if num_attention_heads % tp:
        raise UsageError(
            f"--num-attention-heads {num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}; pick a tp that divides the head count"
        )
    if num_query_groups % tp:
        raise UsageError(
            f"--num-query-groups {num_query_groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}; pick a tp that divides the query groups"
        )
    if ffn_hidden_size % tp:
        raise UsageError(f"--ffn-hidden-size {ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    # the pipeline's own split: even (naming --pipeline-layer-split when it is not) or the one given
    stage_layer_ranges(num_layers, pp, virtual_stages, layer_split)


CP_COMM_TYPES = ("p2p", "a2a", "allgather")


def validate_context_parallel(
    topology: Topology,
    *,
    seq_length: int,
    num_attention_heads: int,
    num_query_groups: int,
    comm_type: str,
    sequence_parallel: bool = False,
    attention_dropout: float = 0.0,
) -> None:
    """Checks that sequences and heads split over the context-parallel ring; raises UsageError."""
    cp, tp = topology.cp, topology.tp
    if cp == 1:
        return
    if comm_type not in CP_COMM_TYPES:
        raise UsageError(f"--cp-comm-type {comm_type} is not one of {', '.join(CP_COMM_TYPES)}")
    if seq_length % (2 * cp):
        raise UsageError(
            f"--seq-length {seq_length} is not divisible by 2 x --context-parallel-size {cp} "
            f"= {2 * cp} (each CP rank holds 2 load-balanced chunks of every sequence); "
            f"use a multiple of {2 * cp}"
        )
    if sequence_parallel and (seq_length // cp) % tp:
        raise UsageError(
            f"--sequence-parallel needs the per-CP-rank sequence --seq-length {seq_length} / "
            f"cp {cp} = {seq_length // cp} divisible by --tensor-model-parallel-size {tp}"
        )
    if comm_type == "a2a":
        for flag, count in (("--num-attention-heads", num_attention_heads), ("--num-query-groups", num_query_groups)):
            if count % (cp * tp):
                raise UsageError(
                    f"--cp-comm-type a2a splits heads over context-parallel x tensor-parallel "
                    f"ranks, but {flag} {count} is not divisible by cp {cp} x tp {tp} = "
                    f"{cp * tp}; use --cp-comm-type p2p or allgather, or change the sizes"
                )
    if comm_type == "p2p" and attention_dropout > 0:
        raise UsageError(
            f"--cp-comm-type p2p (ring attention) does not apply attention dropout "
            f"(--attention-dropout {attention_dropout:g}); pass --attention-dropout 0 or use "
            f"--cp-comm-type a2a or allgather"
        )


def validate_expert_parallel(
    topology: Topology, *, num_experts: int, mics: bool, capacity: bool, dispatcher: str, seq_length: int = 0
) -> None:
    """Checks that the experts split over the expert-parallel ranks; raises UsageError."""
    ep, tp = topology.ep, topology.tp
    if num_experts == 0:
        return
    if num_experts % ep:
        raise UsageError(
            f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {ep}; "
            f"choose an ep that divides the experts"
        )
    if topology.experts_fold_tp:
        if mics:
            raise UsageError(
                "MiCS shard groups (mics_shard_size) with --expert-tensor-parallel-size 1 under "
                "--tensor-model-parallel-size > 1 are not supported (the expert groups span "
                "tensor-parallel ranks, MiCS's do not); drop one"
            )
        if capacity:
            raise UsageError(
                "--moe-expert-capacity-factor counts each sequence's tokens per expert, and "
                "--expert-tensor-parallel-size 1 splits each sequence's tokens over the tensor-"
                "parallel ranks; drop one (dropless routing works with it)"
            )
        if seq_length and (seq_length // topology.cp) % tp:
            raise UsageError(
                f"--expert-tensor-parallel-size 1 gives each tensor-parallel rank 1/{tp} of the "
                f"tokens: --seq-length {seq_length} / cp {topology.cp} must be divisible by "
                f"--tensor-model-parallel-size {tp}"
            )
    if ep > 1 and mics and not topology.expert_shard_size:
        raise UsageError(
            f"mics_shard_size {topology.mics_shard_size} and --expert-model-parallel-size {ep}: "
            f"one must divide the other (expert states shard over the expert-data-parallel "
            f"ranks inside each MiCS shard group); change one of them"
        )
    if capacity and topology.cp > 1:
        raise UsageError(
            "--moe-expert-capacity-factor counts each sequence's tokens per expert, and "
            "--context-parallel-size splits sequences over ranks; drop one (dropless routing "
            "works with context parallelism)"
        )
    if dispatcher not in ("alltoall", "allgather"):
        raise UsageError(f"--moe-token-dispatcher-type {dispatcher}: choose alltoall or allgather")
