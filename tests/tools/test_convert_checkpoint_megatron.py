"""Megatron-LM conversion (tools/convert_checkpoint.py import-megatron / export-megatron,
models/megatron_adapter.py, megazero/checkpoint/megatron_files.py), against megatron-core itself: a tiny
GPTModel (rope, GQA, SwiGLU, RMSNorm, untied head) built at tensor-parallel degree 2 on two gloo ranks
and saved by megatron-core's dist_checkpointing (torch_dist) and as legacy per-rank pickles imports
into megazero and gives megatron-core's logits (fp32, rtol 1e-5); the export loads back into a fresh
megatron-core model at TP 2 and gives them again. Skips without megatron-core."""
import argparse
import contextlib

import pytest
import torch

from megazero.checkpoint import CheckpointReader
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT
from tests.tools.test_convert_checkpoint_hf import convert

mcore = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

RTOL = 1e-5
TOKENS = torch.tensor([[3, 17, 40, 2, 59, 11, 0, 33, 60, 7, 8, 1], [1, 5, 9, 58, 21, 44, 12, 6, 30, 49, 3, 3]])
ARGS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
            kv_channels=8, ffn_hidden_size=48, seq_length=16, max_position_embeddings=16, vocab_size=64,
            padded_vocab_size=64, position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
            rotary_interleaved=False, swiglu=True, normalization="RMSNorm", norm_epsilon=1e-5,
            untie_embeddings_and_output_weights=True, add_bias_linear=False, hidden_dropout=0.0,
            attention_dropout=0.0)


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


def _model(seed):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
        use_cpu_initialization=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, params_dtype=torch.float32, tensor_model_parallel_size=2)
    torch.manual_seed(seed)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64,
                     max_sequence_length=16, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    with torch.no_grad():              # norms away from 1, so a misplaced one shows
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def _logits(model) -> torch.Tensor:
    """The full-vocabulary logits (b, s, v): each rank holds a vocabulary slice; gathered."""
    s = TOKENS.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    with torch.no_grad():
        local = model(TOKENS, torch.arange(s).expand_as(TOKENS), mask)
    parts = [torch.empty_like(local) for _ in range(2)]
    torch.distributed.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)


def _save_with_megatron(ctx, torch_dist_dir, legacy_dir):
    """Rank job: megatron-core builds and saves the model both ways; returns its logits."""
    from megatron.core import dist_checkpointing, parallel_state
    with _megatron_on_cpu():
        parallel_state.initialize_model_parallel(2, 1)
        try:
            model = _model(seed=1)
            common = {"args": argparse.Namespace(**ARGS), "iteration": 7, "checkpoint_version": 3.0}
            if ctx.rank == 0:
                for root in (torch_dist_dir, legacy_dir):
                    (root / "iter_0000007").mkdir(parents=True)
                    (root / "latest_checkpointed_iteration.txt").write_text("7")
            torch.distributed.barrier()
            dist_checkpointing.save({**model.sharded_state_dict(), **common}, str(torch_dist_dir / "iter_0000007"))
            rank_dir = legacy_dir / "iter_0000007" / f"mp_rank_{ctx.rank:02d}"
            rank_dir.mkdir()
            torch.save({**common, "model": model.state_dict()}, rank_dir / "model_optim_rng.pt")
            return _logits(model)
        finally:
            parallel_state.destroy_model_parallel()


def _load_with_megatron(ctx, directory):
    """Rank job: a fresh megatron-core model (other weights) loads `directory`; returns its logits."""
    from megatron.core import dist_checkpointing, parallel_state
    with _megatron_on_cpu():
        parallel_state.initialize_model_parallel(2, 1)
        try:
            model = _model(seed=2)
            loaded = dist_checkpointing.load(model.sharded_state_dict(), str(directory))
            common = {key: loaded.pop(key) for key in ("args", "iteration", "checkpoint_version")}
            model.load_state_dict(loaded)
            return _logits(model), common["iteration"], vars(common["args"])
        finally:
            parallel_state.destroy_model_parallel()


def _megazero_logits(directory) -> torch.Tensor:
    reader = CheckpointReader(directory)
    config = GPTConfig(**reader.metadata["model"])
    model = GPT(config).eval()
    model.load_state_dict({name: reader.full_tensor(name, "fp32") for name in reader.where})
    with torch.no_grad():
        return model(TOKENS)


def test_megatron_checkpoints_round_trip_through_megatron_core(dist_pool, tmp_path):
    pool = dist_pool(2)
    torch_dist, legacy = tmp_path / "torch_dist", tmp_path / "legacy"
    expected = pool.run(_save_with_megatron, torch_dist, legacy)[0]
    for source in (torch_dist, legacy):
        directory, iteration = convert.import_megatron(source, tmp_path / f"mz_{source.name}")
        assert iteration == 7
        torch.testing.assert_close(_megazero_logits(directory), expected, rtol=RTOL, atol=RTOL)
    exported = convert.export_megatron(tmp_path / "mz_torch_dist", tmp_path / "back")
    logits, iteration, args = pool.run(_load_with_megatron, exported)[0]
    torch.testing.assert_close(logits, expected, rtol=RTOL, atol=RTOL)
    assert iteration == 0 and {k: args[k] for k in ARGS} == ARGS


def test_pickles_load_weights_only(tmp_path):
    """A legacy file holding an object outside the allow-list is refused before anything runs."""
    rank_dir = tmp_path / "iter_0000001" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save({"args": argparse.Namespace(**ARGS), "model": {}, "hook": contextlib.ExitStack()},
               rank_dir / "model_optim_rng.pt")
    with pytest.raises(convert.UsageError, match="weights-only"):
        convert.import_megatron(tmp_path, tmp_path / "out")
