"""offload_optimizer (cpu and nvme) and the engine's offload_states / reload_states: offloaded runs
reproduce the non-offloaded curve and parameters (stages 1-3, with TP and PP, fp32 and bf16);
states moved off the device mid-run and back continue the same curve; an nvme run saved and loaded
continues its curve; a truncated or altered swap file is an error naming it; the memory report shows
where the states are."""

import os
from pathlib import Path

import pytest
import torch

from tests.layouts import assemble_params, assert_close, assert_params_match, setup_training, small_config
from megazero.models.param_info import param_info

STEPS = 4


def run(ctx, cfg, dp, *, offload_at=None, corrupt=None, save=None, load=None):
    """Trains cfg on the first tp*pp*dp ranks; returns the loss curve {iteration: loss}, the full
    parameters, the memory report and locations (also while offload_states holds the states, when
    `offload_at` names the step before which they move). `corrupt` = (step, "truncate"|"alter"):
    this rank damages its own swap file before that step and returns the error met. `save` =
    (directory, step) saves a checkpoint after that step; `load` resumes from a directory."""
    from megazero.checkpoint import CheckpointSaver, load_checkpoint
    from megazero.training.lr_schedule import learning_rate
    from megazero.parallel.topology import Topology
    from megazero.training import train_step
    from megazero.zero.state_access import safe_get_full_fp32_param
    from megazero.zero.swap import SwapFileError

    par = cfg.parallel
    groups = ctx.groups(
        Topology(
            world_size=par.tensor_parallel * par.pipeline_parallel * dp,
            tp=par.tensor_parallel,
            pp=par.pipeline_parallel,
        )
    )
    if groups is None:
        return None
    state, source = setup_training(cfg, groups)
    engine = state.engine
    start = load_checkpoint(state, load).iteration if load else 0
    out = {"coords": tuple(groups.coords), "curve": {}}
    for it in range(start, cfg.train_iters):
        if it == offload_at:
            before = engine.memory.report()
            engine.offload_states()
            out["offloaded"] = (before, engine.memory.report(), engine.memory.locations())
            engine.reload_states()
        if corrupt is not None and it == corrupt[0]:
            path = damage_swap_file(cfg, groups.rank, corrupt[1])
            try:
                train_step(state, source.batch(it), 1e-3)
            except SwapFileError as err:
                return {"error": str(err), "path": path}
            return {"error": None, "path": path}
        step = train_step(state, source.batch(it), learning_rate(cfg.optimizer, it + 1, cfg.train_iters))
        out["curve"][it + 1] = step.loss
        if save is not None and save[1] == it + 1:
            CheckpointSaver(save[0], "offload-test").save(state, (it + 1) * cfg.global_batch_size)
    out["params"] = {
        n: (safe_get_full_fp32_param(p), param_info(p).tp_shard)
        for chunk in state.chunks
        for n, p in chunk.named_parameters()
    }
    out["memory"], out["where"] = engine.memory.report(), engine.memory.locations()
    return out


def damage_swap_file(cfg, rank: int, how: str) -> str:
    """Truncates this rank's first master swap file to half, or flips one of its bytes."""
    folder = Path(cfg.zero.offload_optimizer.nvme_path) / "megazero_swap" / f"rank{rank}" / "optimizer"
    path = sorted(folder.glob("*.fp32.swp"))[0]
    size = path.stat().st_size
    if how == "truncate":
        os.truncate(path, size // 2)
    else:
        with open(path, "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0x40]))
    return str(path)


def many(ctx, jobs):
    """One pool call, several runs: [(cfg, dp, options)] -> this rank's result of each."""
    return [run(ctx, cfg, dp, **options) for cfg, dp, options in jobs]


def offload(device, tmp_path=None, **extra):
    block = {"device": device, **extra}
    if device == "nvme":
        block["nvme_path"] = str(tmp_path)
    return block


def layouts(tmp_path):
    """(name, layout kwargs, dp, offload_optimizer block, sub_group_size, offload_states at)."""
    nvme = tmp_path / "swap"
    return [
        ("stage 1 tp 2 cpu", dict(stage=1, tp=2), 2, offload("cpu"), 10**9, None),
        (
            "stage 2 pp 2 nvme overlapped",
            dict(stage=2, pp=2),
            2,
            offload("nvme", nvme / "a", pipeline_read=True, pipeline_write=True, buffer_count=3),
            700,
            None,
        ),
        ("stage 3 tp 2 nvme sync", dict(stage=3, tp=2), 2, offload("nvme", nvme / "b"), 300, 2),
        ("stage 3 bf16 cpu", dict(stage=3, bf16=True), 4, offload("cpu", pin_memory=True), 500, None),
        ("stage 2 plain, offload_states", dict(stage=2), 4, None, 10**9, 2),
    ]


def test_offloaded_runs_match_the_device_runs(dist_pool, tmp_path):
    jobs, names = [], []
    for name, layout, dp, block, sub_group, offload_at in layouts(tmp_path):
        plain = small_config(steps=STEPS, layers=2, **layout)
        extra = {"sub_group_size": sub_group}
        if block is not None:
            extra["offload_optimizer"] = block
        offloaded = small_config(steps=STEPS, layers=2, zero_extra=extra, **layout)
        jobs += [(plain, dp, {}), (offloaded, dp, {"offload_at": offload_at})]
        names.append(name)
    results = list(zip(*dist_pool(4).run(many, jobs)))  # per job: every rank's result
    for k, name in enumerate(names):
        reference, got = results[2 * k], results[2 * k + 1]
        last = max((r for r in got if r is not None), key=lambda r: r["coords"][2])
        ref_last = max((r for r in reference if r is not None), key=lambda r: r["coords"][2])
        steps = sorted(ref_last["curve"])
        assert_close([last["curve"][s] for s in steps], [ref_last["curve"][s] for s in steps], name)
        assert_params_match(assemble_params(got), assemble_params(reference), name)
        block = layouts(tmp_path)[k][3]
        for r in got:
            if r is None:
                continue
            memory, where = r["memory"], r["where"]
            if block is not None:
                tier = "host" if block["device"] == "cpu" else "nvme"
                assert memory["master"] == memory["optimizer_states"] == 0, f"{name}: states on device"
                assert memory[f"{tier}_optimizer_states"] == 2 * memory[f"{tier}_master"] > 0, name
                assert where["optimizer_states"] == where["master"] == block["device"], name
            if "offloaded" in r:
                before, during, moved = r["offloaded"]
                assert during["params"] == 0 and during["host_params"] == before["params"] > 0, name
                assert moved["params"] == "cpu", name
                if block is None:
                    assert during["optimizer_states"] == 0 and moved["optimizer_states"] == "cpu", name
                    assert during["host_optimizer_states"] == before["optimizer_states"], name
                else:  # already off the device: left where it is
                    assert moved["optimizer_states"] == block["device"], name
                    assert during.get("host_optimizer_states", 0) == 0, name


def test_nvme_checkpoint_continues_the_curve_and_damaged_swap_files_fail(dist_pool, tmp_path):
    extra = {"offload_optimizer": offload("nvme", tmp_path / "swap", pipeline_read=True), "sub_group_size": 400}
    cfg = small_config(stage=3, steps=STEPS, layers=2, zero_extra=extra)
    ckpt = str(tmp_path / "ckpt")
    stage1 = small_config(stage=1, steps=STEPS, layers=2, zero_extra=extra)
    jobs = [
        (cfg, 2, {"save": (ckpt, 2)}),
        (cfg, 2, {"load": ckpt}),
        (stage1, 2, {"corrupt": (1, "truncate")}),
        (stage1, 2, {"corrupt": (1, "alter")}),
    ]
    straight, resumed, truncated, altered = zip(*dist_pool(4).run(many, jobs))
    assert resumed[0]["curve"] == {k: v for k, v in straight[0]["curve"].items() if k > 2}
    for r in truncated[:2]:
        assert r["error"] and r["path"] in r["error"] and "truncated" in r["error"], r
    for r in altered[:2]:
        assert r["error"] and r["path"] in r["error"] and "checksum" in r["error"], r


def test_offload_errors_are_one_line(tmp_path):
    from megazero.core.errors import UsageError
    from megazero.zero.config import parse_zero_config
    from megazero.zero.offload import check_state_names

    with pytest.raises(UsageError, match="ratio = 0.5: partial offload .* needs ZeRO stage 3"):
        parse_zero_config({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})
    for ratio in (0, 1.5):
        with pytest.raises(UsageError, match="offload_optimizer.ratio"):
            parse_zero_config({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}})
    with pytest.raises(UsageError, match="unknown state 'optimizer'"):
        check_state_names(["optimizer"])
    assert check_state_names("lp_grads") == ("lp_grads",)


def test_swap_file_round_trip_and_checks(tmp_path):
    from megazero.zero.swap import SubGroupSwapper, SwapFileError

    bounds = [(0, 5), (5, 10), (10, 13)]
    swapper = SubGroupSwapper(
        tmp_path, "t", ("a", "b"), bounds, buffer_count=2, pipeline_read=True, pipeline_write=True, pin_memory=False
    )
    values = torch.arange(26, dtype=torch.float32)
    for k, (s, e) in enumerate(bounds):
        swapper.write_initial(k, {"a": values[s:e], "b": -values[s:e]})
    swapper.prefetch(0)
    for k, (s, e) in enumerate(bounds):
        states = swapper.fetch(k)
        swapper.prefetch(k + 1)
        assert torch.equal(states["a"], values[s:e]) and torch.equal(states["b"], -values[s:e])
        states["a"].add_(1)
        swapper.write(k, states)
    swapper.drain()
    for k, (s, e) in enumerate(bounds):
        states = swapper.fetch(k)
        assert torch.equal(states["a"], values[s:e] + 1)
        swapper.write(k, states)
    swapper.drain()
    os.truncate(tmp_path / "t.b.swp", 20)
    with pytest.raises(SwapFileError, match="t.b.swp holds 20 bytes"):
        swapper.fetch(0)
    swapper.close()


def test_the_cpu_adam_gets_the_cores_per_local_rank_unless_told(tmp_path, capsys, monkeypatch):
    """An offloaded run's CPU Adam steps on the node's cores per local rank even with OMP_NUM_THREADS=1
    (torchrun's default, and this suite's), on --cpu-optimizer-threads N when given, else on
    MEGAZERO_CPU_OPTIMIZER_THREADS; a bad value of that variable is one line, exit 2."""
    import os
    from megazero.run import launch
    from megazero.zero import offload

    seen = []

    def recording(*args, num_threads=None, **kwargs):
        seen.append(num_threads)
        return real(*args, num_threads=num_threads, **kwargs)

    real = offload.adam_update
    monkeypatch.setattr(offload, "adam_update", recording)
    argv = [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "64",
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--train-iters",
        "1",
        "--eval-iters",
        "0",
        "--num-workers",
        "0",
        "--zero-stage",
        "2",
        "--zero-offload-optimizer",
        "cpu",
        "--run-dir",
        str(tmp_path),
    ]
    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
    for extra, env, expected in [
        ([], None, launch.usable_cores()),
        (["--cpu-optimizer-threads", "3"], "5", 3),
        ([], "5", 5),
    ]:
        seen.clear()
        if env is None:
            monkeypatch.delenv("MEGAZERO_CPU_OPTIMIZER_THREADS", raising=False)
        else:
            monkeypatch.setenv("MEGAZERO_CPU_OPTIMIZER_THREADS", env)
        assert launch.main(argv + extra) == 0, capsys.readouterr().err
        assert seen and set(seen) == {expected}, (extra, env, seen)
    monkeypatch.setenv("MEGAZERO_CPU_OPTIMIZER_THREADS", "many")
    assert launch.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: MEGAZERO_CPU_OPTIMIZER_THREADS=many must be a whole number >= 1 (the offloaded optimizer's CPU "
        "Adam threads); unset it for the cores per local rank"
    )
