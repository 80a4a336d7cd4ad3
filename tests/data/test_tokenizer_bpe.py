"""The tokenizer types of `--tokenizer-type`: GPT-2 BPE and Hugging Face tokenizers give the ids the
`tokenizers`/`transformers` references give, through preprocess_data into .bin/.idx; the null
tokenizer reads ids; a Megatron-format GPT-2 pair trains as it is. Nothing is downloaded: the
vocabularies are trained here on a few lines."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from megazero.config.train_flags import config_from_args, parse_args
from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.tokenizer import build_tokenizer
from megazero.core.errors import UsageError
from tests.metrics_reading import metrics_records

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools import preprocess_data  # noqa: E402

TRAIN_LINES = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Don't panic!",
    "for i in range(10):\n\tprint(i ** 2)  # squares",
    "Größe, naïve café, 東京, emoji 🙂 and numbers 12345 67.89",
] * 4
# Unseen words, runs of spaces, tabs, CRLF, non-Latin scripts, a character absent from training.
TEXTS = [
    "def multiply(x, y):\n        return x * y\r\n",
    "   leading spaces and trailing   ",
    "Zebras don't jump; they're quick-ish. 3.14159",
    "日本語のテキスト and ελληνικά ✓ 🙂🙂",
    "",
]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A GPT-2-style vocab.json/merges.txt: a byte-level BPE trained here, <|endoftext|> included."""
    folder = tmp_path_factory.mktemp("gpt2")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        TRAIN_LINES, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False
    )
    vocab, merges = bpe.save_model(str(folder))
    return Path(vocab), Path(merges)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A Llama-style Hugging Face tokenizer folder: BPE with a BOS post-processor, eos named in the config."""
    folder = tmp_path_factory.mktemp("hf")
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        TRAIN_LINES, trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["<unk>", "<s>", "</s>"])
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _preprocess(tmp_path, texts, *tokenizer_flags, workers=1):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    args = preprocess_data.parse_args(
        [
            "--input",
            str(corpus),
            "--output-prefix",
            str(tmp_path / "out"),
            "--append-eod",
            "--workers",
            str(workers),
            "--log-interval",
            "1000",
            *tokenizer_flags,
        ]
    )
    (prefix,) = preprocess_data.preprocess(args)
    data = IndexedDataset(prefix)
    return data, [data[i].tolist() for i in range(len(data))]


def test_gpt2_bpe_gives_the_references_ids(gpt2_files, tmp_path):
    from transformers import GPT2TokenizerFast

    vocab, merges = gpt2_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    library = tokenizers.ByteLevelBPETokenizer(str(vocab), str(merges))
    hf = GPT2TokenizerFast.from_pretrained(str(vocab.parent))  # reads vocab.json + merges.txt, offline
    table = json.loads(vocab.read_text())
    assert ours.vocab_size == len(table) and ours.eod == table["<|endoftext|>"] == hf.eos_token_id
    for text in TEXTS:
        expected = hf(text)["input_ids"]
        assert ours.encode(text) == library.encode(text).ids == expected, text
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode_batch(TEXTS) == [hf(t)["input_ids"] for t in TEXTS]
    # Two workers: the tokenizer is rebuilt in each from its flags; ids come back in input order.
    data, docs = _preprocess(
        tmp_path,
        TEXTS,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(vocab),
        "--merge-file",
        str(merges),
        workers=2,
    )
    assert data.dtype == np.uint16  # Megatron's choice for a vocabulary under 65,500
    assert docs == [hf(t)["input_ids"] + [hf.eos_token_id] for t in TEXTS]


def test_hugging_face_tokenizer_gives_the_references_ids(hf_folder, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_folder))
    for path in (hf_folder, hf_folder / "tokenizer.json"):
        ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
        assert ours.eod == hf.eos_token_id == hf.convert_tokens_to_ids("</s>")
        assert ours.vocab_size == len(hf)
        for text in TEXTS:
            assert ours.encode(text) == hf(text)["input_ids"], text
            assert ours.encode(text)[0] == hf.bos_token_id  # the tokenizer's own BOS, as transformers adds it
    data, docs = _preprocess(
        tmp_path, TEXTS, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_folder)
    )
    assert docs == [hf(t)["input_ids"] + [hf.eos_token_id] for t in TEXTS]


def test_null_tokenizer_reads_ids(tmp_path):
    ours = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (ours.vocab_size, ours.eod) == (100, 99)
    assert ours.encode(" 5 17\n0\t98 ") == [5, 17, 0, 98] and ours.decode([5, 17]) == "5 17"
    for bad, words in (("3 100", "outside [0, 100)"), ("3 x7", "integer token ids")):
        with pytest.raises(UsageError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            ours.encode(bad)
    _, docs = _preprocess(tmp_path, ["1 2 3", "42"], "--tokenizer-type", "NullTokenizer", "--vocab-size", "100")
    assert docs == [[1, 2, 3, 99], [42, 99]]


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (
            dict(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json"),
            "needs --vocab-file (vocab.json) and --merge-file",
        ),
        (
            dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/none/v.json", merge_file="m.txt"),
            "--vocab-file /none/v.json not found",
        ),
        (dict(tokenizer_type="HuggingFaceTokenizer"), "HuggingFaceTokenizer needs --tokenizer-model"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/none"), "--tokenizer-model /none not found"),
        (dict(tokenizer_type="NullTokenizer"), "NullTokenizer needs --vocab-size"),
        (dict(tokenizer_type="NullTokenizer", vocab_size=1), "--vocab-size >= 2"),
        (dict(tokenizer_type="SentencePieceTokenizer"), "needs --tokenizer-model"),
    ],
)
def test_missing_tokenizer_inputs_name_the_flag(kwargs, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build_tokenizer(**kwargs)


def test_foreign_files_are_one_line_errors(tmp_path, gpt2_files, hf_folder):
    vocab, _ = gpt2_files
    (tmp_path / "eos").mkdir()
    (tmp_path / "eos" / "tokenizer.json").write_bytes((hf_folder / "tokenizer.json").read_bytes())
    (tmp_path / "eos" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>"}}))
    with pytest.raises(UsageError, match="names eos_token '<end>', which is not in the vocabulary"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path / "eos")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UsageError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path)
    (tmp_path / "merges.txt").write_text("#version: 0.2\nnot-a-pair-line with three\n")
    with pytest.raises(UsageError, match="not a GPT-2 BPE pair"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=tmp_path / "merges.txt")


def _write_megatron_pair(prefix, documents):
    """A .bin/.idx pair byte for byte as Megatron's preprocess_data writes it (uint16, code 8)."""
    sizes = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1]) * 2]).astype(np.int64)
    Path(f"{prefix}.bin").write_bytes(np.concatenate(documents).astype(np.uint16).tobytes())
    header = b"MMIDIDX\x00\x00" + np.uint64(1).tobytes() + np.uint8(8).tobytes()
    header += np.uint64(len(sizes)).tobytes() + np.uint64(len(sizes) + 1).tobytes()
    body = sizes.tobytes() + pointers.tobytes() + np.arange(len(sizes) + 1, dtype=np.int64).tobytes()
    Path(f"{prefix}.idx").write_bytes(header + body)


def test_megatron_gpt2_data_trains_as_it_is(gpt2_files, tmp_path, capsys):
    from megazero.run import launch

    vocab, merges = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    documents = [np.array(tok.encode(t) + [tok.eod]) for t in (TRAIN_LINES + TEXTS[:4]) * 2]
    prefix = tmp_path / "megatron_text_document"
    _write_megatron_pair(prefix, documents)
    run_dir = tmp_path / "run"
    argv = [
        "--data-path",
        str(prefix),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(vocab),
        "--merge-file",
        str(merges),
        "--split",
        "1,0,0",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "2",
        "--eval-iters",
        "0",
        "--log-interval",
        "1",
        "--run-dir",
        str(run_dir),
    ]
    assert launch.main(argv) == 0, capsys.readouterr().err
    records = metrics_records(run_dir / "metrics.jsonl")
    assert len([r for r in records if "loss" in r]) == 2
    assert config_from_args(parse_args(argv)).model.vocab_size == tok.vocab_size


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs --data-path"),
        (["--vocab-size", "10"], "--vocab-size needs --data-path"),
        (["--data-path", "PAIR", "--tokenizer-type", "NullTokenizer"], "NullTokenizer needs --vocab-size"),
        (["--data-path", "PAIR", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v"], "and --merge-file"),
    ],
)
def test_training_flags_name_what_is_missing(argv, words, tmp_path):
    _write_megatron_pair(tmp_path / "pair", [np.array([1, 2, 3])])
    with pytest.raises(UsageError, match=words):
        config_from_args(parse_args([str(tmp_path / "pair") if a == "PAIR" else a for a in argv]))


def test_trained_byte_level_bpe_loads_everywhere(tmp_path):
    """train_tokenizer.py's byte-level BPE: its vocab/merges pair and its tokenizer.json folder agree
    with each other and with transformers reading the same files."""
    import shutil

    from transformers import AutoTokenizer, GPT2TokenizerFast

    from megazero.data.tokenizer_bpe import train_byte_level_bpe

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TRAIN_LINES), encoding="utf-8")
    vocab, merges, tokenizer_json, _ = train_byte_level_bpe([corpus], tmp_path / "bpe", 300)
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_json.parent)
    (tmp_path / "pair").mkdir()
    shutil.copy(vocab, tmp_path / "pair" / "vocab.json")
    shutil.copy(merges, tmp_path / "pair" / "merges.txt")
    references = [
        GPT2TokenizerFast.from_pretrained(str(tmp_path / "pair")),
        AutoTokenizer.from_pretrained(str(tokenizer_json.parent)),
    ]
    assert gpt2.vocab_size == hf.vocab_size == 300 and gpt2.eod == hf.eod == references[1].eos_token_id
    for text in TEXTS:
        assert (
            gpt2.encode(text) == hf.encode(text) == references[0](text)["input_ids"] == references[1](text)["input_ids"]
        ), text
        assert gpt2.decode(gpt2.encode(text)) == text
