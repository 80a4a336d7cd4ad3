"""A trained model leaves with its tokenizer: tools/generate.py's cached decoding equals the model's full
forward; its greedy ids equal transformers' greedy `generate` on the folder export-hf writes, for the
GPT-2 family (with a GPT-2 BPE tokenizer) and the Llama family (with the embedded corpus's
sentencepiece tokenizer); that folder works alone (AutoTokenizer encodes the prompt as the run does,
pipeline("text-generation") writes text); a checkpoint of any layout generates the same ids;
import-hf brings a folder's tokenizer in; a tokenizer transformers cannot load is refused in one
line. Tiny models trained a few steps in-process; nothing is downloaded."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.driver import REPO
from megazero.run import launch
from megazero.checkpoint import CheckpointReader, write_full_checkpoint
from megazero.core.errors import UsageError
from megazero.models.config import GPTConfig
from megazero.models.generation import KVCache, forward_cached, sampling_logits
from megazero.models.gpt import GPT
from tests.layouts import setup_training

sys.path.insert(0, str(REPO))
from tools import convert_checkpoint, generate, preprocess_data  # noqa: E402

PROMPT = "def total(values):\n    return"
TEXTS = [f"def f{i}(x, y):\n    return x * {i} + y  # line {i}\n" for i in range(60)]
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "3",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
]
LLAMA = [
    "--position-embedding-type",
    "rope",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--num-query-groups",
    "2",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _train(folder: Path, argv: list[str]) -> Path:
    assert launch.main(argv + ["--save", str(folder / "ck"), "--run-dir", str(folder / "run")]) == 0
    return folder / "ck"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{family: (checkpoint, exported folder)}: a GPT-2 run on data made with a GPT-2 BPE tokenizer
    trained here, and a Llama run on the embedded corpus (its sentencepiece tokenizer)."""
    from megazero.data.tokenizer_bpe import train_byte_level_bpe

    root = tmp_path_factory.mktemp("runs")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    vocab, merges, _, _ = train_byte_level_bpe([corpus], str(root / "bpe"), 300)
    bpe = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges)]
    (prefix,) = preprocess_data.preprocess(
        preprocess_data.parse_args(
            ["--input", str(corpus), "--output-prefix", str(root / "data"), "--append-eod", *bpe]
        )
    )
    out = {
        "gpt2": _train(root / "gpt2", MODEL + ["--data-path", prefix, "--split", "1,0,0", *bpe]),
        "llama": _train(root / "llama", MODEL + LLAMA),
    }
    for family, checkpoint in out.items():
        convert_checkpoint.export_hf(checkpoint, root / f"hf-{family}")
        out[family] = (checkpoint, root / f"hf-{family}")
    return out


def _generate(capsys, *argv) -> dict:
    assert generate.main([*map(str, argv), "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cached_decoding_equals_the_full_forward(family):
    """Prompt in one pass, then one token at a time against the cache: every position's logits equal
    GPT.forward's over the whole sequence. (Planted: rotary angles from position 0 for each new token
    fail the llama case; a mask that lets the prompt see its future fails both.)"""
    shape = dict(
        vocab_size=97,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=48,
        seq_length=24,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    extra = (
        dict(position_embedding="rope", activation="swiglu", normalization="rmsnorm", num_query_groups=2)
        if family == "llama"
        else {}
    )
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape, **extra)).eval()
    tokens = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = model(tokens)
    cache = KVCache(2)
    pieces = [forward_cached(model, tokens[:, :7], cache)]
    pieces += [forward_cached(model, tokens[:, i : i + 1], cache) for i in range(7, 20)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


def test_sampling_filters_as_transformers_does():
    """Temperature, then top-k, then top-p, as transformers' logits warpers (same kept tokens, same
    values). (Planted: keeping tokens while the mass *including* them is below top_p drops one.)"""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(1)
    for _ in range(20):
        logits = torch.randn(50) * 3
        for temperature, top_k, top_p in ((0.7, 0, 0.9), (1.3, 10, 1.0), (1.0, 20, 0.5), (0.5, 5, 0.3)):
            ours = sampling_logits(logits, temperature, top_k, top_p)
            theirs = TemperatureLogitsWarper(temperature)(None, logits[None])
            if top_k:
                theirs = TopKLogitsWarper(top_k)(None, theirs)
            if top_p < 1:
                theirs = TopPLogitsWarper(top_p)(None, theirs)
            torch.testing.assert_close(ours, theirs[0])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_ids_equal_transformers_and_the_folder_works_alone(runs, capsys, family):
    """generate.py --json (greedy, KV cache) against transformers on the exported folder: the same prompt
    ids from AutoTokenizer, the same new ids from generate(do_sample=False), and pipeline() writes the
    prompt and the same continuation. config.json and generation_config.json carry the tokenizer's
    eos id. (Planted: a tokenizer.json built with a dummy prefix makes the prompt ids differ.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    checkpoint, folder = runs[family]
    out = _generate(capsys, "--load", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "12")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert prompt[0].tolist() == out["prompt_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[family]
    record = CheckpointReader(checkpoint).metadata["tokenizer"]
    assert model.config.eos_token_id == model.generation_config.eos_token_id == record["eod"]
    theirs = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert out["ids"] == theirs and len(theirs) >= 1
    text = pipeline("text-generation", model=str(folder))(PROMPT, max_new_tokens=12, do_sample=False)
    assert text[0]["generated_text"] == PROMPT + out["text"], (text, out)


def layout_checkpoint_worker(ctx, directory):
    """Trains 2 steps at tp 2 x pp 2 (tied embedding across the stages) and saves."""
    from tests.layouts import small_config
    from megazero.checkpoint import CheckpointSaver
    from megazero.parallel.topology import Topology
    from megazero.training import train_step

    groups = ctx.groups(Topology(world_size=4, tp=2, pp=2))
    cfg = small_config(tp=2, pp=2, stage=1, steps=2, layers=2)
    state, source = setup_training(cfg, groups)
    for it in range(2):
        train_step(state, source.batch(it), 1e-2)
    CheckpointSaver(directory, "layout-run").save(state, 2 * cfg.global_batch_size)


def test_a_checkpoint_of_another_layout_generates_what_transformers_does(dist_pool, tmp_path, capsys):
    """A tp 2 x pp 2 checkpoint (no tokenizer: --prompt-ids) is read one parameter at a time into one
    process; its greedy ids equal transformers' on its export. A checkpoint without a tokenizer is
    refused by export-hf unless --without-tokenizer. (Planted: load_model without re-tying the head
    reads an output_head.weight the checkpoint does not have.)"""
    from transformers import AutoModelForCausalLM

    dist_pool(4).run(layout_checkpoint_worker, str(tmp_path / "ck"))
    out = _generate(capsys, "--load", tmp_path / "ck", "--prompt-ids", 3, 17, 40, 2, "--max-new-tokens", "8")
    with pytest.raises(UsageError, match="keeps no tokenizer.*--without-tokenizer"):
        convert_checkpoint.export_hf(tmp_path / "ck", tmp_path / "hf")
    convert_checkpoint.export_hf(tmp_path / "ck", tmp_path / "hf", without_tokenizer=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    theirs = model.generate(
        torch.tensor([[3, 17, 40, 2]]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 4:].tolist()
    assert out["ids"] == theirs and out["text"] is None


def test_sampling_is_seeded_and_bounded(runs, capsys):
    """--temperature/--top-k/--top-p sample: the same seed gives the same ids, and top-k 1 is greedy."""
    checkpoint, _ = runs["llama"]
    common = ["--load", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "8"]
    greedy = _generate(capsys, *common)
    assert _generate(capsys, *common, "--temperature", "0.9", "--top-k", "1")["ids"] == greedy["ids"]
    sampled = [
        _generate(capsys, *common, "--temperature", "1.5", "--top-p", "0.9", "--seed", "5")["ids"] for _ in range(2)
    ]
    assert sampled[0] == sampled[1] and len(sampled[0]) >= 1
    assert generate.main(["--load", str(checkpoint), "--prompt", PROMPT, "--top-p", "0"]) == 2
    assert "--top-p 0.0 is out of range" in capsys.readouterr().err


def test_import_brings_the_folders_tokenizer_in(runs, tmp_path, capsys):
    """export -> import-hf -> the imported checkpoint keeps the folder's tokenizer (tokenizer.json, as
    HuggingFaceTokenizer) and generates the same ids as the original; exported again, it encodes the
    same. (Planted: import_hf dropping the tokenizer fails the generate call on --prompt.)"""
    from transformers import AutoTokenizer

    checkpoint, folder = runs["gpt2"]
    directory, kind = convert_checkpoint.import_hf(folder, tmp_path / "imported")
    assert kind == "HuggingFaceTokenizer" and (directory / "tokenizer" / "tokenizer.json").is_file()
    original = _generate(capsys, "--load", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "6")
    imported = _generate(capsys, "--load", tmp_path / "imported", "--prompt", PROMPT, "--max-new-tokens", "6")
    assert imported == original
    convert_checkpoint.export_hf(tmp_path / "imported", tmp_path / "again")
    again = AutoTokenizer.from_pretrained(tmp_path / "again")
    assert again(PROMPT).input_ids == original["prompt_ids"]


def test_tokenizers_transformers_cannot_load_are_refused(tmp_path):
    """The null tokenizer (pre-tokenized ids) and a sentencepiece model that normalizes text cannot be
    written as a tokenizer transformers loads exactly: one line naming why and --without-tokenizer."""
    import sentencepiece as spm

    config = GPTConfig(vocab_size=300, hidden_size=32, num_layers=1, num_attention_heads=4, seq_length=16)
    with torch.device("meta"):
        names = {n: p.shape for n, p in GPT(config).named_parameters()}
    params = {n: torch.zeros(shape) for n, shape in names.items()}
    write_full_checkpoint(
        tmp_path / "null",
        config,
        params,
        "null-run",
        tokenizer={"type": "NullTokenizer", "eod": 299, "vocab_size": 300, "files": {}},
    )
    with pytest.raises(UsageError, match=r"NullTokenizer \(pre-tokenized integer ids\).*--without-tokenizer"):
        convert_checkpoint.export_hf(tmp_path / "null", tmp_path / "hf-null")
    (tmp_path / "text.txt").write_text("\n".join(TEXTS) + "\nCafé ｆｕｌｌｗｉｄｔｈ\n")
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "text.txt"),
        model_prefix=str(tmp_path / "nfkc"),
        vocab_size=120,
        model_type="bpe",
        normalization_rule_name="nmt_nfkc",
        minloglevel=2,
    )
    write_full_checkpoint(
        tmp_path / "nfkc-ck",
        config,
        params,
        "nfkc-run",
        tokenizer={
            "type": "SentencePieceTokenizer",
            "eod": 2,
            "vocab_size": 120,
            "files": {"tokenizer.model": str(tmp_path / "nfkc.model")},
        },
    )
    with pytest.raises(UsageError) as err:
        convert_checkpoint.export_hf(tmp_path / "nfkc-ck", tmp_path / "hf-nfkc")
    assert "it normalizes text ('nmt_nfkc' rules); pass --without-tokenizer" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_qwen2_moe_checkpoint_generates_what_transformers_does(tmp_path, capsys):
    """A mixture of experts with a gated shared expert and q/k/v biases (random weights, no tokenizer:
    --prompt-ids): generate.py's greedy ids equal transformers' Qwen2MoeForCausalLM generate on the
    export-hf folder."""
    from transformers import AutoModelForCausalLM

    config = GPTConfig(
        vocab_size=61,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=16,
        position_embedding="rope",
        activation="swiglu",
        normalization="rmsnorm",
        tie_embeddings=False,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_experts=4,
        moe_ffn_hidden_size=24,
        moe_shared_expert_intermediate_size=40,
        moe_shared_expert_gate=True,
    )
    generator = torch.Generator().manual_seed(4)
    with torch.device("meta"):
        names = {n: p.shape for n, p in GPT(config).named_parameters()}
    write_full_checkpoint(
        tmp_path / "ck", config, {n: torch.randn(s, generator=generator) * 0.3 for n, s in names.items()}, "qwen2-moe"
    )
    out = _generate(capsys, "--load", tmp_path / "ck", "--prompt-ids", 3, 17, 40, 2, "--max-new-tokens", "10")
    convert_checkpoint.export_hf(tmp_path / "ck", tmp_path / "hf", without_tokenizer=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    theirs = model.generate(
        torch.tensor([[3, 17, 40, 2]]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 4:].tolist()
    assert out["ids"] == theirs and len(set(theirs)) > 1


def test_the_position_limit_is_said_and_export_hf_keeps_a_full_folder(tmp_path, capsys):
    """A learned-position model of 16 positions asked for 100 tokens after a 4-token prompt gives 13
    and says why (stderr and `note`); 10 tokens come without a note. export-hf refuses a folder that
    holds a file, naming it, unless --overwrite, and leaves the file as it was. (Planted: no note;
    export_hf without the emptiness check replaces config.json.)"""
    config = GPTConfig(
        vocab_size=61,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=4,
        seq_length=16,
        position_embedding="learned",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    generator = torch.Generator().manual_seed(4)
    with torch.device("meta"):
        names = {n: p.shape for n, p in GPT(config).named_parameters()}
    write_full_checkpoint(
        tmp_path / "ck", config, {n: torch.randn(s, generator=generator) * 0.3 for n, s in names.items()}, "learned"
    )
    prompt = ["--load", tmp_path / "ck", "--prompt-ids", 3, 17, 40, 2]
    assert generate.main([*map(str, prompt), "--max-new-tokens", "100", "--json"]) == 0
    out = capsys.readouterr()
    note = (
        "stopped at the model's position limit: 13 of --max-new-tokens 100 new tokens (the prompt's 4 tokens "
        "and the continuation use all 16 learned positions)"
    )
    assert out.err == f"note: {note}\n" and json.loads(out.out)["note"] == note, out
    assert len(json.loads(out.out)["ids"]) == 13
    assert _generate(capsys, *prompt, "--max-new-tokens", "10")["note"] is None
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("mine\n")
    export = ["export-hf", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "hf"), "--without-tokenizer"]
    assert convert_checkpoint.main(export) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the folder is not empty (config.json); " in err and "--overwrite" in err, err
    assert (tmp_path / "hf" / "config.json").read_text() == "mine\n"
    assert convert_checkpoint.main(export + ["--overwrite"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_positions"] == 16
