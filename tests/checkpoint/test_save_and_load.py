"""Checkpoints: N steps straight equal N/2 steps, save, load and N/2 more (bitwise, fp32 and fp16,
dropout on) for ZeRO stages 0-3 with TP, PP (every schedule) and MiCS; a checkpoint of one layout
loads at another and continues on that layout's own curve (rtol 1e-5); bad checkpoints fail with one
line naming the file."""

import math

import pytest
import torch

from tests.layouts import assert_close, microbatches, setup_training, small_config, with_padded_vocab
from tests.metrics_reading import split_records
from megazero.checkpoint import CheckpointError, CheckpointReader, CheckpointSaver, SaveError, load_checkpoint
from megazero.models.param_info import param_info

STEPS, SAVE_AT = 6, 3


def ckpt_worker(ctx, cfg, dp, directory, save_at=None, load=None, params=False, stop_after=None):
    """Trains up to cfg.train_iters steps (from a checkpoint when `load`; the lr schedule always
    spans train_iters), saving after step `save_at` and stopping after `stop_after`; returns
    {iteration: (loss, loss scale)} and whether the RNG states were restored."""
    from megazero.training.lr_schedule import learning_rate
    from megazero.parallel.topology import Topology
    from megazero.training import train_step

    par = cfg.parallel
    groups = ctx.groups(
        Topology(
            world_size=par.tensor_parallel * par.context_parallel * par.pipeline_parallel * dp,
            tp=par.tensor_parallel,
            pp=par.pipeline_parallel,
            cp=par.context_parallel,
            ep=par.expert_parallel,
            mics_shard_size=cfg.zero.mics_shard_size,
        )
    )
    if groups is None:
        return None
    state, source = setup_training(cfg, groups)
    start, rng = 0, None
    if load is not None:
        result = load_checkpoint(state, load)
        start, rng = result.iteration, result.rng_restored
        assert result.consumed_samples == start * cfg.global_batch_size
    saver = CheckpointSaver(directory, "test-run")
    curve = {}
    for it in range(start, stop_after or cfg.train_iters):
        step = train_step(state, source.batch(it), learning_rate(cfg.optimizer, it + 1, cfg.train_iters))
        curve[it + 1] = (step.loss, step.loss_scale)
        if save_at == it + 1:
            saver.save(state, (it + 1) * cfg.global_batch_size)
    out = {
        "curve": curve,
        "rng": rng,
        "coords": tuple(groups.coords),
        "biases": {n: b.tolist() for chunk in state.chunks for n, b in chunk.named_buffers()},
    }
    if params:  # the live model, gathered as the exactness tests do
        from megazero.zero.state_access import safe_get_full_fp32_param

        out["params"] = {
            n: (safe_get_full_fp32_param(p), param_info(p).tp_shard)
            for chunk in state.chunks
            for n, p in chunk.named_parameters()
        }
    return out


def _resume_config(**kw):
    return small_config(steps=STEPS, model_extra={"hidden_dropout": 0.1, "attention_dropout": 0.1}, **kw)


RESUME_LAYOUTS = {
    "stage 0 tp 2 dp 2": (dict(stage=0, tp=2), 2),
    "stage 1 pp 2 1f1b dp 2": (dict(stage=1, pp=2, schedule="1f1b"), 2),
    "stage 2 tp 2 pp 2 gpipe": (dict(stage=2, tp=2, pp=2, schedule="gpipe"), 1),
    "stage 3 dp 4 mics 2": (dict(stage=3, mics=2), 4),
    "stage 3 pp 2 interleaved dp 2": (dict(stage=3, pp=2, virtual=2), 2),
    "stage 2 tp 2 sequence parallel dp 2": (dict(stage=2, tp=2, sequence_parallel=True), 2),
}


def test_resume_is_bitwise_exact(dist_pool, tmp_path):
    pool = dist_pool(4)
    for what, (layout, dp) in RESUME_LAYOUTS.items():
        directory = tmp_path / what.replace(" ", "_")
        cfg = _resume_config(**layout)
        straight = _curve(pool.run(ckpt_worker, cfg, dp, str(directory), SAVE_AT))
        resumed = pool.run(ckpt_worker, cfg, dp, str(directory), None, str(directory))
        assert all(r["rng"] for r in resumed if r is not None), f"{what}: RNG states not restored"
        tail = {k: v for k, v in straight.items() if k > SAVE_AT}
        assert _curve(resumed) == tail, f"{what}: resumed curve differs from the straight one"


def test_fp16_resume_keeps_the_loss_scaler(dist_pool, tmp_path):
    cfg = small_config(stage=2, steps=STEPS)
    cfg.precision.fp16, cfg.precision.initial_scale_power, cfg.precision.hysteresis = True, 24, 2
    straight = _curve(dist_pool(4).run(ckpt_worker, cfg, 4, str(tmp_path), SAVE_AT))
    resumed = _curve(dist_pool(4).run(ckpt_worker, cfg, 4, str(tmp_path), None, str(tmp_path)))
    assert len({scale for _, scale in straight.values()}) > 1, "the scale must move during the run"
    assert resumed == {k: v for k, v in straight.items() if k > SAVE_AT}


RESHARD = [
    ("tp2 pp2 dp2 stage 3 -> dp4 stage 1", (dict(stage=3, tp=2, pp=2), 2), (dict(stage=1), 4)),
    ("dp4 stage 1 -> tp2 pp2 dp2 stage 3", (dict(stage=1), 4), (dict(stage=3, tp=2, pp=2), 2)),
    ("dp4 stage 2 -> dp4 mics 2 stage 3", (dict(stage=2), 4), (dict(stage=3, mics=2), 4)),
    ("pp2 interleaved -> pp2 1f1b", (dict(stage=1, pp=2, virtual=2), 2), (dict(stage=1, pp=2, schedule="1f1b"), 2)),
]


@pytest.mark.parametrize("what,source,target", RESHARD, ids=[r[0] for r in RESHARD])
def test_checkpoint_loads_at_another_layout(dist_pool, tmp_path, what, source, target):
    (src_layout, src_dp), (dst_layout, dst_dp) = source, target
    pool = dist_pool(8)
    pool.run(ckpt_worker, small_config(steps=STEPS, **src_layout), src_dp, str(tmp_path), SAVE_AT, stop_after=SAVE_AT)
    own = _curve(pool.run(ckpt_worker, small_config(steps=STEPS, **dst_layout), dst_dp, str(tmp_path / "x")))
    resumed = _curve(
        pool.run(ckpt_worker, small_config(steps=STEPS, **dst_layout), dst_dp, str(tmp_path / "y"), None, str(tmp_path))
    )
    steps = sorted(resumed)
    assert steps == list(range(SAVE_AT + 1, STEPS + 1))
    assert_close([resumed[k][0] for k in steps], [own[k][0] for k in steps], f"{what}: continued curve")


def test_consolidate_equals_the_gathered_live_model(dist_pool, tmp_path):
    import json

    from safetensors.torch import load_file

    from tests.layouts import assemble_params
    from megazero.models.config import GPTConfig
    from megazero.models.gpt import GPT

    convert = _tool("convert_checkpoint").main
    cfg = small_config(stage=3, tp=2, pp=2, steps=2)
    results = dist_pool(4).run(ckpt_worker, cfg, 1, str(tmp_path / "ckpt"), 2, None, True)
    live = assemble_params(results)
    assert (
        convert(
            ["consolidate", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"), "--with-optimizer"]
        )
        == 0
    )
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    model = GPT(GPTConfig(**json.loads((tmp_path / "out" / "config.json").read_text())))
    model.load_state_dict(state, strict=True)
    assert set(state) == set(model.state_dict())
    for name, value in live.items():
        key = "embedding.word.weight" if name == "output_head.weight" else name
        assert torch.equal(state[key], value), name
    optimizer = load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    assert set(optimizer) == {f"{n}.{k}" for n in live if n != "output_head.weight" for k in ("exp_avg", "exp_avg_sq")}


def _tool(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _curve(results) -> dict:
    curves = [r["curve"] for r in results if r is not None]
    assert all(c == curves[0] for c in curves), "ranks disagree on the loss curve"
    return curves[0]


# --- bad checkpoints (one process) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from megazero.parallel.process_groups import ProcessGroups
    from megazero.testing import WorkerContext

    directory = tmp_path_factory.mktemp("ckpt")
    ctx = WorkerContext(0, 1, None)
    ctx.groups = lambda topology: ProcessGroups.single()
    ckpt_worker(ctx, small_config(steps=2, stage=1), 1, str(directory), 2)
    return directory


def _single_state(**kw):
    from megazero.parallel.process_groups import ProcessGroups
    from megazero.training import setup

    return setup(with_padded_vocab(small_config(**kw)), ProcessGroups.single())


def test_bad_checkpoints_name_the_file(saved, tmp_path):
    import shutil

    work = tmp_path / "c"
    shutil.copytree(saved, work)
    it = work / "iter_0000002"
    CheckpointReader(work)  # intact: fine
    data = it / "rank_00000.safetensors"
    original = data.read_bytes()
    data.write_bytes(original[:-100])
    with pytest.raises(CheckpointError, match="rank_00000.safetensors.*truncated"):
        CheckpointReader(work)
    flipped = bytearray(original)
    flipped[-5] ^= 0xFF  # a byte inside the last tensor
    data.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="checksum|corrupted"):
        load_checkpoint(_single_state(stage=1), work)
    data.write_bytes(original)
    with pytest.raises(
        CheckpointError, match=r"--hidden-size 32 \(this run: --hidden-size 64\); pass --hidden-size 32"
    ):
        load_checkpoint(_single_state(stage=1, model_extra={"hidden_size": 64}), work)
    (work / "latest").write_text("iter_0000009\n")
    with pytest.raises(CheckpointError, match="latest names 'iter_0000009'"):
        CheckpointReader(work)
    (work / "latest").write_bytes(b"\x89\xffiter_\x00\n\x9c")  # garbage: not UTF-8, not a name
    with pytest.raises(CheckpointError, match=r"latest holds no directory name \(damaged\).*echo iter_0000002 >"):
        CheckpointReader(work)
    (work / "latest").unlink()
    with pytest.raises(CheckpointError, match="no `latest`"):
        CheckpointReader(work)
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(data)), str(data), metadata={"megazero_run_id": "other-run", "rank": "0"})
    with pytest.raises(CheckpointError, match="a shard of run other-run rank 0, not of this checkpoint"):
        CheckpointReader(it)
    assert sorted(p.name for p in it.iterdir()) == ["metadata.json", "rank_00000.safetensors"]


def _as_if_saved_on_a_gpu(it, cfg):
    """Rewrites a CPU checkpoint of `cfg`'s layout (dp 1) as a GPU run of it would have written it:
    each rank's layout key as the saver makes it on cuda, CUDA generator states (16 bytes; the
    CPU's are 5056)."""
    import json
    import types
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from megazero.checkpoint.saver import crc32, layout_key

    meta = json.loads((it / "metadata.json").read_text())
    par = cfg.parallel
    for index in meta["ranks"]:
        data = it / index["file"]["name"]
        with safe_open(str(data), framework="pt") as f:
            header = f.metadata()
        tensors = load_file(str(data))
        for key in [k for k in tensors if k.startswith("rng/tracker/")] + ["rng/cuda"]:
            tensors[key] = torch.arange(16, dtype=torch.uint8)
            index["rng"][key[len("rng/") :]] = crc32(tensors[key])
        save_file(tensors, str(data), metadata=header)
        topology = types.SimpleNamespace(
            world_size=len(meta["ranks"]), tp=par.tensor_parallel, pp=par.pipeline_parallel, cp=1
        )
        index["layout_key"] = layout_key(
            types.SimpleNamespace(
                cfg=cfg,
                groups=types.SimpleNamespace(topology=topology, rank=index["rank"]),
                device=torch.device("cuda", 0),
            )
        )
        index["file"]["bytes"] = data.stat().st_size
    (it / "metadata.json").write_text(json.dumps(meta))


def test_rng_states_stay_on_their_device_type(dist_pool, tmp_path):
    """CPU <-> GPU at tp 2: the layout key holds the device type, so a GPU checkpoint loads on the
    CPU with its weights and optimizer and without its RNG states (the note of another layout), and
    the run goes on with dropout. With the key blind to the device, the CUDA tracker states went
    into the CPU tracker and the first dropout failed (the CPU generator refuses a 16-byte state);
    the reverse move is the same comparison."""
    cfg = _resume_config(tp=2, stage=1)
    saved = tmp_path / "saved"
    dist_pool(2).run(ckpt_worker, cfg, 1, str(saved), save_at=2, stop_after=2)
    same = dist_pool(2).run(ckpt_worker, cfg, 1, str(tmp_path / "unused"), load=str(saved), stop_after=3)
    assert all(r["rng"] for r in same), "a CPU checkpoint on the CPU restores its RNG states"
    _as_if_saved_on_a_gpu(saved / "iter_0000002", cfg)
    moved = dist_pool(2).run(ckpt_worker, cfg, 1, str(tmp_path / "unused"), load=str(saved))
    assert not any(r["rng"] for r in moved)
    assert sorted(_curve(moved)) == list(range(3, STEPS + 1))
    assert all(math.isfinite(loss) for loss, _ in _curve(moved).values())


def save_then_die(directory, point):
    """A process of its own: saves iteration 1, then dies by SIGKILL at `point` of saving iteration 2."""
    import os
    import signal

    import megazero.checkpoint.files as files
    import megazero.checkpoint.saver as saver_module
    from megazero.parallel.process_groups import ProcessGroups
    from megazero.training import train_step

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    cfg = small_config(stage=1, steps=4)
    state, source = setup_training(cfg, ProcessGroups.single())
    saver = CheckpointSaver(directory, "kill-run")
    train_step(state, source.batch(0), 1e-3)
    saver.save(state, cfg.global_batch_size)  # iteration 1: complete
    if point == "rank-file":  # half a shard on disk
        real = saver_module.save_file

        def partial(tensors, path, metadata=None):
            real(tensors, path, metadata=metadata)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            die()

        saver_module.save_file = partial
    elif point == "metadata":  # shards done, metadata half written
        real_json = saver_module.write_json_atomic

        def json_then_die(path, value):
            if path.name == files.METADATA:
                path.write_text("{")
                die()
            real_json(path, value)

        saver_module.write_json_atomic = json_then_die
    elif point == "latest":  # directory in place, latest not yet
        real_write = files.write_file_atomic

        def write_then_die(path, data):
            if path.name == files.LATEST:
                path.with_name(files.TMP_PREFIX + path.name).write_bytes(data[:3])
                die()
            real_write(path, data)

        files.write_file_atomic = write_then_die
    train_step(state, source.batch(1), 1e-3)
    saver.save(state, 2 * cfg.global_batch_size)


@pytest.mark.parametrize("point", ["rank-file", "metadata", "latest"])
def test_save_killed_midway_keeps_the_previous_checkpoint(tmp_path, point):
    """The saving process is SIGKILLed mid-save (a process of its own, forked from the pools'
    forkserver, which has megazero imported already)."""
    from megazero.testing import process_context

    child = process_context().Process(target=save_then_die, args=(str(tmp_path / "ckpt"), point))
    child.start()
    child.join(timeout=600)
    assert child.exitcode == -9, child.exitcode
    reader = CheckpointReader(tmp_path / "ckpt")
    assert reader.metadata["iteration"] == 1, "latest must still name the previous checkpoint"
    result = load_checkpoint(_single_state(stage=1, steps=4), tmp_path / "ckpt")
    assert result.iteration == 1


def test_full_disk_fails_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    import megazero.checkpoint.saver as saver_module
    from megazero.training import train_step

    state = _single_state(stage=2, steps=3)
    cfg = state.cfg
    source = microbatches(cfg)
    saver = CheckpointSaver(tmp_path, "disk-run")
    train_step(state, source.batch(0), 1e-3)
    saver.save(state, cfg.global_batch_size)

    def no_space(tensors, path, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saver_module, "save_file", no_space)
    train_step(state, source.batch(1), 1e-3)
    with pytest.raises(
        SaveError,
        match=r"rank 0 could not write its shard of the checkpoint of iteration 2 "
        r"\(No space left on device\)",
    ):
        saver.save(state, 2 * cfg.global_batch_size)
    assert CheckpointReader(tmp_path).metadata["iteration"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest"], "no leftovers"


def run_id_worker(ctx, directory):
    import uuid
    from megazero.checkpoint.resume import start
    from megazero.config.train_config import CheckpointConfig
    from megazero.parallel.topology import Topology
    from megazero.run.run_folder import agree_identity
    from megazero.training import setup

    groups = ctx.groups(Topology(world_size=4, tp=2))
    run_id, run_dir = agree_identity(groups, uuid.uuid4().hex, f"runs/gpt-rank{groups.rank}")
    state = setup(with_padded_vocab(small_config(stage=3, tp=2, steps=1)), groups)
    _, policy = start(state, CheckpointConfig(save=directory), None, lambda line: None, run_id)
    policy.save(state, 0)
    return policy.saver.run_id, run_dir


def test_a_new_run_has_one_run_id_and_run_folder_on_every_rank(dist_pool, tmp_path):
    """Every rank draws its own; rank 0's id and default run folder become every rank's."""
    ids = dist_pool(4).run(run_id_worker, str(tmp_path))
    assert len(set(ids)) == 1 and ids[0][1] == "runs/gpt-rank0", ids
    assert CheckpointReader(tmp_path).run_id == ids[0][0]


def test_mock_data_saves_and_resumes_without_a_tokenizer(tmp_path, capsys):
    """--mock-data (no tokenizer named) with --save, then --load: the resumed run logs what the unbroken
    run logs, and the checkpoint keeps no tokenizer (there is none to keep)."""
    from megazero.run import launch

    common = [
        "--mock-data",
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
        "4",
        "--train-iters",
        "4",
        "--lr-warmup-iters",
        "1",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--num-workers",
        "0",
    ]

    def losses(run_dir):
        return [(r["iteration"], r["loss"]) for r in split_records(run_dir)]

    whole, part = tmp_path / "whole", tmp_path / "part"
    assert launch.main(common + ["--run-dir", str(whole)]) == 0, capsys.readouterr().err
    stop = common + ["--run-dir", str(part), "--save", str(part / "ckpt"), "--exit-interval", "2"]
    assert launch.main(stop) == 0, capsys.readouterr().err
    assert not any((part / "ckpt").glob("*/tokenizer"))
    assert launch.main(common + ["--run-dir", str(part), "--load", str(part / "ckpt")]) == 0, capsys.readouterr().err
    assert losses(part) == losses(whole) and len(losses(whole)) == 4
