"""A Megatron-LM run continued in megazero (tools/convert_checkpoint.py import-megatron with the
distributed optimizer's states, megazero/checkpoint/megatron_optim.py), against megatron-core itself:
megatron-core trains a tiny Llama-like GPT three steps on two gloo ranks (data-parallel 2) with its
own DistributedDataParallel (one bucket), DistributedOptimizer (Adam,
weight decay, clipping) and OptimizerParamScheduler (warmup, cosine decay), saves it as torch_dist
(fully_reshardable, and dp_reshardable: Megatron-LM's default) and as legacy files
(model_optim_rng.pt + distrib_optim.pt), then takes its
fourth and fifth steps. Each save imports into megazero, which resumes it at ZeRO-3 over two
data-parallel ranks and takes the same two steps on the same batches: the losses and every updated
weight equal megatron-core's (fp32, rtol 1e-5), and the imported schedule is the one the flags give (no
difference reported). Back: megatron-core loads the export of the import and continues it the same.
The legacy layout of a buffer of several buckets equals megatron-core's own. Skips without
megatron-core.

Planted, each failed: exp_avg and exp_avg_sq swapped on import; Adam's step count off by one (the
bias correction moves every weight); legacy buckets laid out without the 64-element alignment (the
buffer's length check refused it); the local spec's registration order wrong (the dp_reshardable
import refused: no order's masters matched the weights); the export's scheduler one batch behind
(the second continued loss off by 4.7e-5 relative)."""

import argparse

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megazero.checkpoint import CheckpointReader, load_checkpoint, megatron_optim
from megazero.checkpoint.resume import schedule_on_resume
from megazero.config.train_config import CheckpointConfig, OptimizerConfig, ParallelConfig, TrainConfig
from megazero.data.sampler import MicrobatchSource
from megazero.models import megatron_adapter
from megazero.models.config import GPTConfig
from megazero.ops.adam_config import AdamConfig
from megazero.parallel.topology import Topology
from megazero.training import setup, train_step
from megazero.training.lr_schedule import step_learning_rate
from megazero.zero.config import ZeroConfig
from megazero.zero.state_access import safe_get_full_fp32_param
from tests.tools.test_convert_checkpoint_hf import convert
from tests.tools.test_convert_checkpoint_megatron import VARIANTS, _megatron_on_cpu

mcore = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

RTOL = 1e-5
STEPS, MORE, BATCH, MICRO, SEQ, TRAIN_ITERS = 3, 2, 4, 2, 16, 10
LR, MIN_LR, WARMUP, WD, CLIP = 1e-2, 1e-3, 2, 0.1, 1.0
ARGS = dict(
    VARIANTS["llama"],
    use_distributed_optimizer=True,
    global_batch_size=BATCH,
    micro_batch_size=MICRO,
    train_iters=TRAIN_ITERS,
    lr=LR,
    min_lr=MIN_LR,
    lr_decay_style="cosine",
    lr_warmup_iters=WARMUP,
    weight_decay=WD,
    clip_grad=CLIP,
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_eps=1e-8,
    consumed_train_samples=STEPS * BATCH,
    data_parallel_size=2,
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    overlap_grad_reduce=False,
)
# megatron-core 0.16.1's fully_reshardable save misplaces states when a buffer has several buckets
# (its own warning: "param range exceeds unpadded buffer"): the run keeps one; the legacy layout of
# several buckets is checked against megatron-core's own buffer below
BUCKET = 6000


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS + MORE)]


class _CudaOnCpu(TorchFunctionMode):
    """megatron-core 0.16's optimizer on a CPU-only torch: its factories ask for device 'cuda' (made
    here on the CPU), it moves tensors with .cuda() (kept where they are) and checks parameters'
    type() names for 'torch.cuda.*' (given so)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if isinstance(device, int) or str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _megatron_config(tp=1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        tensor_model_parallel_size=tp,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        params_dtype=torch.float32,
    )


def _megatron_run(config):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=64,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(
        MegatronOptimizerConfig(
            optimizer="adam",
            lr=LR,
            min_lr=MIN_LR,
            weight_decay=WD,
            clip_grad=CLIP,
            use_distributed_optimizer=True,
            params_dtype=torch.float32,
        ),
        [ddp],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=LR,
        min_lr=MIN_LR,
        lr_warmup_steps=WARMUP * BATCH,
        lr_decay_steps=TRAIN_ITERS * BATCH,
        lr_decay_style="cosine",
        start_wd=WD,
        end_wd=WD,
        wd_incr_steps=TRAIN_ITERS * BATCH,
        wd_incr_style="constant",
    )
    return model, ddp, optimizer, scheduler


def _megatron_step(ctx, ddp, optimizer, scheduler, tokens, rows=None) -> float:
    """One Megatron-LM training step on this rank's rows of the global batch (`rows`: data-parallel
    rank ctx.rank of 2 by default); the global mean loss."""
    rows = tokens[rows if rows is not None else slice(ctx.rank * MICRO, (ctx.rank + 1) * MICRO)]
    inputs, labels = rows[:, :-1], rows[:, 1:]
    s = inputs.shape[1]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(
        inputs,
        torch.arange(s).expand_as(inputs),
        torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1),
        labels=labels,
    ).mean()
    loss.backward()
    ddp.finish_grad_sync()
    optimizer.step()
    scheduler.step(increment=BATCH)
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total.item() / ctx.world_size


def _train_with_megatron(ctx, root):
    """Rank job: megatron-core trains STEPS steps, saves both formats at iteration STEPS, takes MORE
    steps; returns (their losses, the weights after them, _bucketed_layout's)."""
    from megatron.core import parallel_state

    batches = _batches()
    with _megatron_on_cpu(), _CudaOnCpu():
        parallel_state.initialize_model_parallel(1, 1)
        try:
            config = _megatron_config()
            torch.manual_seed(1)
            model, ddp, optimizer, scheduler = _megatron_run(config)
            for tokens in batches[:STEPS]:
                _megatron_step(ctx, ddp, optimizer, scheduler, tokens)
            _save(ctx, root, model, optimizer, scheduler)
            losses = [_megatron_step(ctx, ddp, optimizer, scheduler, tokens) for tokens in batches[STEPS:]]
            weights = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
            return losses, weights, _bucketed_layout(config, model)
        finally:
            parallel_state.destroy_model_parallel()


def _bucketed_layout(config, model):
    """megatron-core's own buffer of `model`'s parameters in buckets of BUCKET elements (overlapped
    grad reduce), as distrib_optim.pt lays it out: ({name: (start, end)} with the buckets joined
    without their end padding, the joined length), and the parameters (name, numel) in order."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET),
        model,
    )
    (buffer,) = ddp.buffers
    names = {p: name for name, p in model.named_parameters()}
    joined = [sum(b.numel_unpadded for b in buffer.buckets[:i]) for i in range(len(buffer.buckets))]
    where = {
        names[p]: (joined[b] + start - buffer.bucket_indices[b][0], joined[b] + end - buffer.bucket_indices[b][0])
        for p, (start, end, b) in buffer.param_index_map.items()
    }
    assert len(buffer.buckets) > 2
    return where, buffer.numel_unpadded, [(name, p.numel()) for name, p in model.named_parameters()]


def _fallback_adam_loads(inner):
    """torch's AdamW, megatron-core's fallback without Transformer Engine or Apex (CPU), keeps Adam's
    step per parameter state: megatron-core 0.16.1 reads it from a fresh optimizer before loading
    (none yet: given 0, the load sets it from the param groups) and copies it with the loaded states
    though fully_reshardable saves none (kept as loaded). Megatron-LM's GPU optimizers keep the step
    in the param groups and need neither."""
    inner.init_state_fn(inner.optimizer, inner.config)
    for param_state in inner.optimizer.state.values():
        param_state["step"] = torch.tensor(0.0)
    copy_states = inner._set_main_param_and_optimizer_states

    def keeping_step(model_param, tensors):
        group, order = inner.model_param_group_index_map[model_param]
        main = inner.optimizer.param_groups[group]["params"][order]
        copy_states(model_param, {"step": inner.optimizer.state[main]["step"], **tensors})

    inner._set_main_param_and_optimizer_states = keeping_step


def _unshare_steps(inner) -> float:
    """The loaded Adam step; megatron-core 0.16.1 gives every parameter of torch's AdamW one shared
    step tensor on loading, which each parameter's update would advance: each gets its own copy."""
    steps = {float(param_state["step"]) for param_state in inner.optimizer.state.values()}
    for param_state in inner.optimizer.state.values():
        param_state["step"] = param_state["step"].clone()
    (step,) = steps
    return step


def _continue_with_megatron(ctx, directory):
    """Rank job: a fresh megatron-core run (other weights) loads the export as Megatron-LM loads a
    torch_dist checkpoint (model, optimizer, scheduler) and takes the MORE steps; (their losses, the
    weights after them, the iteration and Adam step it loaded)."""
    from megatron.core import dist_checkpointing, parallel_state

    with _megatron_on_cpu(), _CudaOnCpu():
        parallel_state.initialize_model_parallel(1, 1)
        try:
            torch.manual_seed(9)
            model, ddp, optimizer, scheduler = _megatron_run(_megatron_config())
            _fallback_adam_loads(optimizer.chained_optimizers[0])
            model_state = model.sharded_state_dict()
            metadata = dist_checkpointing.load_content_metadata(str(directory))
            loaded = dist_checkpointing.load(
                {
                    **model_state,
                    "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True, metadata=metadata),
                },
                str(directory),
            )
            optimizer_state, scheduler_state = loaded.pop("optimizer"), loaded.pop("opt_param_scheduler")
            iteration = loaded.pop("iteration")
            for key in ("args", "checkpoint_version", "content_metadata"):
                loaded.pop(key, None)
            model.load_state_dict(loaded)
            optimizer.load_state_dict(optimizer_state)
            scheduler.load_state_dict(scheduler_state)
            step = _unshare_steps(optimizer.chained_optimizers[0])
            losses = [_megatron_step(ctx, ddp, optimizer, scheduler, tokens) for tokens in _batches()[STEPS:]]
            weights = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
            return losses, weights, iteration, step
        finally:
            parallel_state.destroy_model_parallel()


def _save(ctx, root, model, optimizer, scheduler, args=ARGS):
    """As Megatron-LM saves: torch_dist with either optimizer format, and legacy files (one folder per
    tensor-parallel rank, written by its first data-parallel rank)."""
    from megatron.core import dist_checkpointing, parallel_state

    name = f"iter_{STEPS:07d}"
    common = {
        "args": argparse.Namespace(**args),
        "iteration": STEPS,
        "checkpoint_version": 3.0,
        "opt_param_scheduler": scheduler.state_dict(),
    }
    for folder in ("torch_dist", "torch_dist_dp", "legacy"):
        (root / folder / name).mkdir(parents=True, exist_ok=True)
        (root / folder / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    for kind, folder in (("fully_reshardable", "torch_dist"), ("dp_reshardable", "torch_dist_dp")):
        metadata = {"distrib_optim_sharding_type": kind}
        model_state = model.sharded_state_dict()
        dist_checkpointing.save(
            {**model_state, **common, "optimizer": optimizer.sharded_state_dict(model_state, metadata=metadata)},
            str(root / folder / name),
            content_metadata=metadata,
        )
    rank_dir = root / "legacy" / name / f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    rank_dir.mkdir(exist_ok=True)
    optimizer.save_parameter_state(str(rank_dir / "distrib_optim.pt"))
    if parallel_state.get_data_parallel_rank() == 0:
        torch.save(
            {**common, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
            rank_dir / "model_optim_rng.pt",
        )
    torch.distributed.barrier()


def _train_at_tp2(ctx, root):
    """Rank job: megatron-core trains the model STEPS steps at tensor-parallel degree 2 (one
    data-parallel rank) and saves it in the three forms."""
    from megatron.core import parallel_state

    with _megatron_on_cpu(), _CudaOnCpu():
        parallel_state.initialize_model_parallel(2, 1)
        try:
            torch.manual_seed(1)
            model, ddp, optimizer, scheduler = _megatron_run(_megatron_config(tp=2))
            for tokens in _batches()[:STEPS]:
                _megatron_step(ctx, ddp, optimizer, scheduler, tokens, rows=slice(None))
            _save(
                ctx, root, model, optimizer, scheduler, dict(ARGS, tensor_model_parallel_size=2, data_parallel_size=1)
            )
        finally:
            parallel_state.destroy_model_parallel()


def _megazero_config(model: GPTConfig) -> TrainConfig:
    """The flags' settings of the same run (Megatron-LM's defaults where the run took them)."""
    optimizer = OptimizerConfig(
        lr=LR,
        min_lr=MIN_LR,
        warmup_iters=WARMUP,
        decay_iters=TRAIN_ITERS,
        decay_style="cosine",
        clip_grad=CLIP,
        adam=AdamConfig(lr=LR, weight_decay=WD),
    )
    return TrainConfig(
        model=model,
        zero=ZeroConfig(stage=3, param_persistence_threshold=40),
        optimizer=optimizer,
        micro_batch_size=MICRO,
        global_batch_size=BATCH,
        train_iters=TRAIN_ITERS,
        seed=7,
        parallel=ParallelConfig(),
    )


def _resume_in_megazero(ctx, directories):
    """Rank job: each imported checkpoint resumed at ZeRO-3 over 2 data-parallel ranks for the MORE
    steps megatron-core took after its save, on the same batches; [(losses, full weights by
    megatron-core name)]. The first loss follows from the weights alone, the rest and the weights
    from Adam's states and step and the schedule too."""
    groups = ctx.groups(Topology(world_size=2, tp=1, pp=1))
    dataset = [{"tokens": tokens} for batch in _batches() for tokens in batch]
    out = []
    for directory in directories:
        reader = CheckpointReader(directory)
        cfg = _megazero_config(GPTConfig(**reader.metadata["model"]))
        optimizer, notice = schedule_on_resume(
            CheckpointConfig(load=str(directory)), cfg.optimizer, reader, TRAIN_ITERS
        )
        assert notice is None
        state = setup(cfg, groups)
        loaded = load_checkpoint(state, reader)
        assert (loaded.iteration, loaded.consumed_samples, state.engine.step_count) == (STEPS, STEPS * BATCH, STEPS)
        source = MicrobatchSource(dataset, BATCH, MICRO, groups.coords.dp, groups.topology.dp)
        losses = [
            train_step(state, source.batch(it), step_learning_rate(optimizer, it + 1, TRAIN_ITERS, it * BATCH)).loss
            for it in range(loaded.iteration, loaded.iteration + MORE)
        ]
        ours = {name: safe_get_full_fp32_param(p) for chunk in state.chunks for name, p in chunk.named_parameters()}
        out.append((losses, megatron_adapter.to_megatron(cfg.model, ours.__getitem__)))
    return out


def test_megatron_run_resumes_in_megazero(dist_pool, tmp_path):
    pool = dist_pool(2)
    expected_losses, expected, (layout, length, params) = pool.run(_train_with_megatron, tmp_path)[0]
    assert megatron_optim.buffer_layout(params, BUCKET, set()) == (layout, length)
    directories = []
    for kind in ("torch_dist", "torch_dist_dp", "legacy"):
        directory, iteration, resumable = convert.import_megatron(tmp_path / kind, tmp_path / f"mz_{kind}")
        assert (iteration, resumable) == (STEPS, True)
        directories.append(directory)
    for losses, weights in pool.run(_resume_in_megazero, directories)[0]:
        assert losses == pytest.approx(expected_losses, rel=RTOL)
        for name, tensor in weights.items():
            theirs = expected.get(name, expected.get(megatron_adapter.local_spec_name(name)))
            torch.testing.assert_close(tensor, theirs, rtol=RTOL, atol=RTOL, msg=name)
    # and back: megatron-core continues megazero's export as it continued its own save
    exported, resumable = convert.export_megatron(directories[0], tmp_path / "back")
    losses, weights, iteration, step = pool.run(_continue_with_megatron, exported)[0]
    assert (resumable, iteration, step) == (True, STEPS, STEPS)
    assert losses == pytest.approx(expected_losses, rel=RTOL)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=RTOL, atol=RTOL, msg=name)


def test_tensor_parallel_states_agree_in_every_format(dist_pool, tmp_path):
    """At tensor-parallel degree 2 the three forms megatron-core saves (legacy distrib_optim.pt per
    rank, dp_reshardable buckets per domain, fully_reshardable tensors it merges itself) import to
    the same full weights and Adam states."""
    dist_pool(2).run(_train_at_tp2, tmp_path)
    readers = [
        CheckpointReader(convert.import_megatron(tmp_path / kind, tmp_path / f"mz_{kind}")[0])
        for kind in ("torch_dist", "torch_dist_dp", "legacy")
    ]
    assert readers[0].metadata["engine"]["step_count"] == STEPS
    for name in readers[0].where:
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            ours = [reader.full_tensor(name, kind) for reader in readers]
            assert ours[0].abs().sum() > 0, (name, kind)
            for other in ours[1:]:
                assert torch.equal(ours[0], other), (name, kind)


def test_unevenly_pipelined_dp_reshardable_optimizer_refused_with_its_fix(tmp_path):
    """dp_reshardable buckets of a pipeline split unevenly (whose placement megazero does not rebuild)
    are refused naming the flag, the one that re-saves them readably and --weights-only."""
    from megazero.checkpoint import megatron_files

    args = dict(ARGS, num_layers=3, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1)
    model = {"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(2, 2)}
    with pytest.raises(
        ValueError,
        match="--decoder-first-pipeline-num-layers.*--dist-ckpt-optim-fully-reshardable, or pass --weights-only",
    ):
        megatron_files._bucket_states(model, {0: {0: []}, 1: {0: []}}, args, tmp_path)


def test_misplaced_master_weights_refused():
    """Optimizer states whose fp32 masters are not the model's weights (megatron-core 0.16.1's
    fully_reshardable save of several buckets writes them so) are refused, naming --weights-only."""
    weight = torch.arange(6.0).reshape(2, 3)
    states = {"param": {"w": weight.roll(1)}, "exp_avg": {"w": weight}, "exp_avg_sq": {"w": weight}}
    with pytest.raises(ValueError, match="master of w is not the model's weight.*--weights-only"):
        megatron_optim.check_masters({"w": weight}, states, "ckpt")
    # each layout's message names what misplaces them there, not fully_reshardable's buckets
    for layout, names in [
        ("fully_reshardable", "several buckets"),
        ("dp_reshardable", "order or padding"),
        ("legacy", "distrib_optim.pt"),
    ]:
        with pytest.raises(ValueError) as refused:
            megatron_optim.check_masters({"w": weight}, states, "ckpt", layout)
        assert names in str(refused.value) and (layout == "fully_reshardable") == (
            "fully_reshardable" in str(refused.value)
        )
    megatron_optim.check_masters({"w": weight.to(torch.bfloat16)}, {**states, "param": {"w": weight}}, "ckpt")


@pytest.mark.parametrize("what", ["shared_experts", "no_model", "uneven_virtual"])
def test_unsupported_megatron_runs_refused_in_one_line(tmp_path, what):
    """Shared experts, legacy files without a model and virtual chunks of unequal layer counts are
    refused in one line naming what megazero does not read; nothing is written."""
    rank_dir = tmp_path / "iter_0000003" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    args = dict(ARGS, num_experts=4, moe_shared_expert_intermediate_size=16) if what == "shared_experts" else ARGS
    layer = {f"decoder.layers.{i}.mlp.linear_fc2.weight": torch.zeros(2, 2) for i in range(2)}
    model = {
        "shared_experts": {"model": {}},
        "no_model": {"models": {}},
        "uneven_virtual": {"model0": dict(list(layer.items())[:1]), "model1": layer},
    }[what]
    torch.save({"args": argparse.Namespace(**args), "iteration": 3, **model}, rank_dir / "model_optim_rng.pt")
    expected = {
        "shared_experts": "--moe-shared-expert-intermediate-size",
        "no_model": r"no `model` \(nor model0, ",
        "uneven_virtual": r"virtual pipeline split unevenly \(chunks of \[1, 2\] layers\)",
    }[what]
    with pytest.raises(convert.UsageError, match=expected) as refused:
        convert.import_megatron(tmp_path, tmp_path / "out")
    assert "\n" not in str(refused.value) and not (tmp_path / "out" / "latest").exists()
