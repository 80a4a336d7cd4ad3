"""The stage-3 gather communicator: `mics_shard_gather` spans exactly the ranks of `mics_shard` on a
torch process group of its own (so NCCL never queues a parameter gather behind a gradient
reduce-scatter), both work with an op in flight on each, building a layout again reuses both, and the
device check fires on a real multi-rank group before the backend is touched."""

import torch

from megazero.core import comm
from megazero.parallel.topology import Topology

LAYOUTS = [
    dict(world_size=4, tp=1, mics_shard_size=2),  # shard groups (0,1), (2,3); dp (0..3)
    dict(world_size=4, tp=2),
]  # no MiCS: shard group == dp group


def gather_communicator_checks(ctx, layout):
    groups = ctx.groups(Topology(**layout))
    again = ctx.groups(Topology(**layout))
    shard, gather = groups.mics_shard, groups.mics_shard_gather
    grads = torch.full((2 * shard.size,), float(ctx.rank + 1))
    reduced = torch.empty(2)
    full = torch.empty(2 * gather.size)
    groups.log.end_step()
    scatter = comm.reduce_scatter(reduced, grads, shard, async_op=True)
    comm.all_gather(full, torch.full((2,), float(ctx.rank)), gather, async_op=True).wait()
    scatter.wait()
    try:
        comm.all_reduce(torch.zeros(1, device="meta"), gather)
        error = ""
    except ValueError as err:
        error = str(err)
    return {
        "ranks": (shard.ranks, gather.ranks),
        "name": gather.name,
        "devices": (shard.device, gather.device),
        "own_pg": gather.pg is not shard.pg and gather.pg is not groups.dp.pg,
        "shard_shares_dp_pg": shard.pg is groups.dp.pg,
        "reused": again.mics_shard_gather.pg is gather.pg and again.mics_shard.pg is shard.pg,
        "reduced": reduced.tolist(),
        "full": full.tolist(),
        "error": error,
        "counted": sorted((op, g) for op, g, _ in groups.log.end_step()),
    }


def test_gather_communicator_is_separate_and_works(dist_pool):
    pool = dist_pool(4)
    for layout in LAYOUTS:
        results = pool.run(gather_communicator_checks, layout)
        for rank, r in enumerate(results):
            shard_ranks, gather_ranks = r["ranks"]
            assert gather_ranks == shard_ranks and rank in shard_ranks
            assert r["name"] == "mics_shard_gather"
            assert r["devices"] == (torch.device("cpu"), torch.device("cpu"))
            assert r["own_pg"] and r["reused"]
            assert r["shard_shares_dp_pg"] == (len(shard_ranks) == 4 // layout.get("tp", 1))
            assert r["reduced"] == [float(sum(x + 1 for x in shard_ranks))] * 2
            assert r["full"] == [float(x) for x in shard_ranks for _ in range(2)]
            assert "all_reduce" in r["error"] and "mics_shard_gather" in r["error"], r["error"]
            assert r["counted"] == [("all_gather", "mics_shard_gather"), ("reduce_scatter", "mics_shard")]
