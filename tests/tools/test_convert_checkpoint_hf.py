"""Hugging Face conversion (tools/convert_checkpoint.py export-hf / import-hf, models/hf_adapter.py):
megazero models of the GPT-2 and Llama families exported and loaded by transformers give megazero's
logits (fp32, atol 1e-5), zero-centred norms (--apply-layernorm-1p) exported as weight + 1; models made
by transformers (random weights, non-default sizes, GQA, heads wider than hidden / heads) give their
logits once imported, also at tensor-parallel degree 2; export -> import -> export is bitwise
stable; models a format cannot express are refused naming the option. Tiny models, no downloads."""

import json

import pytest
import torch
import transformers

from megazero.checkpoint import CheckpointReader, write_full_checkpoint
from megazero.core.errors import UsageError
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT

ATOL = 1e-5
TOKENS = torch.tensor([[3, 17, 40, 2, 59, 11, 0, 33, 60, 7], [1, 5, 9, 58, 21, 44, 12, 6, 30, 49]])
BASE = dict(
    vocab_size=61,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    ffn_hidden_size=48,
    seq_length=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
GPT2_LIKE = dict(position_embedding="learned", activation="gelu", normalization="layernorm")
LLAMA_LIKE = dict(position_embedding="rope", activation="swiglu", normalization="rmsnorm")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _tool():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"
    spec = importlib.util.spec_from_file_location("convert_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = _tool()


def _random_checkpoint(directory, config: GPTConfig, seed=0, padding_value=0.0):
    """A megazero checkpoint of random weights (norms and biases too, so none maps by luck);
    vocabulary padding rows hold `padding_value`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        names = {n: p.shape for n, p in GPT(config).named_parameters()}
    params = {n: torch.randn(shape, generator=generator) * 0.2 for n, shape in names.items()}
    for name in ("embedding.word.weight", "output_head.weight"):
        if name in params:
            params[name][config.vocab_size :] = padding_value
    write_full_checkpoint(directory, config, params, "test-hf")
    return params


def _megazero_logits(config: GPTConfig, params: dict) -> torch.Tensor:
    model = GPT(config).eval()
    model.load_state_dict(params, strict=False)  # a tied head is the embedding
    with torch.no_grad():
        return model(TOKENS)


def _transformers_logits(directory) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def _checkpoint_params(save) -> tuple[GPTConfig, dict]:
    reader = CheckpointReader(save)
    return GPTConfig(**reader.metadata["model"]), {n: reader.full_tensor(n) for n in reader.names}


EXPORTS = {
    "gpt2 tanh-GELU tied, padded vocab": ("gpt2", dict(GPT2_LIKE, padded_vocab_size=64, norm_epsilon=1e-6)),
    "gpt2 erf-GELU untied": ("gpt2", dict(GPT2_LIKE, gelu_approximate="none", tie_embeddings=False)),
    "llama GQA untied, no biases": (
        "llama",
        dict(
            LLAMA_LIKE,
            num_query_groups=2,
            tie_embeddings=False,
            add_bias_linear=False,
            rotary_base=500.0,
            padded_vocab_size=64,
        ),
    ),
    "llama tied with biases": ("llama", dict(LLAMA_LIKE, norm_epsilon=1e-6, rotary_base=50.0)),
    "llama --kv-channels 12, --apply-layernorm-1p": (
        "llama",
        dict(LLAMA_LIKE, kv_channels=12, num_query_groups=2, apply_layernorm_1p=True),
    ),
    "gpt2 --apply-layernorm-1p": ("gpt2", dict(GPT2_LIKE, apply_layernorm_1p=True)),
    "qwen2_moe gated shared expert, qkv bias, a dense layer": (
        "qwen2_moe",
        dict(
            LLAMA_LIKE,
            num_query_groups=2,
            tie_embeddings=False,
            add_bias_linear=False,
            add_qkv_bias=True,
            num_experts=4,
            moe_ffn_hidden_size=24,
            moe_shared_expert_intermediate_size=40,
            moe_shared_expert_gate=True,
            moe_layer_freq=[0, 1],
        ),
    ),
}


@pytest.mark.parametrize("what", list(EXPORTS))
def test_export_gives_megazero_logits_in_transformers_and_round_trips(tmp_path, what):
    fmt, options = EXPORTS[what]
    config = GPTConfig(**BASE, **options)
    params = _random_checkpoint(tmp_path / "ckpt", config)
    assert (
        convert.main(
            ["export-hf", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"), "--without-tokenizer"]
        )
        == 0
    )  # random weights: no tokenizer (tests/tools/test_generate.py)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == fmt
    expected = _megazero_logits(config, params)
    torch.testing.assert_close(_transformers_logits(tmp_path / "hf"), expected, rtol=0, atol=ATOL)

    assert convert.main(["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "back")]) == 0
    assert (
        convert.main(
            ["export-hf", "--load", str(tmp_path / "back"), "--output", str(tmp_path / "hf2"), "--without-tokenizer"]
        )
        == 0
    )
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "hf2" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name


def _perturbed(model):
    """transformers initialises norms to 1 and biases to 0; random values catch swapped names."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return model.eval()


def _transformers_model(kind: str):
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=61,
            n_positions=24,
            n_embd=48,
            n_layer=2,
            n_head=6,
            n_inner=80,
            layer_norm_epsilon=1e-6,
            bos_token_id=None,
            eos_token_id=None,
        )
        return _perturbed(transformers.GPT2LMHeadModel(config))
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=12,
        rms_norm_eps=1e-5,
        max_position_embeddings=24,
        rope_theta=300.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return _perturbed(transformers.LlamaForCausalLM(config))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_model_imported_gives_its_logits(tmp_path, kind):
    model = _transformers_model(kind)
    # a sharded save (index + several files) for Llama, one file for GPT-2
    model.save_pretrained(str(tmp_path / "hf"), max_shard_size="40KB" if kind == "llama" else "1GB")
    assert convert.main(["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    config, params = _checkpoint_params(tmp_path / "ckpt")
    assert (config.num_query_groups, config.hidden_size, config.kv_channels) == (
        (2, 48, 12) if kind == "llama" else (6, 48, 8)
    )
    with torch.no_grad():
        expected = model(TOKENS).logits
    torch.testing.assert_close(_megazero_logits(config, params), expected, rtol=0, atol=ATOL)


def tp_loss_worker(ctx, save, config_fields):
    """Loads an imported checkpoint at tp 2 (padded vocabulary) and returns the loss of TOKENS."""
    from tests.layouts import small_config, with_padded_vocab
    from megazero.checkpoint import load_checkpoint
    from megazero.parallel.topology import Topology
    from megazero.training import setup

    groups = ctx.groups(Topology(world_size=2, tp=2, pp=1))
    cfg = with_padded_vocab(small_config(tp=2, micro=2, global_batch=2, model_extra=config_fields))
    state = setup(cfg, groups)
    load_checkpoint(state, save, finetune=True)
    model = state.chunks[0].eval()
    with torch.no_grad():
        return model(TOKENS[:, :-1].to(state.device), TOKENS[:, 1:].to(state.device)).mean().item()


def test_imported_llama_loads_at_tensor_parallel_2(dist_pool, tmp_path):
    model = _transformers_model("llama")
    model.save_pretrained(str(tmp_path / "hf"))
    convert.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    saved = CheckpointReader(tmp_path / "ckpt").metadata["model"]
    fields = {k: v for k, v in saved.items() if k != "padded_vocab_size"}  # tp 2 pads its own way
    losses = dist_pool(2).run(tp_loss_worker, str(tmp_path / "ckpt"), fields)
    with torch.no_grad():
        expected = model(TOKENS, labels=TOKENS).loss.item()  # transformers shifts the labels
    assert losses[0] == losses[1]
    assert abs(losses[0] - expected) <= ATOL, (losses, expected)


REFUSED = {
    "swiglu as gpt2": ("gpt2", dict(GPT2_LIKE, activation="swiglu"), "--swiglu"),
    "learned positions as llama": ("llama", dict(GPT2_LIKE), "--position-embedding-type learned_absolute"),
    "rope with LayerNorm": ("auto", dict(LLAMA_LIKE, normalization="layernorm"), "--normalization LayerNorm"),
    "GQA as gpt2": ("gpt2", dict(GPT2_LIKE, num_query_groups=2), "--num-query-groups 2"),
    "no biases as gpt2": ("gpt2", dict(GPT2_LIKE, add_bias_linear=False), "--disable-bias-linear"),
    "wider heads as gpt2": ("gpt2", dict(GPT2_LIKE, kv_channels=16), "--kv-channels 16"),
    "half rotary as llama": ("llama", dict(LLAMA_LIKE, rotary_percent=0.5), "--rotary-percent 0.5"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_inexpressible_models_are_refused_naming_the_option(tmp_path, what):
    fmt, options, option = REFUSED[what]
    _random_checkpoint(tmp_path / "ckpt", GPTConfig(**BASE, **options))
    with pytest.raises(UsageError, match=f"cannot export exactly: {option}") as err:
        convert.export_hf(tmp_path / "ckpt", tmp_path / "hf", fmt)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "hf").exists()


def test_nonzero_vocabulary_padding_is_refused(tmp_path, capsys):
    config = GPTConfig(**BASE, **GPT2_LIKE, padded_vocab_size=64)
    _random_checkpoint(tmp_path / "ckpt", config, padding_value=0.5)
    assert convert.main(["export-hf", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")]) == 2
    message = capsys.readouterr().err.strip()
    assert "embedding.word.weight: vocabulary padding rows 61..63 are not zero" in message
    assert "\n" not in message


CONFIG_EDITS = {
    "relu GPT-2": ("gpt2", {"activation_function": "relu"}, "activation_function='relu'"),
    "scaled rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    "other model type": ("llama", {"model_type": "mistral"}, "model_type 'mistral'"),
}


@pytest.mark.parametrize("what", list(CONFIG_EDITS))
def test_inexact_transformers_configs_are_refused_on_import(tmp_path, what):
    kind, edit, named = CONFIG_EDITS[what]
    _transformers_model(kind).save_pretrained(str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(UsageError, match=named):
        convert.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "bad-header"])
def test_a_damaged_safetensors_file_is_refused_on_import_in_one_line(tmp_path, capsys, damage):
    """A model.safetensors cut short, replaced by other bytes, or with a header that is no JSON: one line
    naming the file and the fix, exit 2, nothing written. (Planted: safe_open unguarded, as before,
    ends every case in a SafetensorError traceback.)"""
    _transformers_model("gpt2").save_pretrained(str(tmp_path / "hf"))
    weights = tmp_path / "hf" / "model.safetensors"
    data = weights.read_bytes()
    capsys.readouterr()  # transformers' progress bar
    weights.write_bytes(
        {
            "truncated": data[: len(data) // 2],
            "garbage": b"\x00\xff" * 4096,
            "bad-header": data[:8] + b"{not json" + data[17:],
        }[damage]
    )
    assert convert.main(["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {weights}: not a readable safetensors file (") and "download it again" in line
    assert not (tmp_path / "ckpt").exists()


def test_finetuning_an_imported_llama_names_every_flag_it_needs_at_once(tmp_path, capsys, monkeypatch):
    """pretrain_gpt.py --finetune --load on an imported Llama with only the sizes given: one line naming
    every differing setting by its flags, and the flags it says to pass make the next run start (one
    rerun, not one per setting). (Planted: the former check, naming the first field by its internal
    name, fails: one setting per line, num_query_groups=2.)"""
    from tests.driver import run_main

    _transformers_model("llama").save_pretrained(str(tmp_path / "hf"))
    convert.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    argv = [
        "--finetune",
        "--load",
        "ckpt",
        "--num-layers",
        "2",
        "--hidden-size",
        "48",
        "--num-attention-heads",
        "6",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "24",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "61",
        "--train-iters",
        "1",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--eval-iters",
        "0",
        "--num-workers",
        "0",
    ]
    capsys.readouterr()
    code, out = run_main(argv, capsys)
    [line] = out.err.strip().splitlines()
    assert code == 2 and "the saved model differs from this run's in" in line, out.err
    for flags in (
        "--group-query-attention --num-query-groups 2",
        "--kv-channels 12",
        "--ffn-hidden-size 80",
        "--position-embedding-type rope",
        "--swiglu",
        "--normalization RMSNorm",
        "--disable-bias-linear",
    ):
        assert f"{flags} (this run: " in line, (flags, line)
    assert "num_query_groups" not in line, line
    given = line.split("; pass ")[1].split(" (or load")[0].split()
    code, out = run_main(argv + given, capsys)
    assert code == 0, out.err[-3000:]
