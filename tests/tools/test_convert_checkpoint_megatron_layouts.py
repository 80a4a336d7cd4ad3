"""Megatron-LM runs of every parallel layout continued in megazero (tools/convert_checkpoint.py
import-megatron; megazero/checkpoint/megatron_stages.py, megatron_legacy.py), against megatron-core
itself, in one megatron-core job on two gloo ranks: it trains, with its own pipeline schedules,
DistributedDataParallel, DistributedOptimizer (Adam, weight decay, clipping) and
OptimizerParamScheduler, a 4-layer Llama-like GPT at pipeline degree 2, plainly and interleaved (2
virtual chunks a stage, one layer each), and a 2-layer mixture of experts (4 experts of width 24,
top-2) at expert-parallel degree 2. After 3 steps each saves torch_dist (the pipelines with the
optimizer's dp_reshardable buckets, Megatron-LM's default: a bucket set per stage and chunk, and
per expert rank for the experts' optimizer; the experts also fully_reshardable, their chained
optimizers' states) and legacy files (model0/model1 when
interleaved, mp_rank_00_<expert rank> with local expert numbers, distrib_optim.pt per chunk, with
experts the dense and the expert optimizers' buffers), computes its logits, then takes 2 more steps.
Each save imports into megazero: the logits equal megatron-core's (fp32, rtol 1e-5) and, resumed at
ZeRO-3 over two data-parallel ranks, the next 2 losses equal megatron-core's. Back: megatron-core
loads the exports of the interleaved and the experts' imports (at PP 2 vp 2, and EP 2 with its two
chained optimizers) and continues them with its own next 2 losses. Skips without megatron-core.

Planted, each failed: the dp_reshardable domain of a stage taken from the other stage (refused: no
order's masters match the weights); the virtual chunks' dp_reshardable grad buffers swapped (refused
likewise); the interleaved legacy chunks placed in stage order instead of rounds (the logits
differ); the legacy grad buffers of the virtual chunks swapped (refused: the buffer holds 7776
elements, the layout gives 9856); the expert ranks' local experts numbered from the other rank's
offset (the experts' legacy logits differ); the legacy expert states (not the weights) numbered so
(refused: the masters are not the weights); torch_dist's expert axis read in reverse (the experts'
torch_dist logits differ); the export's experts stacked in reverse (megatron-core's continued losses
off by 4.6e-4 relative); the experts' dp_reshardable domains of the two expert ranks swapped, and
their registration order linear_fc2 before linear_fc1 (each refused: the masters are not the
weights)."""

import argparse

import pytest
import torch

from tests.tools.test_convert_checkpoint_hf import convert
from tests.tools.test_convert_checkpoint_megatron import TOKENS, _megatron_on_cpu, _megazero_logits
from tests.tools.test_convert_checkpoint_megatron_optim import (
    ARGS,
    BATCH,
    CLIP,
    LR,
    MICRO,
    MIN_LR,
    SEQ,
    STEPS,
    TRAIN_ITERS,
    WARMUP,
    WD,
    _batches,
    _CudaOnCpu,
    _fallback_adam_loads,
    _megatron_step,
    _resume_in_megazero,
    _unshare_steps,
)

mcore = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

RTOL = 1e-5
LAYERS = 4
LAYOUTS = {"pipeline": None, "interleaved": 2}  # virtual chunks per stage
# the mixture of experts: 4 experts of width 24, top-2, split over 2 expert-parallel ranks (also the
# 2 data-parallel ranks), megatron-core's allgather token dispatcher (its alltoall one makes CUDA
# streams); Megatron-LM's default aux-loss coefficient, 0
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.0)
MOE_ARGS = dict(
    ARGS, **MOE, expert_model_parallel_size=2, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False
)


def _config(vp=None, moe=False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = (
        dict(
            num_layers=2,
            num_moe_experts=MOE["num_experts"],
            moe_router_topk=MOE["moe_router_topk"],
            moe_ffn_hidden_size=MOE["moe_ffn_hidden_size"],
            moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=2,
            moe_token_dispatcher_type="allgather",
        )
        if moe
        else dict(
            num_layers=LAYERS,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=vp,
            pipeline_dtype=torch.float32,
        )
    )
    return TransformerConfig(
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
        **layout,
    )


def _run(config, vp, moe=False):
    """megatron-core's model chunks of this stage, wrapped as Megatron-LM wraps them, its optimizer
    and scheduler."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    chunks = []
    for v in range(vp or 1):
        where = dict(ignore_virtual=False, vp_stage=v) if vp else {}
        spec = get_gpt_layer_local_spec(
            normalization="RMSNorm", **(dict(num_experts=4, moe_grouped_gemm=False) if moe else {})
        )
        chunks.append(
            GPTModel(
                config,
                spec,
                vocab_size=64,
                max_sequence_length=SEQ,
                position_embedding_type="rope",
                share_embeddings_and_output_weights=False,
                pre_process=parallel_state.is_pipeline_first_stage(**where),
                post_process=parallel_state.is_pipeline_last_stage(**where),
                **(dict(vp_stage=v) if vp else {}),
            )
        )
    ddps = [
        DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=True), chunk, disable_bucketing=i > 0
        )
        for i, chunk in enumerate(chunks)
    ]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            min_lr=MIN_LR,
            weight_decay=WD,
            clip_grad=CLIP,
            use_distributed_optimizer=True,
            params_dtype=torch.float32,
        ),
        ddps,
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
    return chunks, ddps, optimizer, scheduler


def _forward(rows, model, labels=True):
    inputs = rows[:, :-1] if labels else rows
    s = inputs.shape[1]
    out = model(
        inputs,
        torch.arange(s).expand_as(inputs),
        torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1),
        labels=rows[:, 1:] if labels else None,
    )
    return out, (lambda o, non_loss_data=False: o if non_loss_data else (o.mean(), {"loss": o.mean().detach()}))


def _schedule(ddps, batch, forward_only=False, size=MICRO):
    """megatron-core's pipeline schedule over `batch` in micro-batches of `size` rows; what the last
    stage collected (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro = [batch[i : i + size] for i in range(0, len(batch), size)]
    step = (
        (lambda it, model: _forward(next(it), model, labels=False))
        if forward_only
        else (lambda it, model: _forward(next(it), model))
    )
    iterators = [iter(micro) for _ in ddps]  # each chunk reads its own copy of the batch
    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iterators if len(ddps) > 1 else iterators[0],
        model=ddps if len(ddps) > 1 else ddps[0],
        num_microbatches=len(micro),
        seq_length=micro[0].shape[1] - (0 if forward_only else 1),
        micro_batch_size=size,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def _step(ddps, optimizer, scheduler, batch):
    for ddp in ddps:
        ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = _schedule(ddps, batch)
    for ddp in ddps:
        ddp.finish_grad_sync()
    optimizer.step()
    scheduler.step(increment=BATCH)
    return sum(loss["loss"].item() for loss in losses) / len(losses) if losses else None


def _save(ctx, root, chunks, optimizer, scheduler, vp):
    """As Megatron-LM saves: torch_dist with dp_reshardable optimizer buckets, and legacy files (one
    folder per pipeline rank, a model per chunk)."""
    from megatron.core import dist_checkpointing

    name = f"iter_{STEPS:07d}"
    args = dict(
        ARGS,
        num_layers=LAYERS,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=vp,
        data_parallel_size=1,
    )
    common = {
        "args": argparse.Namespace(**args),
        "iteration": STEPS,
        "checkpoint_version": 3.0,
        "opt_param_scheduler": scheduler.state_dict(),
    }
    for folder in ("torch_dist", "legacy"):
        (root / folder / name).mkdir(parents=True, exist_ok=True)
        (root / folder / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    models = (
        {f"model{v}": chunk.sharded_state_dict() for v, chunk in enumerate(chunks)}
        if vp
        else chunks[0].sharded_state_dict()
    )
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    dist_checkpointing.save(
        {**models, **common, "optimizer": optimizer.sharded_state_dict(models, metadata=metadata)},
        str(root / "torch_dist" / name),
        content_metadata=metadata,
    )
    rank_dir = root / "legacy" / name / f"mp_rank_00_{ctx.rank:03d}"
    rank_dir.mkdir()
    optimizer.save_parameter_state(str(rank_dir / "distrib_optim.pt"))
    models = (
        {f"model{v}": chunk.state_dict() for v, chunk in enumerate(chunks)} if vp else {"model": chunks[0].state_dict()}
    )
    torch.save({**common, **models, "optimizer": optimizer.state_dict()}, rank_dir / "model_optim_rng.pt")
    torch.distributed.barrier()


def _save_experts(ctx, root, model, optimizer, scheduler):
    """As Megatron-LM saves: torch_dist with the fully_reshardable optimizer format, and legacy files
    of expert degree 2 (no pipeline): mp_rank_00_<expert rank>, each written by its expert rank's
    first expert-data-parallel rank (here every rank)."""
    from megatron.core import dist_checkpointing

    name = f"iter_{STEPS:07d}"
    for folder in ("torch_dist", "torch_dist_dp", "legacy"):
        (root / folder / name).mkdir(parents=True, exist_ok=True)
        (root / folder / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    common = {
        "args": argparse.Namespace(**MOE_ARGS),
        "iteration": STEPS,
        "checkpoint_version": 3.0,
        "opt_param_scheduler": scheduler.state_dict(),
    }
    for kind, folder in (("fully_reshardable", "torch_dist"), ("dp_reshardable", "torch_dist_dp")):
        metadata = {"distrib_optim_sharding_type": kind}
        model_state = model.sharded_state_dict()
        dist_checkpointing.save(
            {**model_state, **common, "optimizer": optimizer.sharded_state_dict(model_state, metadata=metadata)},
            str(root / folder / name),
            content_metadata=metadata,
        )
    rank_dir = root / "legacy" / name / f"mp_rank_00_{ctx.rank:03d}"
    rank_dir.mkdir()
    optimizer.save_parameter_state(str(rank_dir / "distrib_optim.pt"))
    torch.save(
        {**common, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, rank_dir / "model_optim_rng.pt"
    )
    torch.distributed.barrier()


def _train_experts(ctx, root):
    """megatron-core trains the mixture of experts STEPS steps at expert degree 2 (data-parallel 2),
    saves, computes its logits of TOKENS and takes MORE steps: (logits, the MORE losses)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.1 without Transformer Engine leaves this name undefined (its router asks it)
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    batches = _batches()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    try:
        torch.manual_seed(1)
        (model,), (ddp,), optimizer, scheduler = _run(_config(moe=True), None, moe=True)
        for batch in batches[:STEPS]:
            _megatron_step(ctx, ddp, optimizer, scheduler, batch)
        _save_experts(ctx, root, model, optimizer, scheduler)
        with torch.no_grad():
            logits = _forward(TOKENS, model, labels=False)[0]
        return logits, [_megatron_step(ctx, ddp, optimizer, scheduler, batch) for batch in batches[STEPS:]]
    finally:
        parallel_state.destroy_model_parallel()


def _load_export(directory, chunks, optimizer, scheduler):
    """Loads megazero's export as Megatron-LM loads a torch_dist checkpoint (model chunks, optimizer,
    scheduler; torch's AdamW, megatron-core's CPU fallback, handled as test_convert_checkpoint_
    megatron_optim does); returns the iteration and the Adam step of every chained optimizer."""
    from megatron.core import dist_checkpointing

    for inner in optimizer.chained_optimizers:
        _fallback_adam_loads(inner)
    models = (
        {f"model{v}": chunk.sharded_state_dict() for v, chunk in enumerate(chunks)}
        if len(chunks) > 1
        else chunks[0].sharded_state_dict()
    )
    metadata = dist_checkpointing.load_content_metadata(str(directory))
    loaded = dist_checkpointing.load(
        {**models, "optimizer": optimizer.sharded_state_dict(models, is_loading=True, metadata=metadata)},
        str(directory),
    )
    optimizer_state, scheduler_state = loaded.pop("optimizer"), loaded.pop("opt_param_scheduler")
    iteration = loaded.pop("iteration")
    for key in ("args", "checkpoint_version", "content_metadata"):
        loaded.pop(key, None)
    if len(chunks) > 1:
        for v, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{v}"])
    else:
        chunks[0].load_state_dict(loaded)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    return iteration, [_unshare_steps(inner) for inner in optimizer.chained_optimizers]


def _continue_interleaved(ctx, directory):
    """Rank job: a fresh interleaved megatron-core run (other weights) loads the export and takes the
    MORE steps: (their losses (on the last stage), the iteration and Adam step it loaded)."""
    from megatron.core import parallel_state

    vp = LAYOUTS["interleaved"]
    with _megatron_on_cpu(), _CudaOnCpu():
        parallel_state.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=vp)
        try:
            torch.manual_seed(9)
            chunks, ddps, optimizer, scheduler = _run(_config(vp), vp)
            iteration, steps = _load_export(directory, chunks, optimizer, scheduler)
            return [_step(ddps, optimizer, scheduler, batch) for batch in _batches()[STEPS:]], iteration, steps
        finally:
            parallel_state.destroy_model_parallel()


def _continue_experts(ctx, directory):
    """Rank job: a fresh megatron-core mixture of experts (other weights) at expert degree 2 loads the
    export (model, both chained optimizers, scheduler) and takes the MORE steps: (their losses, the
    iteration and Adam steps it loaded)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    with _megatron_on_cpu(), _CudaOnCpu():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
        try:
            torch.manual_seed(9)
            (model,), (ddp,), optimizer, scheduler = _run(_config(moe=True), None, moe=True)
            iteration, steps = _load_export(directory, [model], optimizer, scheduler)
            losses = [_megatron_step(ctx, ddp, optimizer, scheduler, batch) for batch in _batches()[STEPS:]]
            return losses, iteration, steps
        finally:
            parallel_state.destroy_model_parallel()


def _train_with_megatron(ctx, root):
    """Rank job: per layout, megatron-core trains STEPS steps, saves (ROOT/<layout>/...), computes its
    logits of TOKENS, takes MORE steps; {layout: (logits, the MORE losses)} (on the last stage)."""
    from megatron.core import parallel_state

    batches = _batches()
    out = {}
    with _megatron_on_cpu(), _CudaOnCpu():
        out["experts"] = _train_experts(ctx, root / "experts")
        for layout, vp in LAYOUTS.items():
            parallel_state.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=vp)
            try:
                torch.manual_seed(1)
                chunks, ddps, optimizer, scheduler = _run(_config(vp), vp)
                for batch in batches[:STEPS]:
                    _step(ddps, optimizer, scheduler, batch)
                _save(ctx, root / layout, chunks, optimizer, scheduler, vp)
                with torch.no_grad():
                    logits = _schedule(ddps, TOKENS, forward_only=True, size=1)  # interleaving needs 2
                losses = [_step(ddps, optimizer, scheduler, batch) for batch in batches[STEPS:]]
                out[layout] = (torch.cat(logits) if logits else None, losses)
            finally:
                parallel_state.destroy_model_parallel()
    return out


def test_megatron_runs_of_every_layout_resume_in_megazero(dist_pool, tmp_path):
    pool = dist_pool(2)
    expected = pool.run(_train_with_megatron, tmp_path)[1]
    directories, losses = [], []
    for layout in [*LAYOUTS, "experts"]:
        for kind in ("torch_dist", "legacy") + (("torch_dist_dp",) if layout == "experts" else ()):
            directory, iteration, resumable = convert.import_megatron(
                tmp_path / layout / kind, tmp_path / f"mz_{layout}_{kind}"
            )
            assert (iteration, resumable) == (STEPS, True)
            logits, _ = _megazero_logits(directory)
            torch.testing.assert_close(logits, expected[layout][0], rtol=RTOL, atol=RTOL, msg=f"{layout} {kind}")
            directories.append(directory)
            losses.append(expected[layout][1])
    for (ours, _), theirs in zip(pool.run(_resume_in_megazero, directories)[0], losses):
        assert ours == pytest.approx(theirs, rel=RTOL)
    # and back: megatron-core continues megazero's exports (interleaved, and the mixture of experts
    # with its two chained optimizers) as it continued its own saves
    exported, resumable = convert.export_megatron(tmp_path / "mz_interleaved_torch_dist", tmp_path / "back_interleaved")
    ours, iteration, steps = pool.run(_continue_interleaved, exported)[1]
    assert (resumable, iteration, steps) == (True, STEPS, [STEPS])
    assert ours == pytest.approx(expected["interleaved"][1], rel=RTOL)
    exported, resumable = convert.export_megatron(tmp_path / "mz_experts_torch_dist", tmp_path / "back_experts")
    ours, iteration, steps = pool.run(_continue_experts, exported)[0]
    assert (resumable, iteration, steps) == (True, STEPS, [STEPS, STEPS])
    assert ours == pytest.approx(expected["experts"][1], rel=RTOL)
