"""Megatron-LM conversion (tools/convert_checkpoint.py import-megatron / export-megatron,
models/megatron_adapter.py, megazero/checkpoint/megatron_files.py), against megatron-core itself: two
tiny GPTModels (Llama-like: rope, GQA, SwiGLU, RMSNorm, untied head; GPT-like: learned positions,
LayerNorm, exact GELU, biases, tied head) built at tensor-parallel degree 2 on two gloo ranks and saved
by megatron-core's dist_checkpointing (torch_dist) and as legacy per-rank pickles import into megazero
and give megatron-core's logits and per-token losses (fp32, rtol 1e-5); the exports load back into
fresh megatron-core models at TP 2 and give them again. Legacy files of pipeline degree 2 import to
the weights of megatron-core's own torch_dist save of that model. Skips without megatron-core.

Planted, each failed: legacy SwiGLU fc1 shards concatenated plainly (abs diff 2.3e-2); the rotary row
permutation on q heads but not k (1.4e-3); GELU always the tanh form (4.6e-4, GPT-like model); the
local spec's input and pre-MLP norm names swapped (2.9); legacy pipeline stages not renumbered (the
import refused: no decoder.layers.1); numpy left out of the pickle allow-list (the legacy import refused:
megatron-core's own allow-list, registered when it is imported, is cleared for these tests)."""

import argparse
import contextlib
import random
import signal

import numpy

import pytest
import torch

from megazero.checkpoint import CheckpointReader
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT
from tests.tools.test_convert_checkpoint_hf import convert

mcore = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

RTOL = 1e-5
TOKENS = torch.tensor([[3, 17, 40, 2, 59, 11, 0, 33, 60, 7, 8, 1], [1, 5, 9, 58, 21, 44, 12, 6, 30, 49, 3, 3]])
LABELS = TOKENS.roll(-1, dims=1)
COMMON = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=48,
    seq_length=16,
    max_position_embeddings=16,
    vocab_size=64,
    padded_vocab_size=64,
    norm_epsilon=1e-5,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
# Megatron-LM argument records (megatron/training/arguments.py names) of the two families tested
VARIANTS = {
    "llama": dict(
        COMMON,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=8,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_percent=1.0,
        rotary_interleaved=False,
        swiglu=True,
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
    ),
    "gpt": dict(
        COMMON,
        position_embedding_type="learned_absolute",
        swiglu=False,
        normalization="LayerNorm",
        untie_embeddings_and_output_weights=False,
        add_bias_linear=True,
        bias_gelu_fusion=False,
    ),
}


@pytest.fixture(autouse=True)
def megazero_allow_list_alone():
    """Importing megatron.core allow-lists its classes for every torch.load of the process; cleared
    here, so the files are read with megazero's own allow-list alone."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.add_safe_globals(saved)


@contextlib.contextmanager
def _megatron_on_cpu():
    """megatron-core 0.16 on a CPU-only torch in a pool rank: its torch_dist writer calls
    torch.cuda.synchronize and torch.cuda.current_device, keeps its results in a queue served by a
    spawned manager process and forks its file writers (a pool rank is a daemon: its children are
    allowed here, and the queue, used by this process alone, is a plain one); attention forks the CUDA
    RNG tracker (for dropout, 0 here)."""
    import multiprocessing
    import queue
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    class NoFork:
        fork = staticmethod(lambda *a, **k: contextlib.nullcontext())

    saved = torch.cuda.synchronize, torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a: None), (lambda: "cpu")
    tensor_parallel.get_cuda_rng_tracker = lambda: NoFork
    config = multiprocessing.current_process()._config
    daemon, config["daemon"] = config.get("daemon"), False
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker = saved
        config["daemon"], filesystem_async._results_queue = daemon, None


def _model(variant, seed, tp=2, pp=1):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = VARIANTS[variant]
    llama = variant == "llama"
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2 if llama else None,
        ffn_hidden_size=48,
        use_cpu_initialization=True,
        gated_linear_unit=llama,
        activation_func=torch.nn.functional.silu if llama else torch.nn.functional.gelu,
        normalization=args["normalization"],
        add_bias_linear=args["add_bias_linear"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization=args["normalization"]),
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type=args["position_embedding_type"],
        share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    with torch.no_grad():  # norms away from 1, biases from 0, activations O(1): a wrong one shows
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.mul_(8)
    return model.eval()


def _logits(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-vocabulary logits (b, s, v; each rank holds a vocabulary slice: gathered) and the
    per-token losses of LABELS (b, s)."""
    s = TOKENS.shape[1]
    inputs = TOKENS, torch.arange(s).expand_as(TOKENS), torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    with torch.no_grad():
        local, losses = model(*inputs), model(*inputs, labels=LABELS)
    parts = [torch.empty_like(local) for _ in range(2)]
    torch.distributed.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1), losses


def _save_both_formats(ctx, model, args, torch_dist, legacy, rank_dir_name):
    from megatron.core import dist_checkpointing

    common = {"args": argparse.Namespace(**args), "iteration": 7, "checkpoint_version": 3.0}
    if ctx.rank == 0:
        for save in (torch_dist, legacy):
            (save / "iter_0000007").mkdir(parents=True)
            (save / "latest_checkpointed_iteration.txt").write_text("7")
    torch.distributed.barrier()
    dist_checkpointing.save({**model.sharded_state_dict(), **common}, str(torch_dist / "iter_0000007"))
    rank_dir = legacy / "iter_0000007" / rank_dir_name
    rank_dir.mkdir()
    # as Megatron-LM's legacy files: enums and a signal among the arguments, numpy's and torch's RNG
    # states, the rerun state machine's mode
    from megatron.core.rerun_state_machine import RerunMode
    from megatron.core.transformer.enums import AttnBackend

    rng = {
        "random_rng_state": random.getstate(),
        "np_rng_state": numpy.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    megatron_args = argparse.Namespace(**args, attention_backend=AttnBackend.auto, exit_signal=signal.SIGTERM)
    torch.save(
        {
            **common,
            "args": megatron_args,
            "model": model.state_dict(),
            "rng_state": [rng],
            "rerun_state_machine": {"mode": RerunMode.DISABLED},
        },
        rank_dir / "model_optim_rng.pt",
    )


def _save_pipelined(ctx, root):
    """Rank job: megatron-core builds the Llama-like model at pipeline degree 2 and saves it both ways
    (untied: a tied head across stages makes megatron-core move the embedding to CUDA)."""
    from megatron.core import parallel_state

    with _megatron_on_cpu():
        parallel_state.initialize_model_parallel(1, 2)
        try:
            model = _model("llama", seed=3, tp=1, pp=2)
            _save_both_formats(
                ctx,
                model,
                dict(VARIANTS["llama"], pipeline_model_parallel_size=2),
                root / "pp_torch_dist",
                root / "pp_legacy",
                f"mp_rank_00_{ctx.rank:03d}",
            )
        finally:
            parallel_state.destroy_model_parallel()


def _save_with_megatron(ctx, root):
    """Rank job: megatron-core builds each variant and saves it both ways (ROOT/<variant>_torch_dist,
    ROOT/<variant>_legacy); returns {variant: (logits, per-token losses)}."""
    from megatron.core import dist_checkpointing, parallel_state  # noqa: F401  (loads its checkpointing)

    out = {}
    with _megatron_on_cpu():
        parallel_state.initialize_model_parallel(2, 1)
        try:
            for variant, args in VARIANTS.items():
                model = _model(variant, seed=1)
                _save_both_formats(
                    ctx,
                    model,
                    args,
                    root / f"{variant}_torch_dist",
                    root / f"{variant}_legacy",
                    f"mp_rank_{ctx.rank:02d}",
                )
                out[variant] = _logits(model)
            return out
        finally:
            parallel_state.destroy_model_parallel()


def _load_with_megatron(ctx, directories):
    """Rank job: a fresh megatron-core model (other weights) of each variant loads its directory;
    returns {variant: (logits, per-token losses, iteration, args)}."""
    from megatron.core import dist_checkpointing, parallel_state

    out = {}
    with _megatron_on_cpu():
        parallel_state.initialize_model_parallel(2, 1)
        try:
            for variant, directory in directories.items():
                model = _model(variant, seed=2)
                loaded = dist_checkpointing.load(model.sharded_state_dict(), str(directory))
                common = {key: loaded.pop(key) for key in ("args", "iteration", "checkpoint_version")}
                model.load_state_dict(loaded)
                out[variant] = (*_logits(model), common["iteration"], vars(common["args"]))
            return out
        finally:
            parallel_state.destroy_model_parallel()


def _megazero_logits(directory) -> tuple[torch.Tensor, torch.Tensor]:
    reader = CheckpointReader(directory)
    config = GPTConfig(**reader.metadata["model"])
    model = GPT(config).eval()
    model.load_state_dict({name: reader.full_tensor(name, "fp32") for name in reader.where}, strict=False)
    with torch.no_grad():
        return model(TOKENS), model(TOKENS, LABELS)


def _assert_close(ours, theirs):
    for a, b in zip(ours, theirs):  # logits, per-token losses
        torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL)


def test_megatron_checkpoints_round_trip_through_megatron_core(dist_pool, tmp_path):
    pool = dist_pool(2)
    expected = pool.run(_save_with_megatron, tmp_path)[0]
    exported = {}
    for variant in VARIANTS:
        for kind in ("torch_dist", "legacy"):
            directory, iteration, _ = convert.import_megatron(
                tmp_path / f"{variant}_{kind}", tmp_path / f"mz_{variant}_{kind}"
            )
            assert iteration == 7
            _assert_close(_megazero_logits(directory), expected[variant])
        exported[variant] = convert.export_megatron(
            tmp_path / f"mz_{variant}_torch_dist", tmp_path / f"back_{variant}"
        )[0]
    for variant, (*outputs, iteration, args) in pool.run(_load_with_megatron, exported)[0].items():
        _assert_close(outputs, expected[variant])
        assert iteration == 0 and {k: args[k] for k in VARIANTS[variant]} == VARIANTS[variant]


def test_legacy_pipeline_stages_join_as_megatron_core_numbers_them(dist_pool, tmp_path):
    """Legacy files of pipeline degree 2 (each stage numbering its layers from 0) import to the same
    weights as megatron-core's torch_dist save of the same model, which holds global layer numbers."""
    dist_pool(2).run(_save_pipelined, tmp_path)
    imported = [
        CheckpointReader(convert.import_megatron(tmp_path / f"pp_{kind}", tmp_path / f"mz_{kind}")[0])
        for kind in ("torch_dist", "legacy")
    ]
    assert sorted(imported[0].where) == sorted(imported[1].where)
    for name in imported[0].where:
        assert torch.equal(imported[0].full_tensor(name, "fp32"), imported[1].full_tensor(name, "fp32")), name


def test_pickles_load_weights_only(tmp_path):
    """A legacy file holding an object outside the allow-list is refused before anything runs."""
    rank_dir = tmp_path / "iter_0000001" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save(
        {"args": argparse.Namespace(**VARIANTS["gpt"]), "model": {}, "hook": contextlib.ExitStack()},
        rank_dir / "model_optim_rng.pt",
    )
    with pytest.raises(convert.UsageError, match="contextlib.ExitStack, outside the allow-list.*weights-only"):
        convert.import_megatron(tmp_path, tmp_path / "out")
