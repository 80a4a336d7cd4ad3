"""The CPU stream sanitizer (megazero.core.stream_check): the rules it enforces, the races it found, and
the layout grid running clean under it.

- Rules: read-after-write, write-after-read, write-after-write and use-after-free are each named
  with the tensor, its label, both streams and both call sites; events, host synchronisation,
  record_stream (keep_alive) and collectives' handles order streams as they do on CUDA.
- NCCL as torch runs it (`nccl_semantics`): from torch 2.8 an async collective's tensors are held
  until its wait and recorded on no stream, the wait orders only the waiting stream, and a sync
  collective runs on the current stream; before 2.8 every tensor was recorded on NCCL's stream. The
  three-stream case (allocate on A, gather from B, wait on C, free, reallocate on A and write) is
  flagged under the first and clean under the second, and clean under both with comm's fix (the
  Handle records its tensors on the waiting stream).
- Races of torch >= 2.8, each put back by turning that fix off and named with the tensor and both
  call sites: ZeRO-3 with offload_param (the chunk copied on the copy stream, gathered from the
  prefetch stream), qwZ (the send buffer packed on the prefetch stream), and gloo's in-place
  reduce-scatter temporary (made on the reduce stream, freed after main's wait).
- Races, each reintroduced by monkeypatching its fix away, and named: a stage-3 gather on a group
  of one (one GPU, dp 1 under TP/PP, MiCS shards of 1) copied on the prefetch stream and handed the
  forward a handle with no event; the dp 1 bf16 reduce-scatter read on the compute stream with no
  wait. Both failed this file's grid on the code before the fix. Also: a gathered unit freed
  without keep_alive, a reduction that skips its wait for the backward, a prefetch that skips its
  wait for the optimizer step.
- The grid (NCCL as torch >= 2.8 runs it): stages 0-3 on groups of one
  and of several ranks, MiCS (shards of 2, and of 1: groups of one beside a replica all-reduce), the
  two-hop gather, hpZ, qwZ/qgZ (qgZ's hops chained on the reduce stream), both offload tiers of
  parameters and optimizer at dp >= 2, ZenFlow's CPU thread, PP with overlapped p2p, CP's ring and
  all-to-all, an async checkpoint save, bf16 with
  the reduction in bf16, stage 1/2 reductions overlapped with backward (the default) and waited
  bucket by bucket (overlap_comm false): every layout trains two steps under the checker with no
  violation.
"""

import contextlib
import os
import re
import time
import weakref

import pytest
import torch

from tests.layouts import run_training, setup_training, small_config, with_padded_vocab
from megazero.core import comm, kernels, streams
from megazero.parallel.process_groups import ProcessGroups
from megazero.parallel.topology import Topology
from megazero.core.stream_check import RECORD_STREAM, STASH, StreamOrderError, checking, nccl_semantics
from megazero.core.streams import Event, Streams, label

HERE = "tests/core/test_stream_check.py"


def _one(name="solo"):
    return comm.Group(name, (0,), 0, None, True, comm.CommLog(), torch.device("cpu"))


# --- the rules -------------------------------------------------------------------------------------
def test_each_race_names_the_tensor_both_streams_and_both_sites():
    with checking():
        s = Streams("cpu")
        with s.prefetch:
            x = label(torch.ones(4), "demo buffer")
        with pytest.raises(
            StreamOrderError,
            match=(
                rf"read-after-write race on a float32 tensor of shape \(4,\) \(demo buffer\): written on "
                rf"stream 'prefetch' at {HERE}:\d+ \(test_each.*\), then read on stream 'main' at {HERE}"
            ),
        ):
            x.sum()
        y = torch.ones(4)
        with s.reduce:
            s.reduce.wait_current()
            y.sum()  # read on reduce ...
        with pytest.raises(
            StreamOrderError, match="write-after-read race .* read on stream 'reduce'.* written on stream 'main'"
        ):
            y.fill_(2.0)  # ... overwritten on main before it waited
        z = torch.ones(4)
        with s.copy:
            s.copy.wait_current()
            z.fill_(3.0)
        with pytest.raises(StreamOrderError, match="write-after-write race .* stream 'copy'"):
            z.zero_()


def test_events_host_syncs_and_disjoint_bytes_order_nothing_wrongly():
    with checking() as checker:
        s = Streams("cpu")
        with s.prefetch:
            x = torch.ones(8)
        s.prefetch.current_waits()  # main waits for prefetch: ordered
        x.add_(1)
        with s.reduce:
            s.reduce.wait_current()
            x[:4].mul_(2)  # reduce writes one half ...
        x[4:].mul_(3)  # ... main the other: no overlap
        done = Event("cpu").record(s.reduce)
        done.synchronize()  # the host waited: everything after is ordered
        x[:4].sum()
        with s.copy:
            s.copy.wait_current()
            y = torch.zeros(2).add_(1)
        with pytest.raises(StreamOrderError, match="read-after-write"):
            y.sum()  # main never waited for copy's write
        v = torch.zeros(2).add_(1)
        float(v.sum())  # .item(): the host waited for main's work
        with s.copy:
            v.mul_(2)  # so copy may overwrite what main wrote
    assert checker.side_ops >= 5 and checker.violations == 1
    assert checker.summary() == (
        f"stream check (NCCL as torch >= 2.8: async ops' tensors stashed until "
        f"wait): {checker.side_ops} side-stream ops checked, 1 violations"
    )


def test_a_buffer_freed_under_another_stream_needs_keep_alive():
    with checking():
        s = Streams("cpu")
        with s.prefetch:
            kept = label(torch.ones(4), "kept")
        s.prefetch.current_waits()
        kept.sum()  # read on main, allocated on prefetch
        s.prefetch.keep_alive(kept)
        del kept  # recorded on main: fine
        torch.ones(1)
        with s.prefetch:
            lost = label(torch.ones(4), "lost")
        s.prefetch.current_waits()
        lost.sum()
        del lost  # prefetch would reuse it under main's read
        with pytest.raises(
            StreamOrderError,
            match=rf"use-after-free of a float32 tensor of shape \(4,\) "
            rf"\(lost\): freed at {HERE}:\d+ .* back with stream "
            rf"'prefetch' .* the read on stream 'main'",
        ):
            torch.ones(1)  # raised at the next op after the free
        with s.prefetch:
            resized = torch.ones(4)
        s.prefetch.current_waits()
        resized.sum()
        with pytest.raises(StreamOrderError, match="use-after-free"):
            kernels.resize_storage(resized.untyped_storage(), 0)  # a release (the library's seam) frees at once


def test_a_recorded_stream_holds_the_block_for_what_it_is_ordered_after():
    """record_stream(t, C) keeps t's block from its allocating stream until C has passed the point C had
    reached at the free: an access on another stream B is covered when C waited for it, not otherwise."""
    with checking():
        s = Streams("cpu")
        with s.copy:
            held = label(torch.ones(4), "held")
            lost = label(torch.ones(4), "lost")
        with s.prefetch:
            s.prefetch.wait_current()
            Event("cpu").record(s.copy).wait(s.prefetch)
            held.sum(), lost.sum()  # read on prefetch
        s.prefetch.current_waits()  # main is ordered after those reads
        streams.record_on_current_stream(held)  # ... and recorded: covers prefetch's read
        del held
        torch.ones(1)
        s.copy.keep_alive(lost)  # copy and main recorded, but before main waited
        with s.prefetch:
            lost.sum()  # a second read, that main never waits for
        del lost
        with pytest.raises(
            StreamOrderError,
            match=r"use-after-free .* \(lost\): .* back with stream 'copy'.* "
            r"read on stream 'prefetch'",
        ):
            torch.ones(1)


def test_nccl_semantics_follow_the_torch_version():
    assert nccl_semantics("2.7.1+cu126") == RECORD_STREAM
    assert nccl_semantics("2.8.0") == STASH and nccl_semantics("2.11.0+cu130") == STASH
    assert nccl_semantics() == (
        STASH if torch.torch_version.TorchVersion(torch.__version__) >= (2, 8) else RECORD_STREAM
    )
    with pytest.raises(ValueError, match="semantics must be"):
        with checking("record_streams"):
            pass


def test_a_handle_orders_its_waiter_after_the_op_groups_of_one_included():
    with checking():
        s = Streams("cpu")
        out, src = torch.zeros(4), torch.ones(4)
        with s.prefetch:
            s.prefetch.wait_current()  # out and src were written on main
            handle = comm.all_gather(out, src, _one(), async_op=True)
        handle.wait()  # the waiting stream (main) waits for it
        out.sum()
        with s.prefetch:
            s.prefetch.wait_current()
            comm.all_gather(out, src, _one(), async_op=True)
        with pytest.raises(StreamOrderError, match="read-after-write .* stream 'prefetch'"):
            out.sum()  # its handle was never waited


def collective_rules_worker(ctx):
    """Pool entry (2 ranks): a collective runs on its communicator's stream after the issuing
    stream's work; reading its output before the handle's wait is a race, after it is not."""
    group = ctx.groups(Topology(world_size=2)).dp
    with checking() as checker:
        s = Streams("cpu")
        x = torch.full((4,), float(ctx.rank))
        with s.reduce:
            s.reduce.wait_current()
            handle = comm.all_reduce(x, group, async_op=True)
        handle.wait()
        assert x.tolist() == [1.0] * 4
        with s.reduce:
            s.reduce.wait_current()
            comm.all_reduce(x, group, async_op=True)
        try:
            x.sum()
            caught = None
        except StreamOrderError as err:
            caught = str(err)
    return caught, checker.side_ops


def test_collectives_run_on_their_communicator_stream(dist_pool):
    for caught, side_ops in dist_pool(2).run(collective_rules_worker):
        assert caught is not None and "read-after-write" in caught and "communicator" in caught, caught
        assert side_ops >= 2


@contextlib.contextmanager
def _handles_record_nothing():
    """comm's fix taken out: a Handle lets its tensors go at the wait without recording them."""
    record = comm.record_on_waiting_stream
    comm.record_on_waiting_stream = lambda tensors: None
    try:
        yield
    finally:
        comm.record_on_waiting_stream = record


def _until_freed(storage_ref, timeout: float = 60.0) -> None:
    """Until the storage is gone (a backend thread may drop the last reference after the host)."""
    deadline = time.monotonic() + timeout
    while storage_ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)


def three_streams_worker(ctx, semantics: str, fixed: bool):
    """Pool entry (2 ranks): a buffer allocated on A (copy), all-gathered from B (prefetch), waited
    on C (main), freed, then A allocates and writes. Returns (the violation or None, side-stream ops
    of a sync all-reduce on main)."""
    group = ctx.groups(Topology(world_size=2)).dp
    with contextlib.ExitStack() as stack:
        if not fixed:
            stack.enter_context(_handles_record_nothing())
        checker = stack.enter_context(checking(semantics))
        s = Streams("cpu")
        with s.copy:
            chunk = label(torch.full((4,), float(ctx.rank)), "three-stream chunk")
        s.copy.current_waits()
        with s.prefetch:
            s.prefetch.wait_current()
            out = torch.empty(8)
            handle = comm.all_gather(out, chunk, group, async_op=True)
        chunk_alive = weakref.ref(chunk.untyped_storage())
        del chunk  # held by the handle until its wait
        handle.wait()  # on main
        s.prefetch.keep_alive(out)
        assert out.tolist() == [0.0] * 4 + [1.0] * 4
        caught = None
        try:
            del handle  # our last reference to the chunk
            _until_freed(chunk_alive)  # gloo's thread may still hold one a moment
            with s.copy:
                torch.empty(4).fill_(7.0)  # A's next allocation, written
        except StreamOrderError as err:
            caught = str(err)
        before = checker.side_ops
        x = torch.ones(2)
        comm.all_reduce(x, group)  # sync: on main itself, nothing to wait for
        x.sum()
        return caught, checker.side_ops - before


def test_three_streams_freed_after_a_wait_elsewhere(dist_pool):
    """The three-stream case under each NCCL model, with and without comm's fix."""
    for semantics, fixed in ((STASH, False), (STASH, True), (RECORD_STREAM, False)):
        results = dist_pool(2).run(three_streams_worker, semantics, fixed)
        for caught, sync_side_ops in results:
            if semantics == STASH and not fixed:
                assert caught is not None and re.search(
                    r"use-after-free of a float32 tensor of shape \(4,\) \(three-stream chunk\): freed at "
                    rf"({HERE}:\d+ \(three_streams_worker\)|\(thread [^)]*\)), its memory back with stream 'copy' .* read on stream "
                    rf"'.* communicator' at {HERE}:\d+ \(three_streams_worker\)",
                    caught,
                ), caught
            else:
                assert caught is None, (semantics, fixed, caught)
            # Sync ops: on main under torch >= 2.8; on the communicator's stream before.
            assert sync_side_ops == (0 if semantics == STASH else 1), (semantics, sync_side_ops)


# --- the races it found ----------------------------------------------------------------------------
def _checked_steps(cfg, steps=1):
    cfg.train_iters = steps
    with checking():
        return run_training(cfg, ProcessGroups.single())


def _without_local_events(monkeypatch):
    """The code before the fix: a group of one's op handed back a handle without an event."""
    monkeypatch.setattr(comm, "local_handle", lambda group, async_op=True: comm.Handle() if async_op else None)


def test_stage3_gather_on_a_group_of_one_needs_its_event(monkeypatch):
    _without_local_events(monkeypatch)
    with pytest.raises(
        StreamOrderError,
        match=r"read-after-write race on a float32 tensor of shape \(\d+, "
        r"\d+\) \(stage-3 unit '.*', gathered parameters\): written on "
        r"stream 'prefetch' .* read on stream 'main'",
    ):
        _checked_steps(small_config(stage=3, layers=2, global_batch=2))


def test_bf16_reduce_scatter_on_a_group_of_one_needs_its_event(monkeypatch):
    _without_local_events(monkeypatch)
    with pytest.raises(
        StreamOrderError,
        match=r"read-after-write race on a bfloat16 tensor .* \(bucket \d+: "
        r"reduce-scatter output\): written on stream 'reduce' .* read "
        r"on stream 'main' at megazero/zero/flat_group.py",
    ):
        _checked_steps(_bf16(small_config(stage=1, layers=2, global_batch=2)))


def test_a_gathered_unit_freed_without_keep_alive_is_caught(monkeypatch):
    keep_alive = streams.SideStream.keep_alive

    def keep_all_but_units(side, tensor):
        what = streams.checker_for("cpu").label_of(tensor) or ""
        return tensor if what.startswith("stage-3 unit") else keep_alive(side, tensor)

    monkeypatch.setattr(streams.SideStream, "keep_alive", keep_all_but_units)
    with pytest.raises(
        StreamOrderError,
        match=r"use-after-free of a float32 tensor .* \(stage-3 unit .*\): "
        r"freed at megazero/zero/stage3/units.py:\d+ \(release\).* back "
        r"with stream 'prefetch'",
    ):
        _checked_steps(small_config(stage=3, layers=2, global_batch=2))


def test_a_reduction_that_does_not_wait_for_the_backward_is_caught(monkeypatch):
    from megazero.zero.storage import PartitionedStorage

    @contextlib.contextmanager
    def reduce_stream_without_wait(storage):
        with storage.streams.reduce as side:
            yield side

    monkeypatch.setattr(PartitionedStorage, "reduce_stream", reduce_stream_without_wait)
    # The first casualty: the reduction's output, allocated on main (its memory may be a block main's
    # queued work still uses) and written on reduce.
    with pytest.raises(
        StreamOrderError,
        match=r"write-after-write race .* \(bucket \d+: reduce-scatter "
        r"output\): written on stream 'main' .* written on stream "
        r"'reduce'",
    ):
        _checked_steps(_bf16(small_config(stage=1, layers=2, global_batch=2)))


def unrecorded_races_worker(ctx):
    """Pool entry (2 ranks): the layouts whose buffers torch >= 2.8's NCCL leaves unrecorded, trained
    with comm's fix taken out; the violation each raises, or None."""
    layouts = [
        ("offload_param", 3, {"offload_param": {"device": "cpu"}}),
        ("qwZ", 3, {"zero_quantized_weights": True}),
        ("in-place reduce-scatter on gloo", 1, {}),
    ]
    found = {}
    for name, stage, extra in layouts:
        cfg = with_padded_vocab(_grid_config(stage, dp=2, zero_extra=extra))
        found[name] = []
        with _handles_record_nothing():
            checked_layout(ctx, name, 2, {}, cfg, None, found=found[name])
    return found


def test_races_torch_2_8_nccl_leaves_are_fixed_by_the_handle(dist_pool):
    """With the Handle's recording taken out, each path's buffer is freed back to the stream that made
    it while the communicator may still read it; the message names the buffer, the free and the
    collective. The grid below runs the same layouts clean with it. Each rank collects its violations
    and trains every layout to its end: where gloo's thread drops a buffer's last reference decides
    on which rank (and whether at the host's free or the thread's) the race shows, so a rank that
    stopped at its first one would leave its peer mid-collective and the next layout's collectives
    paired with the wrong ones (seen under load: ZeRO-3's 'ranks of the shard group diverge'). A path
    is caught when either rank names it."""
    per_rank = dist_pool(2).run(unrecorded_races_worker)
    found = {name: "\n".join(m for rank in per_rank for m in rank[name]) or None for name in per_rank[0]}
    # Freed where the handle lets its tensors go, or where gloo's own thread drops its last reference.
    free_site = r"freed at (megazero/zero/stage3/units.py:\d+ \(wait_gather\)|\(thread [^)]*\))"
    assert re.search(
        r"use-after-free of a float32 tensor of shape \(\d+,\) \(stage-3 unit '.*': this rank's "
        rf"chunk, copied from its offload home\): {free_site}, its memory back with stream 'copy' "
        r".* read on stream '.*shard_gather communicator' at megazero/zero/stage3/param_gather.py:"
        r"\d+ \(_all_gather\)",
        found["offload_param"] or "",
    ), found["offload_param"]
    assert re.search(
        r"use-after-free of a uint8 tensor of shape \(1, \d+\) \(qwZ send buffer \(int8 codes and "
        rf"scales\)\): {free_site}, its memory back with stream 'prefetch' .* read on stream "
        r"'.*shard_gather communicator' at megazero/zero/quantized_comm.py:\d+ "
        r"\(quantized_all_gather\)",
        found["qwZ"] or "",
    ), found["qwZ"]
    assert re.search(
        r"use-after-free of a float32 tensor .* freed at megazero/zero/storage.py:\d+ .* back with "
        r"stream 'reduce'",
        found["in-place reduce-scatter on gloo"] or "",
    ), found


def test_a_prefetch_that_does_not_wait_for_the_optimizer_step_is_caught(monkeypatch):
    wait = Event.wait

    def no_waits_on_prefetch(event, stream=None):
        if stream is not None or streams.checker_for("cpu").current.name != "prefetch":
            wait(event, stream)

    monkeypatch.setattr(Event, "wait", no_waits_on_prefetch)
    with pytest.raises(
        StreamOrderError,
        match=r"read-after-write race .* \(stage-3 parameter partition\): "
        r"written on stream 'main' .* read on stream 'prefetch'",
    ):
        _checked_steps(small_config(stage=3, layers=2, global_batch=2), steps=2)


# --- the grid ----------------------------------------------------------------------------------------
def _grid_config(stage=3, dp=1, layers=2, **kw):
    """Two steps of two microbatches per rank."""
    return small_config(stage=stage, steps=2, layers=layers, global_batch=4 * dp, **kw)


def _bf16(cfg):
    cfg.precision.bf16, cfg.precision.reduce_dtype = True, "bf16"
    return cfg


def _overlapped(cfg):
    cfg.parallel.overlap_p2p_comm = True
    return cfg


def grid(tmp: str) -> list:
    """(name, world size, Topology keywords, config, async save directory or None)."""
    nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, "swap"), "buffer_count": 2}
    nodes = dict(ranks_per_node=2)
    return [
        ("stage 0 one rank", 1, {}, _grid_config(0), None),
        ("stage 1 bf16 reduce in bf16 one rank", 1, {}, _bf16(_grid_config(1)), None),
        ("stage 2 bf16 reduce in bf16 one rank", 1, {}, _bf16(_grid_config(2)), None),
        ("stage 3 one rank", 1, {}, _grid_config(3), None),
        (
            "stage 3 qwZ one rank, params and optimizer on cpu",
            1,
            {},
            _grid_config(
                3,
                zero_extra={
                    "zero_quantized_weights": True,
                    "offload_param": {"device": "cpu"},
                    "offload_optimizer": {"device": "cpu"},
                },
            ),
            None,
        ),
        ("stage 0 dp 4", 4, {}, _grid_config(0, dp=4), None),
        ("stage 1 dp 4 bf16 reduce in bf16", 4, {}, _bf16(_grid_config(1, dp=4)), None),
        ("stage 2 dp 4, optimizer on nvme", 4, {}, _grid_config(2, dp=4, zero_extra={"offload_optimizer": nvme}), None),
        ("stage 1 dp 4 fp32, reductions overlapped in place", 4, {}, _grid_config(1, dp=4), None),
        ("stage 2 dp 4 bf16, reductions overlapped", 4, {}, _grid_config(2, dp=4, bf16=True), None),
        ("stage 2 dp 2 MiCS 1 bf16 reduce in bf16, overlapped", 2, {}, _bf16(_grid_config(2, dp=2, mics=1)), None),
        (
            "stage 1 dp 4, reductions waited (overlap_comm false)",
            4,
            {},
            _grid_config(1, dp=4, zero_extra={"overlap_comm": False}),
            None,
        ),
        (
            "stage 3 dp 4 MiCS 2 bf16, async checkpoint save",
            4,
            {},
            _bf16(_grid_config(3, dp=4, mics=2)),
            os.path.join(tmp, "ckpt"),
        ),
        (
            "stage 3 dp 4 nodes of 2: two hops, hpZ 2, qwZ, qgZ",
            4,
            dict(nodes, hpz_partition_size=2),
            _grid_config(
                3,
                dp=4,
                zero_extra={
                    "mics_hierarchical_params_gather": True,
                    "zero_hpz_partition_size": 2,
                    "zero_quantized_weights": True,
                    "zero_quantized_gradients": True,
                },
            ),
            None,
        ),
        (
            "stage 3 dp 4 MiCS shards of 1, layer units",
            4,
            {},
            _grid_config(3, dp=4, mics=1, zero_extra={"stage3_granularity": "layer"}),
            None,
        ),
        (
            "stage 3 tp 2 dp 2, params on nvme",
            4,
            {},
            _grid_config(3, tp=2, dp=2, zero_extra={"offload_param": nvme}),
            None,
        ),
        # update_interval "auto" with auto_ratio 0 ends every window (the CPU Adam thread runs each step)
        # through the window decision's reductions.
        (
            "stage 3 dp 2 bf16 ZenFlow auto, CPU Adam thread overlapped",
            2,
            {},
            _bf16(
                _grid_config(
                    3,
                    dp=2,
                    zero_extra={
                        "offload_optimizer": {"device": "cpu"},
                        "zenflow": {
                            "topk_ratio": 0.5,
                            "update_interval": "auto",
                            "auto_ratio": 0.0,
                            "overlap_step": True,
                        },
                    },
                )
            ),
            None,
        ),
        (
            "stage 3 pp 2 dp 2 1f1b, overlapped p2p",
            4,
            {},
            _overlapped(_grid_config(3, pp=2, dp=2, schedule="1f1b")),
            None,
        ),
        (
            "stage 1 pp 2 tp 2 interleaved, overlapped p2p",
            4,
            {},
            _overlapped(_grid_config(1, pp=2, tp=2, layers=4, virtual=2, schedule="interleaved")),
            None,
        ),
        (
            "stage 3 dp 2, params and optimizer on cpu",
            2,
            {},
            _grid_config(
                3, dp=2, zero_extra={"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
            ),
            None,
        ),
        (
            "stage 3 dp 2 bf16 qwZ",
            2,
            {},
            _bf16(_grid_config(3, dp=2, zero_extra={"zero_quantized_weights": True})),
            None,
        ),
        (
            "stage 3 dp 2 params on nvme, qwZ",
            2,
            {},
            _grid_config(3, dp=2, zero_extra={"offload_param": nvme, "zero_quantized_weights": True}),
            None,
        ),
        (
            "stage 3 cp 2 dp 2 ring attention, params on cpu",
            4,
            {},
            _grid_config(3, dp=2, cp=2, zero_extra={"offload_param": {"device": "cpu"}}),
            None,
        ),
        ("stage 2 cp 2 dp 2 all-to-all", 4, {}, _grid_config(2, dp=2, cp=2, cp_comm_type="a2a"), None),
    ]


def checked_layout(ctx, name, world, topology, cfg, save_dir, found: list | None = None):
    """Trains `cfg` under the checker on the first `world` ranks; returns (name, side-stream ops,
    losses) or None off the layout. With `save_dir`, an async checkpoint save follows step 1 and is
    committed after step 2. With `found`, violations are collected there and training goes on (every
    rank ends the layout at the same collective), else the first one raises."""
    from megazero.checkpoint import CheckpointSaver
    from megazero.training import train_step

    par = cfg.parallel
    if ctx is None:
        groups = ProcessGroups.single()
    else:
        groups = ctx.groups(
            Topology(
                world_size=world,
                tp=par.tensor_parallel,
                pp=par.pipeline_parallel,
                cp=par.context_parallel,
                mics_shard_size=cfg.zero.mics_shard_size,
                **topology,
            )
        )
        if groups is None:
            return None
    cfg = with_padded_vocab(cfg)
    losses = []
    with checking(collect=found is not None) as checker:
        state, source = setup_training(cfg, groups)
        saver = CheckpointSaver(save_dir, "grid", async_save=True) if save_dir else None
        for it in range(cfg.train_iters):
            losses.append(train_step(state, source.batch(it), 1e-3).loss)
            if saver is not None and it == 0:
                saver.save(state, cfg.global_batch_size)
        if saver is not None:
            saver.finalize()
    if found is not None:
        found.extend(checker.found)
    return name, checker.side_ops, losses


def grid_worker(ctx, layouts):
    return [checked_layout(ctx, *layout) for layout in layouts]


def test_the_layout_grid_runs_clean_under_the_checker(dist_pool, tmp_path):
    layouts = grid(str(tmp_path))
    results = [checked_layout(None, *layout) for layout in layouts if layout[1] == 1]
    per_rank = dist_pool(4).run(grid_worker, [layout for layout in layouts if layout[1] > 1])
    results += [next(r[k] for r in per_rank if r[k] is not None) for k in range(len(per_rank[0]))]
    assert [r[0] for r in results] == [layout[0] for layout in layouts]
    for name, side_ops, losses in results:
        assert side_ops > 0, f"{name}: nothing ran on a side stream"
        assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), (name, losses)
    assert (tmp_path / "ckpt" / "latest").is_file(), "the async save was not committed"


def test_pretrain_gpt_under_megazero_stream_check_says_one_line(tmp_path, monkeypatch, capsys):
    from tests.driver import TINY, run_main

    monkeypatch.setenv("MEGAZERO_STREAM_CHECK", "1")
    monkeypatch.chdir(tmp_path)
    code, out = run_main(
        TINY + ["--zero-stage", "3", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2"],
        capsys,
    )
    assert code == 0, out.err[-2000:]
    checked = [line for line in out.out.splitlines() if line.startswith("stream check")]
    assert len(checked) == 1 and re.fullmatch(
        r"stream check \(NCCL as torch >= 2.8: async ops' tensors stashed "
        r"until wait\): [1-9]\d* side-stream ops checked, 0 violations",
        checked[0],
    ), out.out
    assert streams.checker_for("cpu") is None


def test_a_checked_run_computes_what_an_unchecked_one_does():
    cfg = small_config(stage=3, layers=2, global_batch=4, steps=2)
    plain = run_training(cfg, ProcessGroups.single())
    with checking() as checker:
        checked = run_training(small_config(stage=3, layers=2, global_batch=4, steps=2), ProcessGroups.single())
    assert checked["losses"] == plain["losses"] and checker.side_ops > 0
