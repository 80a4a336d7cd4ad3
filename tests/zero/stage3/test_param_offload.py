"""offload_param (stage 3): the low-precision partition in host memory or in per-unit swap files
reproduces the non-offloaded single-process curve in fp32 (rtol 1e-5), with TP 2 and with PP 2; the
memory report moves the partition's bytes off the device; a truncated swap file is an error naming
it; the nvme read-ahead follows the last step's fetch order. Composes with offload_optimizer."""

import os
from pathlib import Path

import pytest
import torch

from tests.layouts import (
    assert_matches_reference,
    last_stage_result,
    reference_fixture,
    run_layouts,
    setup_training,
    small_config,
)
from megazero.training.lr_schedule import learning_rate
from megazero.parallel.topology import Topology
from megazero.core.streams import Streams
from megazero.training import train_step
from megazero.zero.config import OffloadParamConfig
from megazero.zero.stage3.param_offload import GatherOrder, NvmeParams, SwapFileError

STEPS = 3


def offloaded(device: str, root: str, tp=1, pp=1, bf16=False, **extra):
    block = {"device": device}
    if device == "nvme":
        block.update(nvme_path=os.path.join(root, f"{device}-tp{tp}-pp{pp}"), buffer_count=2)
    return small_config(tp=tp, pp=pp, stage=3, steps=STEPS, bf16=bf16, zero_extra={"offload_param": block, **extra})


reference = reference_fixture(steps=STEPS)


def test_offloaded_params_reproduce_the_single_process_curve(dist_pool, reference, tmp_path):
    layouts = {
        "cpu dp 4": (offloaded("cpu", str(tmp_path)), 4),
        "nvme dp 4": (offloaded("nvme", str(tmp_path)), 4),
        "cpu tp 2 dp 2": (offloaded("cpu", str(tmp_path), tp=2), 2),
        "nvme tp 2 dp 2": (offloaded("nvme", str(tmp_path), tp=2), 2),
        "nvme pp 2 dp 2": (offloaded("nvme", str(tmp_path), pp=2), 2),
        # With the optimizer offloaded too, its host step writes the updated weights to their home.
        "nvme + offload_optimizer nvme tp 2 dp 2": (
            offloaded(
                "nvme",
                str(tmp_path / "both"),
                tp=2,
                offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path / "both"), "pipeline_read": True},
            ),
            2,
        ),
    }
    results = dist_pool(4).run(run_layouts, [layout for layout in layouts.values()])
    for k, (what, (cfg, dp)) in enumerate(layouts.items()):
        got = [per_rank[k] for per_rank in results]
        assert_matches_reference(got, reference, what)
        device = cfg.zero.offload_param.device
        for r in (r for r in got if r is not None):
            memory = r["memory"]
            # The only device-side low-precision weights left are the persistent (small) ones.
            assert memory[f"{device}_params" if device == "nvme" else "host_params"] > 0, what
            assert memory["params"] < memory[f"{device}_params" if device == "nvme" else "host_params"], what
            if cfg.zero.offloads_optimizer:
                assert memory["nvme_optimizer_states"] > 0 and memory["optimizer_states"] == 0, what
        if device == "nvme":
            files = list(Path(cfg.zero.offload_param.nvme_path).glob("megazero_swap/rank*/params/unit*.swp"))
            assert len({f.parent.parent for f in files}) == 4, f"{what}: one swap folder per rank"


def test_bf16_offloaded_params_train_bit_for_bit_like_device_ones(dist_pool, tmp_path):
    """Offload changes where the bf16 partition lives, not one operation on it: the run equals the
    non-offloaded bf16 run exactly (the step writes the bf16 copy into the home)."""
    layouts = [(small_config(stage=3, steps=STEPS, bf16=True), 2), (offloaded("nvme", str(tmp_path), bf16=True), 2)]
    device, offload = (
        last_stage_result([per_rank[k] for per_rank in dist_pool(4).run(run_layouts, layouts)]) for k in range(2)
    )
    assert offload["losses"] == device["losses"] and offload["norms"] == device["norms"]
    for name, (value, _) in device["params"].items():
        assert torch.equal(offload["params"][name][0], value), name


def truncated_swap_file(ctx, cfg):
    """Pool entry: one step, then a swap file of rank 1 loses its last bytes; the next step's read of
    it must fail naming the file (rank 1 answers the error it raised, the others whatever they got)."""
    groups = ctx.groups(Topology(world_size=2))
    if groups is None:
        return None
    state, source = setup_training(cfg, groups)
    train_step(state, source.batch(0), learning_rate(cfg.optimizer, 1, cfg.train_iters))
    store = state.engine.unit_storage
    victim = store.home.path(len(store.units) - 1)
    if ctx.rank == 1:
        store.home.held.clear()  # nothing cached: the next use reads the file
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) - 2)
        try:
            store.device_chunk(store.units[-1])
        except SwapFileError as err:
            return str(err), str(victim)
        return "no error", str(victim)
    return None


def test_truncated_swap_file_is_an_error_naming_it(dist_pool, tmp_path):
    cfg = offloaded("nvme", str(tmp_path))
    message, victim = dist_pool(4).run(truncated_swap_file, cfg)[1]
    assert victim in message and "truncated" in message, message


def test_read_ahead_follows_the_last_steps_order():
    order = GatherOrder()
    assert order.next_after(0, 2) == []  # nothing recorded yet
    for b in (1, 2, 2, 1, 0):  # this step: 0 1 2 2 1 0
        assert order.next_after(b, 2) == []
    order.end_step()
    assert order.next_after(0, 2) == [1, 2]
    assert order.next_after(1, 2) == [2, 2]
    assert order.next_after(0, 3) == []  # out of step: 0's next use, the last
    assert order.next_after(2, 2) == [2, 1]  # none after that: 2's first use


def test_nvme_home_writes_back_evicted_chunks_and_refuses_an_altered_file(tmp_path):
    """Three unit chunks through two host buffers: evicted chunks come back from their files with what
    was written; a file altered in place (same size) fails its checksum, naming the file."""
    config = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=2)
    home = NvmeParams([(0, 5), (5, 3), (8, 4)], torch.bfloat16, "cpu", Streams("cpu"), config, rank=0)
    for b in range(3):
        home.host_chunk(b).fill_(b + 1)
    assert len(home.held) == 2  # the first chunk went to its file
    home.drop_cache()
    assert [home.to_device(b).tolist() for b in range(3)] == [[1.0] * 5, [2.0] * 3, [3.0] * 4]
    home.drop_cache()
    with open(home.path(1), "r+b") as f:
        f.write(b"\x00\x00")
    with pytest.raises(SwapFileError, match=str(home.path(1))):
        home.to_device(1)


def test_nvme_home_rewrites_only_changed_chunks(tmp_path, monkeypatch):
    """A chunk handed out by host_chunk and only read (--log-params-norm, a checkpoint save) is not
    written back to its file; one changed in place is. Planted: writing every handed-out chunk."""
    from megazero.zero.swap import SwapFile

    config = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=4)
    home = NvmeParams([(0, 5), (5, 3), (8, 4)], torch.bfloat16, "cpu", Streams("cpu"), config, rank=0)
    for b in range(3):
        home.host_chunk(b).fill_(b + 1)
    home.flush()
    written = []
    write = SwapFile.write
    monkeypatch.setattr(SwapFile, "write", lambda self, *args: (written.append(self.path), write(self, *args)))
    assert sum(float(home.host_chunk(b).float().sum()) for b in range(3)) == 5 + 6 + 12
    home.flush()
    home.drop_cache()
    assert written == []
    home.host_chunk(2).add_(1)
    home.drop_cache()
    assert written == [home.path(2)]
    assert home.to_device(2).tolist() == [4.0] * 4


def test_nvme_home_holds_at_most_max_in_cpu_elements_in_host_buffers(tmp_path):
    """max_in_cpu bounds the host cache below buffer_count, never below two chunks."""
    chunks = [(0, 4), (4, 4), (8, 4), (12, 4)]
    for max_in_cpu, held in ((1000, 4), (12, 3), (1, 2)):
        config = OffloadParamConfig(
            device="nvme", nvme_path=str(tmp_path / str(max_in_cpu)), buffer_count=4, max_in_cpu=max_in_cpu
        )
        home = NvmeParams(chunks, torch.float32, "cpu", Streams("cpu"), config, rank=0)
        for b in range(4):
            home.host_chunk(b).fill_(b)
        assert len(home.held) == held, max_in_cpu
        home.drop_cache()
