"""The comm layer: byte counts by op, group and locality in the ring convention; handles that can be
waited twice; in-place reduce-scatter that is safe on gloo; batched point-to-point matched in order."""

import torch

from megazero.core import comm
from megazero.parallel.topology import Topology


def comm_checks(ctx):
    # 4 ranks, "nodes" of 2 ranks: the TP groups (0,1), (2,3) are intra-node, DP groups cross nodes.
    groups = ctx.groups(Topology(world_size=4, tp=2, ranks_per_node=2))
    log, r = groups.log, ctx.rank
    log.end_step()
    x = torch.full((8,), float(r + 1))
    comm.all_reduce(x, groups.tp)  # 32 bytes, n = 2
    out = torch.empty(4)
    comm.reduce_scatter(out, torch.arange(8.0), groups.dp)  # 32-byte input
    gathered = torch.empty(16)
    handle = comm.all_gather(gathered, torch.full((8,), float(r)), groups.dp, async_op=True)
    handle.wait()
    handle.wait()  # second wait is harmless
    # in place: output is this rank's chunk of the input (bf16 is the case gloo gets wrong)
    buf = torch.arange(1 << 16, dtype=torch.bfloat16) * 0 + (groups.dp.rank + 1)
    mine = buf.view(2, -1)[groups.dp.rank]
    h = comm.reduce_scatter(mine, buf, groups.dp, async_op=True)
    h.wait()
    step = log.end_step()
    # no tags: two messages between the same pair match in the order both sides list them
    peer = 1 - groups.tp.rank
    a, b = torch.empty(3), torch.empty(3)
    if groups.tp.rank == 0:
        comm.send_recv([(torch.zeros(3), peer), (torch.ones(3), peer)], [], groups.tp).wait()
    else:
        comm.send_recv([], [(a, peer), (b, peer)], groups.tp).wait()
    return {
        "all_reduce": x.tolist(),
        "reduce_scatter": out.tolist(),
        "all_gather": gathered.tolist(),
        "inplace": bool((mine == 3).all()),
        "step": step,
        "tags": (a.tolist(), b.tolist()),
    }


def test_comm_layer(dist_pool):
    results = dist_pool(4).run(comm_checks)
    r0 = results[0]
    assert r0["all_reduce"] == [3.0] * 8  # ranks 1 + 2 in TP group (0, 1)
    assert r0["reduce_scatter"] == [0.0, 2.0, 4.0, 6.0]  # two DP ranks summed, first chunk
    assert r0["all_gather"] == [0.0] * 8 + [2.0] * 8  # DP group of rank 0 is (0, 2)
    assert all(r["inplace"] for r in results)
    step = r0["step"]
    assert step[("all_reduce", "tp", "intra")] == 2 * (1 / 2) * 32
    assert step[("reduce_scatter", "dp", "inter")] == (1 / 2) * 32 + (1 / 2) * (1 << 16) * 2
    assert step[("all_gather", "dp", "inter")] == (1 / 2) * 64
    assert results[1]["tags"] == ([0.0] * 3, [1.0] * 3)


def test_single_rank_groups_move_nothing():
    from megazero.parallel.process_groups import ProcessGroups

    groups = ProcessGroups.single()
    x = torch.ones(4)
    comm.all_reduce(x, groups.dp)
    out = torch.empty(4)
    comm.reduce_scatter(out, torch.arange(4.0), groups.dp)
    assert x.tolist() == [1.0] * 4 and out.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert groups.log.end_step() == {}


def test_reduce_scatter_takes_the_path_of_the_backend_a_stand_in_group_names(monkeypatch):
    """In place (the output is this rank's chunk of the input) NCCL needs no buffer; gloo goes
    through a temporary. A group whose process group stands in for another backend (the dry run's
    fake one for the flags' nccl) takes that backend's path, and meta tensors (no data pointers)
    share storage only when they do."""
    monkeypatch.setattr(comm.dist, "get_backend", lambda pg=None: "fake")  # what the fake backend says
    handed = []
    monkeypatch.setattr(comm.reduce_scatter_single, "impl", lambda out, inp, **kw: handed.append((out, inp)))

    def buffer_of(stands_for, in_place=True):
        group = comm.Group("dp", (0, 1), 0, object(), True, comm.CommLog(), torch.device("meta"), stands_for)
        flat = torch.empty(8, device="meta")
        out = flat[:4] if in_place else torch.empty(4, device="meta")
        comm.reduce_scatter(out, flat, group)
        sent = handed.pop()[0]
        return "in place" if sent.untyped_storage()._cdata == out.untyped_storage()._cdata else "temporary"

    assert buffer_of("nccl") == "in place"
    assert buffer_of(None) == "temporary" and buffer_of("gloo") == "temporary"
    assert buffer_of("gloo", in_place=False) == "in place"  # its own output: nothing to protect
