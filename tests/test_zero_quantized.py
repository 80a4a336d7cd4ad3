"""ZeRO++'s quantized collectives (megazero/zero/quantized_comm.py) on gloo ranks.

qwZ (int8 all-gather): every rank's chunk lands in its slot, each value within the per-block bound
of megazero.ops.quantize (|x - x'| <= scale / 2 + a few ulps of max|block|, scale = max|block| / 127,
plus bf16's rounding for a bf16 output), and the comm log counts the codes and scales moved.

qgZ (int4 all-to-all, node then across nodes): chunk ownership is checked exactly with inputs that
int4 represents exactly at both hops, and the error on random inputs is checked against the bound of
the two hops: one rounding per contribution at the first, one per node partial at the second.
"""
import torch

from megazero import comm
from megazero.ops import quantize as Q
from megazero.zero.quantized_comm import (QGZ_BLOCK, QWZ_BLOCK, quantized_all_gather,
                                          quantized_reduce_scatter)

SLACK_ULPS = 8


def node_groups(ctx, world: int, per_node: int, log: comm.CommLog) -> dict | None:
    """shard (ranks 0..world-1), node_local and cross_node comm.Groups of this rank, with nodes of
    `per_node` consecutive ranks. Every pool rank takes part in creating every group."""
    nodes = world // per_node
    kinds = {"shard": [tuple(range(world))],
             "node_local": [tuple(range(p * per_node, (p + 1) * per_node)) for p in range(nodes)],
             "cross_node": [tuple(range(l, world, per_node)) for l in range(per_node)]}
    mine = {}
    for kind, rank_lists in kinds.items():
        for ranks in rank_lists:
            pg = ctx.factory.torch_group(ranks, f"test_{kind}")
            if ctx.rank in ranks:
                one_node = len({r // per_node for r in ranks}) == 1
                mine[kind] = comm.Group(kind, ranks, ranks.index(ctx.rank), pg, one_node, log)
    return mine if ctx.rank < world else None


def rank_input(rank: int, numel: int, dtype) -> torch.Tensor:
    """Rank r's random values, each 64-element stretch at its own magnitude (blocks differ)."""
    gen = torch.Generator().manual_seed(100 + rank)
    scale = torch.rand(-(-numel // 64), generator=gen).repeat_interleave(64)[:numel] * 10 ** (rank % 3)
    return (torch.randn(numel, generator=gen) * scale).to(dtype)


def block_bound(x: torch.Tensor, bits: int, block: int, out_dtype) -> torch.Tensor:
    """Per element, megazero.ops.quantize's round-trip bound for x quantized in blocks of `block`."""
    x = x.double()
    pad = -x.numel() % block
    block_max = torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, block).amax(dim=1)
    block_max = block_max.repeat_interleave(block)[:x.numel()]
    bound = block_max / ((1 << (bits - 1)) - 1) / 2 + SLACK_ULPS * 2.0 ** -24 * block_max
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (x.abs() + bound)
    return bound


def check_all_gather(groups: dict, numel: int, dtype) -> None:
    shard = groups["shard"]
    n = shard.size
    out = torch.empty(n * numel, dtype=dtype)
    before = gathered_bytes(shard.log)
    handle = quantized_all_gather(out, rank_input(shard.rank, numel, dtype), shard, async_op=True)
    handle.wait()
    for i in range(n):
        want = rank_input(i, numel, dtype)
        got = out[i * numel:(i + 1) * numel]
        excess = ((got.double() - want.double()).abs() - block_bound(want, 8, QWZ_BLOCK, dtype)).max().item()
        assert excess <= 0, f"all-gather {dtype} n={n}: rank {i}'s chunk exceeds the bound by {excess}"
    blocks = -(-numel // QWZ_BLOCK)
    moved, want = gathered_bytes(shard.log) - before, (n - 1) * (blocks * QWZ_BLOCK + 4 * blocks)
    assert abs(moved - want) <= 1e-9 * want, f"logged {moved} bytes, codes + scales are {want}"


def gathered_bytes(log: comm.CommLog) -> float:
    return sum(b for (op, group, _), b in log.step_bytes.items() if (op, group) == ("all_gather", "shard"))


def ternary(numel: int) -> torch.Tensor:
    """Values in {-1, 0, 1}, the same on every rank: int4 holds them (and 4x, 8x them) exactly."""
    return torch.randint(-1, 2, (numel,), generator=torch.Generator().manual_seed(9)).float()


def check_ownership(groups: dict, chunk: int, dtype) -> None:
    """Exactly N * the ternary pattern's chunk s lands on shard rank s."""
    shard = groups["shard"]
    n, s = shard.size, shard.rank
    pattern = ternary(n * chunk)
    out = torch.empty(chunk, dtype=dtype)
    quantized_reduce_scatter(out, pattern.to(dtype), shard, groups["node_local"], groups["cross_node"])
    want = n * pattern[s * chunk:(s + 1) * chunk]
    assert torch.equal(out.float(), want), f"rank {s} does not hold chunk {s} of the sum ({dtype}, n={n})"


def check_reduce_error(groups: dict, chunk: int, dtype) -> None:
    """|output - exact sum| within the two hops' bound; rank s owns chunk s."""
    shard, local = groups["shard"], groups["node_local"]
    n, s = shard.size, shard.rank
    per_node = n if local is None else local.size
    inputs = [rank_input(r, n * chunk, dtype).double() for r in range(n)]
    exact = sum(inputs)[s * chunk:(s + 1) * chunk]
    # Hop 1: what rank r sends to position l (chunks (p, l) of every node p), max|.| / 7 per rank.
    position = s % per_node
    row_max = [x.view(-1, per_node, chunk)[:, position].abs().max() for x in inputs]
    hop1 = sum(m / 7 / 2 for m in row_max)
    nodes = [range(p * per_node, (p + 1) * per_node) for p in range(n // per_node)]
    hop2 = sum((sum(row_max[r] for r in node) * (1 + 1 / 14)) / 7 / 2 for node in nodes) if len(nodes) > 1 else 0
    bound = hop1 + hop2 + 1e-5 * float(exact.abs().max())
    if dtype == torch.bfloat16:          # the sum is written in bf16
        bound += 2.0 ** -8 * (float(exact.abs().max()) + bound)
    out = torch.empty(chunk, dtype=dtype)
    quantized_reduce_scatter(out, inputs[s].to(dtype), shard, local, groups["cross_node"])
    gap = float((out.double() - exact).abs().max())
    assert gap <= bound, f"rank {s}: error {gap} above the two-hop bound {bound} ({dtype}, n={n})"
    # The bound is meaningful: another rank's chunk is far outside it.
    other = sum(inputs)[((s + 1) % n) * chunk:((s + 1) % n + 1) * chunk]
    assert float((out.double() - other).abs().max()) > bound


def collectives_worker(ctx, world: int, per_node: int):
    groups = node_groups(ctx, world, per_node, comm.CommLog())
    if groups is None:
        return None
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 300, 2 * QWZ_BLOCK):
            check_all_gather(groups, numel, dtype)
        for chunk in (1, 37, QGZ_BLOCK):       # tails, and rows of whole blocks
            check_ownership(groups, chunk, dtype)
        check_reduce_error(groups, 700, dtype)
    # One hop only: the shard group as a single node.
    single = {"shard": groups["shard"], "node_local": None, "cross_node": None}
    check_ownership(single, 37, torch.float32)
    check_reduce_error(single, 300, torch.float32)
    return True


def test_quantized_collectives(dist_pool):
    pool = dist_pool(8)
    for world, per_node in ((8, 4), (4, 2), (4, 1), (8, 8)):
        assert pool.run(collectives_worker, world, per_node)[:world] == [True] * world
