"""Which ranks a dry run of a large job simulates: one per role.

A rank's role is everything about its place in the grid that changes what it runs: for every group
kind it belongs to (tp, dp, pp, cp, mp, embedding, MiCS shard and replica, the shard group's
node-local and cross-node parts, hpZ, expert parallel ep and expert data parallel edp), its
position there (first / middle / last), the group's size
and whether the group stays inside a node; its exact place in the context-parallel ring (each chunk
pairs with its own peers); and its pipeline stage with that stage's layers (1F1B's warm-up length
depends on the stage's index, so two middle stages order their sends and receives differently).

Along tensor parallelism the position matters only on the stages that hold the vocabulary (the
first, with the embedding and the data's broadcast; the last, with the output layer, the loss and
the last rank's padding rows): elsewhere every tensor-parallel rank holds shards of equal shapes
and issues the same symmetric collectives (all-reduce, all-gather, reduce-scatter), so a middle
stage's tensor-parallel ranks share one role.

Along ZeRO's axis the position stands for the partition: every partition is the same size (each
bucket is padded to a multiple of the shard count and cut into equal chunks, `zero/flat.py`), and
every collective is one per bucket on every rank, whatever it holds. What the index changes is which
parameters' pieces a rank holds (the first chunk of each bucket starts at a parameter, the last
holds the padding): only local work (initial values, the optimizer's runs, the norm's sums), none of
it a collective. Ranks of one role issue the same collectives (same ops, sizes, reduce ops,
positions of roots and peers) and allocate the same memory, so one of them stands for all:
`tests/tools/test_dry_run.py` runs every rank of 16-rank layouts (one with 8 partitions, six of them
middle) and checks each rank against its role's representative.
"""

from __future__ import annotations


def _position(index: int, size: int) -> str:
    return "first" if index == 0 else "last" if index == size - 1 else "middle"


def roles(cfg, world: int) -> dict[tuple, list[int]]:
    """role -> its ranks (ascending), for `world` ranks of the job `cfg` lays out."""
    from megazero.config.train_config import topology_of
    from megazero.parallel.pipeline.split import stage_layer_ranges

    topology = topology_of(cfg, world)
    par = cfg.parallel
    chunks = stage_layer_ranges(cfg.model.num_layers, topology.pp, par.virtual_stages, par.layer_split)
    stage_layers = [
        tuple(len(chunks[v * topology.pp + p]) for v in range(par.virtual_stages)) for p in range(topology.pp)
    ]
    kinds = {**topology.all_group_kinds(), **topology.stage3_gather_group_kinds()}
    place: list[list] = [[] for _ in range(world)]
    for kind, groups in sorted(kinds.items()):
        member = [None] * world
        for ranks in groups:
            intra = topology.is_intra_node(ranks)
            for i, r in enumerate(ranks):
                member[r] = (kind, _position(i, len(ranks)), len(ranks), intra)
        for r in range(world):
            place[r].append(member[r] or (kind, None))
    found: dict[tuple, list[int]] = {}
    for r in range(world):
        stage = topology.coords(r).pp
        where = place[r]
        if stage not in (0, topology.pp - 1):
            # No vocabulary here (the embedding is on the first stage, the output layer on the last):
            # every tensor-parallel rank holds equal shards and issues symmetric collectives.
            where = [(kind, None, *rest) if kind == "tp" else (kind, pos, *rest) for kind, pos, *rest in where]
        key = (stage, stage_layers[stage], topology.cp_of(r)) + tuple(where)
        found.setdefault(key, []).append(r)
    return found


def representatives(cfg, world: int) -> dict[int, int]:
    """rank simulated -> how many ranks of the job it stands for (itself included)."""
    return {members[0]: len(members) for members in roles(cfg, world).values()}
