"""qwZ's and qgZ's GPU-minded paths against the ones they replaced, bitwise.

- qwZ's receive side dequantizes every rank's row of the packed receive buffer in one call
  (`dequantize_rows`, reading codes and scales where they lie) instead of unpacking each: bitwise
  the row-by-row C++ result and the row-by-row torch reference, int8 and int4, rows of whole blocks
  and with a tail, fp32 and bf16 out.
- qgZ queues both hops and their sums on the current stream at once: bitwise the previous schedule
  (second hop issued when the handle was waited), at nodes of 2 over 4 ranks.
- In a stage-3 qgZ step under the stream checker every all-to-all of the reduction is issued from
  the reduce stream (before, the second hop was issued from the compute stream at the wait).
"""

import dataclasses

import pytest
import torch

from tests.layouts import run_training, small_config
from megazero.core import comm, streams
from megazero.core.stream_check import checking
from megazero.ops.quantize import (
    dequantize,
    dequantize_reference,
    dequantize_rows,
    packed_row_bytes,
    packed_rows,
    quantize,
    quantize_rows,
)
from megazero.parallel.topology import Topology
from megazero.zero import quantized_comm
from megazero.zero.quantized_comm import QGZ_BLOCK, _QuantizedAllToAll
from tests.zero.test_quantized_comm import node_groups, rank_input


@pytest.mark.parametrize("bits,block", [(8, 256), (4, 128)])
@pytest.mark.parametrize("numel", [256, 300, 1], ids=["whole-blocks", "tail", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_dequantized_at_once_equal_row_by_row(bits, block, numel, dtype):
    ranks = 4
    received = torch.empty(ranks, packed_row_bytes(numel, bits, block), dtype=torch.uint8)
    for r in range(ranks):  # what the all-gather delivers
        quantize_rows(
            rank_input(r, numel, torch.float32).view(1, 1, -1), packed_rows(received[r : r + 1], numel, bits, block)
        )
    gathered = packed_rows(received, numel, bits, block)
    rows = torch.empty(ranks, numel, dtype=dtype)
    dequantize_rows(gathered, rows)
    for r in range(ranks):
        row = dataclasses.replace(
            gathered, codes=gathered.codes[r].contiguous(), scales=gathered.scales[r].contiguous()
        )
        assert torch.equal(row.codes, quantize(rank_input(r, numel, torch.float32), bits, block).codes)
        assert torch.equal(rows[r], dequantize(row, dtype)), f"row {r}: C++ kernel"
        assert torch.equal(rows[r], dequantize_reference(row, dtype)), f"row {r}: torch reference"


def lazy_reduce_scatter(output, input, shard, node_local, cross_node, bits=4, block_size=QGZ_BLOCK):
    """qgZ's previous schedule, the one this test compares with: the first hop issued at once, the
    second hop and both sums when the handle is waited."""
    locals_, nodes, chunk = node_local.size, cross_node.size, output.numel()
    rows = input.reshape(nodes, locals_, chunk).transpose(0, 1)
    intra = _QuantizedAllToAll(rows, node_local, bits, block_size)

    def reduce_across_nodes():
        node_sums = torch.empty(nodes * chunk)
        intra.reduce_into(node_sums)
        _QuantizedAllToAll(node_sums.view(nodes, 1, chunk), cross_node, bits, block_size).reduce_into(output)

    comm.Handle([intra.handle], then=reduce_across_nodes).wait()


def schedules_worker(ctx):
    groups = node_groups(ctx, 4, 2, comm.CommLog())
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for chunk in (37, QGZ_BLOCK, 300):
            data = rank_input(ctx.rank, 4 * chunk, dtype)
            chained, lazy = torch.empty(chunk, dtype=dtype), torch.empty(chunk, dtype=dtype)
            quantized_comm.quantized_reduce_scatter(
                chained, data, groups["shard"], groups["node_local"], groups["cross_node"], async_op=True
            ).wait()
            lazy_reduce_scatter(lazy, data, groups["shard"], groups["node_local"], groups["cross_node"])
            out.append(torch.equal(chained, lazy))
    return out


def issuing_streams_worker(ctx):
    groups = ctx.groups(Topology(world_size=4, ranks_per_node=2))
    issued = []
    all_to_all = comm.all_to_all

    def recording(output, input, group, async_op=False):
        issued.append(streams.checker_for("cpu").current.name)
        return all_to_all(output, input, group, async_op)

    comm.all_to_all = recording
    try:
        cfg = small_config(stage=3, steps=1, layers=2, global_batch=8, zero_extra={"zero_quantized_gradients": True})
        with checking():
            run_training(cfg, groups)
    finally:
        comm.all_to_all = all_to_all
    return issued


def test_qgz_chained_equals_the_previous_schedule_and_issues_on_the_reduce_stream(dist_pool):
    pool = dist_pool(4)
    assert all(all(r) for r in pool.run(schedules_worker))
    for issued in pool.run(issuing_streams_worker):
        assert issued and set(issued) == {"reduce"}, issued
