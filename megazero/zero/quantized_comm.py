"""ZeRO++'s quantized collectives: qwZ's int8 weight all-gather and qgZ's hierarchical int4
gradient reduce-scatter (all-to-all inside the node, then across nodes).

Owns the data movement of these two collectives and their format choices. The block format and its
kernels belong to megazero.ops.quantize; the byte accounting to megazero.core.comm: codes and scales,
packed into one byte buffer (one collective moves both), travel through comm's own collectives, so
the comm log counts the bytes that actually move (codes, plus 4 bytes of fp32 scale per block).
This module decides nothing about *when* the collectives are used: the stage-3 parameter gather
(param_gather.py) calls `quantized_all_gather` for gathers from the primary partition under
`zero_quantized_weights`, and `PartitionedStorage.reduce_bucket` calls the reducer that
`quantized_gradient_reducer` builds under `zero_quantized_gradients`.

Formats (the ZeRO++ paper's choices):

- qwZ: int8, symmetric, blocks of 256. Every rank, the sender included, computes with the
  dequantized values, so all ranks of the group hold identical weights.
- qgZ: int4, symmetric, blocks of 128, on *both* hops: the intra-node all-to-all and the
  inter-node one. Between the hops the received chunks are dequantized and summed in fp32
  (`dequantize_reduce`), then quantized again. int4 on the inter-node hop is what brings the
  gradient traffic across nodes to a quarter of bf16's; int4 inside the node as well is the paper's
  and DeepSpeed's choice (the node links are fast, but the kernel then runs one format). Smaller
  blocks than qwZ's because int4 has 16x fewer levels: the error per element is half a step of
  max|block| / 7.

Memory: the kernels read each hop's chunks where they lie (the first hop's rows are strided views of
the bucket) and write codes and scales straight into the packed send buffer, and the sums go straight
into their destination; so a reduction holds its send and receive buffers (int4 codes and scales,
~0.53 bytes an element) and, over several nodes, the first hop's fp32 sum over the node (1/L of the
bucket), never an fp32 or int32 copy of the bucket.

Error (per block, from megazero.ops.quantize): |x - x'| <= scale / 2 plus a few fp32 ulps of the
block's largest magnitude, scale = max|block| / 127 (int8) or / 7 (int4); a bf16 output adds its own
rounding. qgZ's result carries one such error per hop: the intra-node hop's on each rank's
contribution, the inter-node hop's on each node's partial sum.

qgZ's chunk order. The shard group's N = L x P ranks are P nodes of L ranks, node-major (shard index
s = p * L + l; `node_local` holds the L ranks of this node, `cross_node` the P ranks at this rank's
position l on every node; both are checked against `shard`). Rank s must end with chunk s of the
summed bucket. Hop 1 sends to local peer j the chunks (p, j) of every node p; after summing what
it received, local rank l holds its node's partial sums of chunks (p, l). Hop 2 sends to node p's
rank the partial of chunk (p, l); summing gives chunk s = p * L + l over all N ranks.
"""

from __future__ import annotations

import torch

from megazero.core import comm, streams
from megazero.core.errors import UsageError
from megazero.ops.quantize import (
    dequantize_reduce,
    dequantize_rows,
    kernel_info,
    packed_row_bytes,
    packed_rows,
    quantize_rows,
    triton_info,
)
from .config import ZeroConfig
from .zero_groups import ZeroGroups

QWZ_BITS, QWZ_BLOCK = 8, 256
QGZ_BITS, QGZ_BLOCK = 4, 128
_FLOATS = (torch.float32, torch.bfloat16)


def quantized_all_gather(
    out: torch.Tensor,
    chunk: torch.Tensor,
    group: comm.Group,
    *,
    bits: int = QWZ_BITS,
    block_size: int = QWZ_BLOCK,
    async_op: bool = False,
) -> comm.Handle | None:
    """comm.all_gather's contract (rank i's `chunk` lands in chunk i of every rank's `out`), moving
    block-quantized codes and scales instead of the values: `out` receives the dequantized values
    of every rank's chunk, its own included, in its dtype (fp32 or bf16)."""
    comm.check_device("quantized_all_gather", group, "out", out)
    comm.check_device("quantized_all_gather", group, "chunk", chunk)
    if out.numel() != chunk.numel() * group.size:
        raise ValueError(
            f"quantized_all_gather: out has {out.numel()} elements, expected {chunk.numel()} x {group.size}"
        )
    if out.dtype not in _FLOATS or chunk.dtype not in _FLOATS or not out.is_contiguous():
        raise ValueError(
            f"quantized_all_gather: out ({out.dtype}) must be contiguous and out and chunk ({chunk.dtype}) fp32 or bf16"
        )
    if group.size == 1 or chunk.numel() == 0:
        out.view(-1).copy_(chunk.reshape(-1))  # nothing moves, so nothing is quantized
        return comm.local_handle(group, async_op)
    n = chunk.numel()
    row_bytes = packed_row_bytes(n, bits, block_size)
    # Made on the issuing stream (stage 3's prefetch), freed after the wait on the compute stream:
    # comm's Handle records both buffers there (torch's NCCL records none). The kernels write the
    # codes and scales straight into the send buffer and read them from the receive buffer.
    send = streams.label(
        torch.empty((1, row_bytes), dtype=torch.uint8, device=group.device), "qwZ send buffer (int8 codes and scales)"
    )
    quantize_rows(chunk.reshape(1, 1, n), packed_rows(send, n, bits, block_size))
    received = streams.label(
        torch.empty((group.size, row_bytes), dtype=torch.uint8, device=group.device),
        "qwZ receive buffer (int8 codes and scales)",
    )
    work = comm.all_gather(received, send, group, async_op=True)

    def dequantize_received():
        dequantize_rows(packed_rows(received, n, bits, block_size), out.view(group.size, n))

    handle = comm.Handle([work], then=dequantize_received)
    if async_op:
        return handle
    handle.wait()
    return None


def quantized_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    shard: comm.Group,
    node_local: comm.Group | None = None,
    cross_node: comm.Group | None = None,
    *,
    bits: int = QGZ_BITS,
    block_size: int = QGZ_BLOCK,
    async_op: bool = False,
) -> comm.Handle | None:
    """comm.reduce_scatter's contract (`input` holds shard.size equal chunks; chunk i, summed over
    the ranks, lands in rank i's `output`), reduced by two quantized all-to-all hops: inside the node,
    then across nodes (see the module docstring). Without node groups, or with one node, it is a
    single hop over `shard`. The sum is taken in fp32 and written in output's dtype.

    Everything is queued now on the current stream (the reduce stream when ZeRO calls it): the
    first hop, a stream wait for it, its sum, the second hop, a wait, the final sum into `output`.
    The handle (async_op) carries an event after the last sum, so the stream that waits for it
    waits for nothing else, and no hop is issued or waited on that stream. (Under NCCL the waits
    are stream waits; gloo's waits block the host, so on CPU the first hop completes before this
    returns.)"""
    node_local, cross_node = _check_node_groups(shard, node_local, cross_node)
    return _reduce_scatter(output, input, shard, node_local, cross_node, bits, block_size, async_op)


def _reduce_scatter(output, input, shard, node_local, cross_node, bits, block_size, async_op):
    """quantized_reduce_scatter over node groups already checked to be shard's node-major split."""
    for what, tensor in (("output", output), ("input", input)):
        comm.check_device("quantized_reduce_scatter", shard, what, tensor)
        if tensor.dtype not in _FLOATS:
            raise ValueError(f"quantized_reduce_scatter: {what} is {tensor.dtype}; use fp32 or bf16")
    if input.numel() != output.numel() * shard.size:
        raise ValueError(
            f"quantized_reduce_scatter: input has {input.numel()} elements, expected {output.numel()} x {shard.size}"
        )
    if shard.size == 1:
        output.copy_(input.view_as(output))
        return comm.local_handle(shard, async_op)
    locals_, nodes, chunk = node_local.size, cross_node.size, output.numel()
    # Row j (for local peer j): chunks (p, j) of every node p, node after node, read where they lie.
    rows = input.reshape(nodes, locals_, chunk).transpose(0, 1)
    intra = _QuantizedAllToAll(rows, node_local, bits, block_size)
    if nodes == 1:  # one node: the first hop's sum is the result
        intra.reduce_into(output.view(-1))
        return comm.local_handle(shard, async_op)
    node_sums = torch.empty(nodes * chunk, dtype=torch.float32, device=input.device)  # chunks (p, l)
    intra.reduce_into(node_sums)
    _QuantizedAllToAll(node_sums.view(nodes, 1, chunk), cross_node, bits, block_size).reduce_into(output.view(-1))
    return comm.local_handle(shard, async_op)


def quantized_gradient_reducer(groups: ZeroGroups, bits: int = QGZ_BITS, block_size: int = QGZ_BLOCK):
    """The qgZ reduction for a storage over `groups.shard`: a function (output, input) -> Handle,
    called as reduce_bucket calls comm.reduce_scatter (async). The node groups, and on the CPU the
    C++ kernels' build, are checked now rather than at the first reduction."""
    shard = groups.shard
    node_local, cross_node = _check_node_groups(shard, groups.node_local, groups.cross_node)
    # A UsageError naming the build command (CPU) or Triton's install (GPU) when the kernels are missing.
    kernel_info() if shard.device.type == "cpu" else triton_info(shard.device)

    def reduce(output: torch.Tensor, input: torch.Tensor) -> comm.Handle:
        # Once per bucket and microbatch, on the reduce stream: the groups were checked above.
        return _reduce_scatter(output, input, shard, node_local, cross_node, bits, block_size, True)

    return reduce


class _QuantizedAllToAll:
    """Row j of `rows` ([group.size, segments, elements], any strides: row j is rows[j] in order, m
    values) quantized straight into row j of a packed send buffer and sent to the group's rank j;
    `reduce_into(out)` waits, then writes the fp32 sum of the rows received from every rank, in rank
    order, into `out` (m elements, fp32 or bf16, rounded once). A group of one sends nothing and
    quantizes nothing. Each row is quantized as its own tensor: its last block may be short."""

    def __init__(self, rows: torch.Tensor, group: comm.Group, bits: int, block_size: int):
        self.group, self.m = group, rows.shape[1] * rows.shape[2]
        self.format = (self.m, bits, block_size)
        if group.size == 1:
            self.local, self.handle = rows[0], comm.local_handle(group)
            return
        send = torch.empty((group.size, packed_row_bytes(*self.format)), dtype=torch.uint8, device=rows.device)
        quantize_rows(rows, packed_rows(send, *self.format))
        self.received = torch.empty_like(send)
        self.handle = comm.all_to_all(self.received, send, group, async_op=True)

    def reduce_into(self, out: torch.Tensor) -> None:
        self.handle.wait()
        if self.group.size == 1:
            out.view(self.local.shape).copy_(self.local)
            return
        dequantize_reduce(packed_rows(self.received, *self.format), out=out)


def _check_node_groups(
    shard: comm.Group, node_local: comm.Group | None, cross_node: comm.Group | None
) -> tuple[comm.Group, comm.Group]:
    """(node_local, cross_node) for qgZ over `shard`, checked to be its node-major split; without
    node groups the whole shard group acts as one node."""
    if node_local is None and cross_node is None:
        alone = comm.Group("cross_node", (shard.ranks[shard.rank],), 0, None, True, shard.log, shard.device)
        return shard, alone
    if node_local is None or cross_node is None:
        raise ValueError("qgZ needs both node groups (node_local and cross_node) or neither")
    locals_, s = node_local.size, shard.rank
    p, l = divmod(s, locals_)
    want_local, want_cross = shard.ranks[p * locals_ : (p + 1) * locals_], shard.ranks[l::locals_]
    if locals_ * cross_node.size != shard.size:
        raise UsageError(
            f"zero_quantized_gradients needs the shard group {list(shard.ranks)} to have the "
            f"same number of ranks on every node it spans (this node has {locals_}); change "
            f"ranks_per_node or mics_shard_size"
        )
    if (
        tuple(node_local.ranks) != tuple(want_local)
        or tuple(cross_node.ranks) != tuple(want_cross)
        or node_local.rank != l
        or cross_node.rank != p
    ):
        raise ValueError(
            f"qgZ: node groups {node_local} and {cross_node} are not the node-major split of "
            f"{shard} (expected node_local ranks {list(want_local)}, cross_node ranks "
            f"{list(want_cross)})"
        )
    return node_local, cross_node


def stage3_inter_node_bytes(
    zero: ZeroConfig, elements: int, shard: int, nodes: int, weight_bytes: float, reduce_bytes: float
) -> float:
    """Bytes one rank moves across nodes per step at stage 3, by the comm log's convention (a
    collective over a group spanning nodes counts (size-1) chunks of `elements`, this rank's
    partition), for one microbatch with every unit gathered before its forward and again before its
    backward, over a shard group of `shard` ranks spread evenly over `nodes` nodes:
      gathers    (shard-1) chunks each flat, (nodes-1) in two hops; int8 codes + scales with qwZ
                 (only the cross-node hop, in two hops); the backward's gather stays in the node
                 under hpZ
      reduction  (shard-1) chunks by reduce-scatter; qgZ crosses nodes once, (nodes-1) chunks of
                 int4 codes + scales, already summed over the node"""
    q8, q4 = 1 + 4 / QWZ_BLOCK, 0.5 + 4 / QGZ_BLOCK
    hops = nodes - 1 if zero.mics_hierarchical_params_gather else shard - 1
    gather = hops * elements * (q8 if zero.zero_quantized_weights else weight_bytes)
    gathers = gather if zero.zero_hpz_partition_size > 1 else 2 * gather
    reduction = (nodes - 1) * elements * q4 if zero.zero_quantized_gradients else (shard - 1) * elements * reduce_bytes
    return gathers + reduction
