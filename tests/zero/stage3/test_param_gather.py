"""Stage 3 across simulated nodes: the two-hop (hierarchical MiCS) gather and hpZ's secondary
partitions reproduce the single-process run in fp32, and the comm log shows where their bytes go.

8 gloo ranks act as several nodes (`ranks_per_node`), so every shard group below spans two nodes
with two or four of its ranks on each. Per rank and step, in elements of this rank's partition P
(every unit's chunk once), with n nodes per shard group, p shard ranks per node and s = n * p:
- hpZ: each unit crosses nodes once per step (its first forward gather), so the inter-node gather
  bytes are (s - 1) P flat, or (n - 1) P with two hops; every later gather stays on the node.
- two hops: each gather moves (n - 1) chunks across nodes and (p - 1) n chunks inside the node.
"""

import types

import pytest
import torch

from tests.layouts import (
    assemble_params,
    assert_close,
    assert_params_match,
    last_stage_result,
    run_training,
    small_config,
    strip_padding,
)
from megazero.core import comm
from megazero.core.errors import UsageError
from megazero.parallel.process_groups import ProcessGroups
from megazero.parallel.topology import Topology
from megazero.core.streams import Streams
from megazero.training.assembly import zero_groups
from megazero.zero.config import ZeroConfig
from megazero.zero.stage3.param_gather import ParamGather

VOCAB = 61
STEPS = 3
UNIT_GATHER_GROUPS = ("mics_shard_gather", "shard_node_local", "shard_cross_node", "hpz")
# name, dp, ranks_per_node, (nodes, ranks per node) of each shard group, config.
LAYOUTS = [
    ("tp 2 dp 4, nodes of 4: two hops + hpZ 2", 4, 4, (2, 2), dict(tp=2, hierarchical=True, hpz=2)),
    ("pp 2 dp 4, nodes of 2: two hops", 4, 2, (2, 2), dict(pp=2, hierarchical=True)),
    ("dp 8 mics 4, nodes of 2: two hops + hpZ 2", 8, 2, (2, 2), dict(mics=4, hierarchical=True, hpz=2)),
    ("dp 8, nodes of 4: flat + hpZ 2 (half the node's shard ranks)", 8, 4, (2, 4), dict(hpz=2)),
    # dp 4 with MiCS shards of 2 (DeepSpeed's ZeRO++ example layout): a 2-rank shard group spanning nodes has one rank per
    # node (two hops are the flat gather, hpZ has nothing to split), so the shard stays in a node
    # and hpZ serves the backward from secondaries, beside MiCS's replica reduction and TP.
    ("tp 2 dp 4 mics 2, nodes of 4: hpZ 2", 4, 4, (1, 2), dict(tp=2, mics=2, hpz=2)),
]


def layout_config(tp=1, pp=1, mics=-1, hierarchical=False, hpz=1):
    extra = {
        "mics_hierarchical_params_gather": hierarchical,
        "zero_hpz_partition_size": hpz,
        "param_persistence_threshold": 0,  # every parameter in a unit: P is the whole partition
        "max_reuse_distance": 0,
    }  # released after use: the backward gathers again
    return small_config(tp=tp, pp=pp, stage=3, mics=mics, steps=STEPS, zero_extra=extra)


def hierarchy_worker(ctx, layouts):
    """Pool entry: trains every layout in turn on the whole pool."""
    results = []
    for _, dp, ranks_per_node, _, settings in layouts:
        cfg = layout_config(**settings)
        topology = Topology(
            world_size=ctx.world_size,
            tp=cfg.parallel.tensor_parallel,
            pp=cfg.parallel.pipeline_parallel,
            mics_shard_size=cfg.zero.mics_shard_size,
            ranks_per_node=ranks_per_node,
            hpz_partition_size=cfg.zero.zero_hpz_partition_size,
        )
        assert topology.dp == dp
        results.append(run_training(cfg, ctx.groups(topology)))
    return results


def gather_bytes(result, loc: str, group: str | None = None) -> float:
    """Bytes of the last step's unit all-gathers at `loc` (on `group`, or on any gather group)."""
    groups = UNIT_GATHER_GROUPS if group is None else (group,)
    return sum(b for (op, g, where), b in result["comm"].items() if op == "all_gather" and g in groups and where == loc)


def check_traffic(result, nodes: int, per_node: int, settings: dict, what: str):
    partition = result["memory"]["params"]  # fp32 bytes of this rank's chunks of every unit
    hpz, two_hops = settings.get("hpz", 1), settings.get("hierarchical", False)
    inter = gather_bytes(result, "inter")
    if hpz > 1:
        assert result["memory"]["secondary_params"] == partition * nodes * per_node // hpz, what
        expected = (nodes - 1 if two_hops else nodes * per_node - 1) * partition if nodes > 1 else 0
        assert inter == pytest.approx(expected, rel=1e-12), f"{what}: inter-node gather bytes"
        assert gather_bytes(result, "intra", "hpz") > 0, f"{what}: later gathers from the secondary"
        assert not any(g == "hpz" and loc == "inter" for (_, g, loc) in result["comm"]), what
    if two_hops:
        intra = gather_bytes(result, "intra", "shard_node_local")
        assert inter > 0 and intra > 0, f"{what}: both hops ran"
        assert inter == pytest.approx(intra * (nodes - 1) / ((per_node - 1) * nodes), rel=1e-12), (
            f"{what}: cross-node hop bytes against the node-local hop's"
        )
        assert gather_bytes(result, "inter", "mics_shard_gather") == 0, f"{what}: no flat gather"


def test_hierarchical_gather_and_hpz_match_single_process(dist_pool):
    reference = run_training(small_config(steps=STEPS), ProcessGroups.single())
    ref_params = strip_padding(assemble_params([reference]), VOCAB)
    per_layout = list(zip(*dist_pool(8).run(hierarchy_worker, LAYOUTS)))
    for (what, _, _, (nodes, per_node), settings), results in zip(LAYOUTS, per_layout):
        got = last_stage_result(results)
        assert_close(got["losses"], reference["losses"], f"{what}: loss curve")
        assert_close(got["norms"], reference["norms"], f"{what}: grad norms")
        assert_params_match(strip_padding(assemble_params(results), VOCAB), ref_params, what)
        for result in results:
            check_traffic(result, nodes, per_node, settings, what)


def gather_worker(ctx):
    """Pool entry: a unit gathered in two hops and from hpZ secondaries equals the flat gather,
    bit for bit, for shard groups of 8 (2 nodes of 4) and 4 (tp 2: 2 nodes of 2)."""
    out = []
    for tp, hpz in ((1, 2), (2, 2)):
        groups = zero_groups(ctx.groups(Topology(world_size=8, tp=tp, ranks_per_node=4, hpz_partition_size=hpz)))
        shard = groups.shard_gather
        chunk = torch.randn(5, generator=torch.Generator().manual_seed(ctx.rank))
        unit = types.SimpleNamespace(index=0, total=5 * shard.size, full=torch.empty(5 * shard.size))
        flat = torch.empty(unit.total)
        comm.all_gather(flat, chunk, shard)
        two_hop = ParamGather(
            groups,
            ZeroConfig(stage=3, mics_hierarchical_params_gather=True, zero_hpz_partition_size=hpz),
            [unit.total],
            torch.float32,
            "cpu",
            Streams("cpu"),
        )
        results = []
        for _ in range(2):  # the primary (two hops), then from the secondaries
            unit.full.zero_()
            two_hop.start(unit, chunk).wait()
            results.append(torch.equal(unit.full, flat))
        two_hop.partition_changed()  # a step: the next gather is primary again ...
        handle = two_hop.start(unit, chunk)
        two_hop.partition_changed()  # ... and one waited for only after a later step keeps nothing
        handle.wait()
        two_hop.start(unit, chunk).wait()
        out.append((results, dict(two_hop.gathered_numel)))
    return out


def test_two_hop_and_secondary_gathers_equal_the_flat_gather(dist_pool):
    for rank, checks in enumerate(dist_pool(8).run(gather_worker)):
        for results, counts in checks:
            assert results == [True, True], f"rank {rank}: two hops, then secondary"
            assert counts["primary"] == 3 * counts["secondary"] > 0, f"rank {rank}: {counts}"


def test_node_groups_of_the_shard_groups():
    topo = Topology(world_size=8, tp=2, ranks_per_node=4, hpz_partition_size=2)  # shard (0, 2, 4, 6)
    assert topo.shard_node_local_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert topo.shard_cross_node_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert topo.hpz_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    topo = Topology(world_size=16, mics_shard_size=8, ranks_per_node=4, hpz_partition_size=2)
    assert topo.shard_cross_node_groups()[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.hpz_groups()[:3] == [[0, 1], [2, 3], [4, 5]]
    for kind, groups in topo.stage3_gather_group_kinds().items():
        assert sorted(r for g in groups for r in g) == list(range(16)), kind
    # Three ranks per node split a shard group of 4 as 3 + 1: no cross-node groups, and no hpZ.
    assert Topology(world_size=4, ranks_per_node=3).shard_cross_node_groups() == [[0], [1], [2], [3]]
    with pytest.raises(UsageError, match="zero_hpz_partition_size 2 must divide the ranks each node"):
        Topology(world_size=4, ranks_per_node=2, mics_shard_size=2, tp=2, hpz_partition_size=2)
    with pytest.raises(UsageError, match="must divide ranks_per_node 3"):
        Topology(world_size=6, ranks_per_node=3, hpz_partition_size=2)
