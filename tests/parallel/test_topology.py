"""The rank grid, checked as pure arithmetic (no processes): every rank in exactly one group of each
kind, groups orthogonal, the documented layout for several grids, invalid grids rejected."""

import itertools

import pytest

from megazero.core.errors import UsageError
from megazero.parallel.topology import Topology, validate_model_fits

GRIDS = [  # world, tp, pp, mics
    (1, 1, 1, -1),
    (8, 2, 2, -1),
    (8, 1, 1, 4),
    (8, 2, 1, 2),
    (16, 2, 2, 2),
    (12, 3, 2, -1),
    (8, 1, 8, -1),
    (24, 2, 3, 2),
]


@pytest.mark.parametrize("world,tp,pp,mics", GRIDS)
def test_every_rank_in_exactly_one_group_of_each_kind(world, tp, pp, mics):
    topo = Topology(world_size=world, tp=tp, pp=pp, mics_shard_size=mics)
    sizes = {
        "tp": tp,
        "dp": topo.dp,
        "pp": pp,
        "mp": tp * pp,
        "cp": 1,
        "mics_shard": topo.mics_shard_size,
        "mics_replica": topo.dp // topo.mics_shard_size,
        "ep": 1,
        "edp": topo.dp,
        "expert_shard": topo.mics_shard_size,
        "expert_replica": topo.dp // topo.mics_shard_size,
    }
    for kind, groups in topo.all_group_kinds().items():
        if kind == "embedding":
            continue
        members = sorted(itertools.chain.from_iterable(groups))
        assert members == list(range(world)), f"{kind}: every rank exactly once"
        assert {len(g) for g in groups} == {sizes[kind]}, kind


@pytest.mark.parametrize("world,tp,pp,mics", GRIDS)
def test_groups_are_orthogonal(world, tp, pp, mics):
    """A TP group and a DP group share at most one rank, and so on for every pair of axes; the
    coordinates of a rank identify it uniquely."""
    topo = Topology(world_size=world, tp=tp, pp=pp, mics_shard_size=mics)
    kinds = ("tp", "dp", "pp")
    groups = topo.all_group_kinds()
    for a, b in itertools.combinations(kinds, 2):
        for ga in groups[a]:
            for gb in groups[b]:
                assert len(set(ga) & set(gb)) <= 1, (a, b, ga, gb)
    coords = {topo.coords(r) for r in range(world)}
    assert len(coords) == world
    for r in range(world):
        c = topo.coords(r)
        assert topo.rank_of(c.tp, c.dp, c.pp) == r
        mine = topo.groups_of(r)
        assert all(topo.coords(x).dp == c.dp and topo.coords(x).pp == c.pp for x in mine["tp"])
        assert all(topo.coords(x).tp == c.tp and topo.coords(x).pp == c.pp for x in mine["dp"])
        assert all(topo.coords(x).tp == c.tp and topo.coords(x).dp == c.dp for x in mine["pp"])


def test_context_parallel_layout_tp_cp_dp_pp():
    """Megatron's order with CP: tp fastest, then cp, then dp, then pp; gradients reduce (and ZeRO
    shards) over dp x cp; a model replica (mp) and the pipeline keep one (dp, cp) column."""
    topo = Topology(world_size=16, tp=2, pp=2, cp=2)  # dp = 2
    assert topo.dp == 2 and topo.dp_cp == 4 and topo.mics_shard_size == 4
    assert topo.cp_groups()[:3] == [[0, 2], [1, 3], [4, 6]]
    assert topo.dp_groups()[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.tp_groups()[:2] == [[0, 1], [2, 3]]
    assert topo.pp_groups()[:3] == [[0, 8], [1, 9], [2, 10]]
    assert topo.model_parallel_groups()[:2] == [[0, 1, 8, 9], [2, 3, 10, 11]]
    assert topo.coords(13) == (1, 1, 1) and topo.cp_of(13) == 0 and topo.cp_of(11) == 1
    for r in range(16):
        c = topo.coords(r)
        assert topo.rank_of(c.tp, c.dp, c.pp, topo.cp_of(r)) == r
    for kind, groups in topo.all_group_kinds().items():
        if kind != "embedding":
            assert sorted(sum(groups, [])) == list(range(16)), kind
    with pytest.raises(UsageError, match="context-parallel size 3"):
        Topology(world_size=8, cp=3)


def test_megatron_layout_tp_fastest_then_dp_then_pp():
    topo = Topology(world_size=16, tp=2, pp=2)  # dp = 4
    assert topo.tp_groups()[:3] == [[0, 1], [2, 3], [4, 5]]
    assert topo.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert topo.pp_groups()[:2] == [[0, 8], [1, 9]]
    assert topo.embedding_groups()[:2] == [[0, 8], [1, 9]]
    assert topo.model_parallel_groups()[0] == [0, 1, 8, 9]
    assert topo.coords(13) == (1, 2, 1)


def test_embedding_group_is_first_and_last_stage():
    topo = Topology(world_size=8, tp=1, pp=4)  # dp = 2
    assert topo.pp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.embedding_groups() == [[0, 6], [1, 7]]
    assert topo.groups_of(2)["embedding"] == [2]  # middle stages hold no embedding


def test_mics_shard_and_replica_groups():
    topo = Topology(world_size=8, tp=1, pp=1, mics_shard_size=2)
    assert topo.mics_shard_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.mics_replica_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    topo = Topology(world_size=8, tp=2, pp=1, mics_shard_size=2)  # dp = 4, DP groups stride 2
    assert topo.mics_shard_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert topo.mics_replica_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_nodes_and_intra_node_groups():
    topo = Topology(world_size=8, tp=2, pp=1, ranks_per_node=4)
    assert [topo.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(topo.is_intra_node(g) for g in topo.tp_groups())
    assert not topo.is_intra_node(topo.dp_groups()[0])  # [0, 2, 4, 6] spans both nodes


@pytest.mark.parametrize(
    "kwargs,numbers",
    [
        (dict(world_size=6, tp=4), ["6", "4"]),
        (dict(world_size=8, tp=2, pp=3), ["8", "2", "3"]),
        (dict(world_size=8, tp=1, mics_shard_size=3), ["3", "8"]),
        (dict(world_size=8, tp=2, dp=3), ["3", "8"]),
    ],
)
def test_invalid_grids_name_the_numbers(kwargs, numbers):
    with pytest.raises(UsageError) as err:
        Topology(**kwargs)
    assert all(n in str(err.value) for n in numbers), str(err.value)


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        (dict(num_layers=4, num_attention_heads=6, num_query_groups=6, ffn_hidden_size=64), "--num-attention-heads"),
        (dict(num_layers=4, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=64), "--num-query-groups"),
        (dict(num_layers=4, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=66), "--ffn-hidden-size"),
        (dict(num_layers=6, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=64), "--num-layers"),
    ],
)
def test_model_that_does_not_divide_over_the_grid(kwargs, flag):
    topo = Topology(world_size=16, tp=4, pp=4)
    with pytest.raises(UsageError) as err:
        validate_model_fits(topo, **kwargs)
    assert flag in str(err.value)


def test_layers_that_do_not_divide_need_a_layer_split():
    """3 layers on 2 stages: refused naming --pipeline-layer-split, accepted with one (the check once
    refused any count not divisible by pp, split or not)."""
    topo = Topology(world_size=2, pp=2)
    sizes = dict(num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64)
    with pytest.raises(UsageError, match="--pipeline-layer-split with 2 counts"):
        validate_model_fits(topo, num_layers=3, **sizes)
    validate_model_fits(topo, num_layers=3, layer_split=[1, 2], **sizes)
    with pytest.raises(UsageError, match=r"--pipeline-layer-split \[2, 2\] must have 2 positive counts summing"):
        validate_model_fits(topo, num_layers=3, layer_split=[2, 2], **sizes)


def test_expert_groups_fold_into_dp_times_cp():
    """Megatron's folding: EP blocks of consecutive dp x cp ranks, EDP the ranks at the same place in
    every block; each (tp, pp) column's dp x cp ranks are exactly ep x edp."""
    topo = Topology(world_size=16, tp=2, pp=1, cp=2, ep=2)
    assert topo.dp_groups()[0] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert topo.ep_groups()[:2] == [[0, 2], [4, 6]]
    assert topo.edp_groups()[:2] == [[0, 4, 8, 12], [2, 6, 10, 14]]
    assert [topo.ep_of(r) for r in (0, 2, 4, 6, 1, 3)] == [0, 1, 0, 1, 0, 1]
    for kind in ("ep", "edp"):
        assert sorted(itertools.chain.from_iterable(topo.all_group_kinds()[kind])) == list(range(16))
    with pytest.raises(UsageError, match="--expert-model-parallel-size 3 must divide"):
        Topology(world_size=8, ep=3)


def test_whole_experts_fold_the_tensor_parallel_ranks_too():
    """Expert tensor-parallel size 1: each stage's tp x cp x dp ranks in rank order are cut into EP
    blocks (so TP ranks hold different experts) and EDP strides; tp x dp = ep x edp per stage."""
    topo = Topology(world_size=8, tp=2, pp=2, ep=2, etp=1)
    assert topo.ep_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.edp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [topo.ep_of(r) for r in range(8)] == [0, 1] * 4
    wide = Topology(world_size=8, tp=2, ep=4, etp=1)
    assert wide.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]] and wide.edp_groups()[0] == [0, 4]
    assert Topology(world_size=4, tp=2, ep=1, etp=1).edp_groups() == [[0, 1, 2, 3]]
    assert Topology(world_size=4, tp=2, ep=2).ep_groups() == [[0, 2], [1, 3]]  # etp = tp
    with pytest.raises(UsageError, match="--expert-model-parallel-size 8 must divide tensor-parallel"):
        Topology(world_size=4, tp=2, ep=8, etp=1)
    with pytest.raises(UsageError, match="--expert-tensor-parallel-size 3 must be 1 or"):
        Topology(world_size=8, tp=4, etp=3)


def test_mics_shards_experts_inside_each_shard_group():
    """MiCS over experts: the edp ranks inside a rank's MiCS shard group shard the expert states
    (mics / ep of them, or 1 when mics divides ep); the blocks repeat across shard groups."""
    topo = Topology(world_size=8, ep=2, mics_shard_size=4)
    assert topo.mics_shard_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.edp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.expert_shard_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert topo.expert_replica_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    small = Topology(world_size=8, ep=4, mics_shard_size=2)
    assert small.expert_shard_groups() == [[r] for r in (0, 4, 1, 5, 2, 6, 3, 7)]
    assert small.expert_replica_groups()[0] == [0, 4]
    assert Topology(world_size=8, ep=2).expert_shard_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert Topology(world_size=12, ep=3, mics_shard_size=4).expert_shard_size == 0  # refused by config
