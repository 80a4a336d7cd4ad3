"""Tests for megazero.data and the two data tools, on tiny synthetic corpora (whole file: seconds)."""

import json
import os
import pickle
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megazero.data.blended_dataset import BlendedDataset, build_blend_indices
from megazero.data.builders import build_train_valid_test_datasets, parse_data_path
from megazero.data.corpus import collect_stdlib_corpus, is_library_source, stdlib_source_files
from megazero.data.default_data import default_data_dir, default_data_ready, prepare_default_data
from megazero.data.gpt_dataset import GPTDataset, parse_split, split_document_ranges
from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype
from megazero.data.tokenizer import load_tokenizer, train_tokenizer
from megazero.core.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
WORDS = ["data", "value", "index", "result", "count", "total", "item", "name", "path", "size"]


def generated_python(seed, functions):
    """A few KB of Python-shaped text with 4- and 8-space indentation, from a small alphabet."""
    rng = random.Random(seed)
    out = []
    for _ in range(functions):
        a, b = rng.sample(WORDS, 2)
        out.append(f'def {a}_{b}({a}, {b}=None):\n    """Return the {a} of {b}."""\n')
        for _ in range(rng.randint(2, 5)):
            c = rng.choice(WORDS)
            out.append(f"    if {c} > {rng.randint(0, 99)}:\n        {a} = {c} + {b}  # update {c}\n")
        out.append(f"    return {a}\n\n\n")
    return "".join(out)


def write_dataset(prefix, documents, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for tokens in documents:
            builder.add_document(tokens)
        builder.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": generated_python(s, 12)}) + "\n" for s in range(5)))
    return str(train_tokenizer([corpus], folder / "tiny", 400, progress=False)), corpus


# ---------------------------------------------------------------- .bin/.idx format

@pytest.mark.parametrize("dtype, code", [(np.uint16, 8), (np.int32, 4)])
def test_bin_idx_bytes_match_design(tmp_path, dtype, code):
    with IndexedDatasetBuilder(tmp_path / "d", dtype) as builder:
        builder.add_document([1, 2, 3])
        builder.add_document([4, 5])
        builder.add_item([6])            # a document of two sequences
        builder.add_item([7, 8, 9, 10])
        builder.end_document()
        builder.finalize()
    raw = (tmp_path / "d.idx").read_bytes()
    itemsize = np.dtype(dtype).itemsize
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == code
    assert struct.unpack("<QQ", raw[18:34]) == (4, 4)  # 4 sequences, 3 documents + 1
    assert struct.unpack("<4i", raw[34:50]) == (3, 2, 1, 4)
    assert struct.unpack("<4q", raw[50:82]) == (0, 3 * itemsize, 5 * itemsize, 6 * itemsize)
    assert struct.unpack("<4q", raw[82:114]) == (0, 1, 2, 4)
    assert len(raw) == 114
    assert (tmp_path / "d.bin").read_bytes() == np.arange(1, 11, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()

    data = IndexedDataset(tmp_path / "d")
    assert len(data) == 4 and data.num_documents == 3 and data.dtype == np.dtype(dtype)
    assert list(data.sizes) == [3, 2, 1, 4] and list(data.document_indices) == [0, 1, 2, 4]
    assert list(data.get(3)) == [7, 8, 9, 10] and list(data.get(0, offset=1, length=2)) == [2, 3]
    assert list(data[1]) == [4, 5]
    assert list(pickle.loads(pickle.dumps(data)).get(3)) == [7, 8, 9, 10]
    with pytest.raises(IndexError):
        data.get(0, offset=2, length=2)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_best_dtype_and_range_check(tmp_path):
    assert best_dtype(8192) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(100_000) == np.int32
    with pytest.raises(UsageError, match="uint16"):
        with IndexedDatasetBuilder(tmp_path / "big", np.uint16) as builder:
            builder.add_document([70_000])
    assert not list(tmp_path.iterdir())  # temporary files removed


def _corrupt(tmp_path, edit):
    prefix = write_dataset(tmp_path / "c", [[1, 2, 3], [4, 5]])
    edit(Path(prefix + ".idx"), Path(prefix + ".bin"))
    return prefix


def test_largest_token_id_cached_beside_the_index(tmp_path):
    prefix = write_dataset(tmp_path / "s", [[1, 2, 3], [700, 5]])
    stats_file = Path(prefix + ".stats.json")
    assert json.loads(stats_file.read_text())["max_token_id"] == 700      # written with the pair
    assert IndexedDataset(prefix).max_token_id == 700
    stats_file.unlink()                          # a pair made elsewhere: one pass, then cached
    assert IndexedDataset(prefix).max_token_id == 700 and stats_file.is_file()
    bin_path = Path(prefix + ".bin")
    tokens = np.fromfile(bin_path, np.uint16)
    tokens[0] = 900
    tokens.tofile(bin_path)                      # same size, new contents: the cache must not answer
    info = bin_path.stat()
    os.utime(bin_path, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000))
    assert IndexedDataset(prefix).max_token_id == 900


@pytest.mark.parametrize("edit, needle, which", [
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-8]), "truncated", ".idx"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]), "truncated", ".idx"),
    (lambda idx, bin_: idx.write_bytes(b"NOTMEGA!!" + idx.read_bytes()[9:]), "magic", ".idx"),
    (lambda idx, bin_: idx.write_bytes(b"PK\x03\x04"), "magic", ".idx"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:9] + struct.pack("<Q", 2) + idx.read_bytes()[17:]),
     "version 2", ".idx"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:17] + b"\x09" + idx.read_bytes()[18:]), "dtype code 9", ".idx"),
    (lambda idx, bin_: bin_.unlink(), "not found", ".bin"),
    (lambda idx, bin_: idx.unlink(), "not found", ".idx"),
    (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]), "bytes but", ".bin"),
])
def test_bad_files_raise_usage_error_naming_the_file(tmp_path, edit, needle, which):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(UsageError, match=needle) as info:
        IndexedDataset(prefix)
    assert prefix + which in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- splits and GPT samples

def test_parse_split_and_megatron_split_rule():
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    for bad in ["a,b", "1,2,3,4", "0,0,0", "-1,2", ""]:
        with pytest.raises(UsageError, match="split"):
            parse_split(bad)
    # Worked by hand: boundaries 0, +round(f*N) each, then shifted so the last is N.
    assert split_document_ranges(parse_split("949,50,1"), 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_document_ranges([1 / 3] * 3, 10) == [(0, 4), (4, 7), (7, 10)]   # 0,3,6,9 -> +1
    assert split_document_ranges(parse_split("949,50,1"), 3) == [(0, 3), (3, 3), (3, 3)]
    # round(2.5) == 2 (half to even): 0,2,4,4 -> shifted by +1 -> 0,3,5,5
    assert split_document_ranges(parse_split("1,1"), 5) == [(0, 3), (3, 5), (5, 5)]


def test_golden_sample_index_single_document(tmp_path):
    # One 5-token document, seq_length 3, 4 samples: 13 tokens needed -> 3 epochs.
    # Stream: 10 11 12 13 14 | 10 11 12 13 14 | 10 11 12 13 14
    # Sample i starts at stream token 3i: 0, 3, 6, 9 and the end marker 12.
    indexed = IndexedDataset(write_dataset(tmp_path / "g", [[10, 11, 12, 13, 14]]))
    ds = GPTDataset(indexed, "train", (0, 1), num_samples=4, seq_length=3, seed=7)
    assert ds.doc_idx.tolist() == [0, 0, 0]
    assert ds.sample_idx.tolist() == [[0, 0], [0, 3], [1, 1], [1, 4], [2, 2]]
    expected = [[10, 11, 12, 13], [13, 14, 10, 11], [11, 12, 13, 14], [14, 10, 11, 12]]
    assert [ds.sample_tokens(j).tolist() for j in range(4)] == expected
    assert sorted(ds[i]["tokens"].tolist() for i in range(4)) == sorted(expected)
    assert sorted(ds.shuffle_idx.tolist()) == [0, 1, 2, 3]
    assert ds[0]["tokens"].dtype == np.int64
    with pytest.raises(IndexError):
        ds[4]


def test_samples_cross_document_boundaries_and_skip_empty_documents(tmp_path):
    docs = [[1, 2], [3, 4, 5, 6, 7], [], [8], [9, 10, 11]]
    indexed = IndexedDataset(write_dataset(tmp_path / "x", docs))
    ds = GPTDataset(indexed, "train", (0, 5), num_samples=6, seq_length=4, seed=3)
    # 6 * 4 + 1 = 25 tokens from 11-token epochs: 3 epochs, each its own permutation.
    assert len(ds.doc_idx) == 15
    for epoch in range(3):
        assert sorted(ds.doc_idx[epoch * 5:(epoch + 1) * 5].tolist()) == [0, 1, 2, 3, 4]
    # The stream written out independently: documents in doc_idx order, back to back.
    stream = [t for d in ds.doc_idx for t in docs[d]]
    for j in range(6):
        assert ds.sample_tokens(j).tolist() == stream[4 * j:4 * j + 5]
    for position, offset in ds.sample_idx.tolist():  # never points into the empty document
        assert offset < len(docs[ds.doc_idx[position]])
    owners = [{next(i for i, d in enumerate(docs) if t in d) for t in ds.sample_tokens(j).tolist()}
              for j in range(6)]
    assert max(len(o) for o in owners) >= 3  # some 5-token sample spans three documents


def test_document_range_restricts_tokens(tmp_path):
    docs = [[1, 1, 1], [2, 2], [3, 3, 3, 3], [4]]
    indexed = IndexedDataset(write_dataset(tmp_path / "r", docs))
    ds = GPTDataset(indexed, "valid", (1, 3), num_samples=5, seq_length=2, seed=0)
    seen = {t for i in range(5) for t in ds[i]["tokens"].tolist()}
    assert seen == {2, 3}


def test_index_cache_is_reused(tmp_path):
    indexed = IndexedDataset(write_dataset(tmp_path / "k", [[1, 2, 3], [4, 5, 6, 7]]))
    first = GPTDataset(indexed, "train", (0, 2), num_samples=9, seq_length=3, seed=1)
    assert first.built_indices and all(p.parent == tmp_path for p in first.cache_paths.values())
    mtimes = {p: p.stat().st_mtime_ns for p in first.cache_paths.values()}
    second = GPTDataset(indexed, "train", (0, 2), num_samples=9, seq_length=3, seed=1)
    assert not second.built_indices
    assert {p: p.stat().st_mtime_ns for p in second.cache_paths.values()} == mtimes
    assert [second[i]["tokens"].tolist() for i in range(9)] == [first[i]["tokens"].tolist() for i in range(9)]
    other = GPTDataset(indexed, "train", (0, 2), num_samples=9, seq_length=3, seed=2)
    assert other.built_indices and set(other.cache_paths.values()).isdisjoint(mtimes)
    elsewhere = GPTDataset(indexed, "train", (0, 2), 9, 3, 1, cache_dir=tmp_path / "cache")
    assert elsewhere.built_indices and (tmp_path / "cache").is_dir()


# ---------------------------------------------------------------- blending and builders

@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [7, 3], [1, 1, 1, 1, 1], [0.999, 0.001], [0.0, 1.0]])
def test_blend_counts_within_one_of_target_at_every_prefix(weights):
    size = 2000
    dataset_index, sample_index = build_blend_indices(list(np.array(weights) / sum(weights)), size)
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[dataset_index], axis=0)
    targets = np.outer(np.arange(1, size + 1), np.array(weights) / sum(weights))
    assert np.all(np.abs(counts - targets) <= 1.0 + 1e-9)
    for k in range(len(weights)):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert sample_index[dataset_index == k].tolist() == list(range(int((dataset_index == k).sum())))


def test_blended_dataset_items_and_bad_weights():
    a, b = [("a", i) for i in range(10)], [("b", i) for i in range(10)]
    blend = BlendedDataset([a, b], [3, 1], 8)
    # By hand, lag = w*(i+1) - count: i=0 (.75,.25) a; i=1 (.5,.5) tie -> a; i=2 (.25,.75) b; i=3 (1,0) a
    assert [blend[i] for i in range(4)] == [("a", 0), ("a", 1), ("b", 0), ("a", 2)]
    for weights in ([-1, 2], [0, 0], [1]):
        with pytest.raises(UsageError, match="weight"):
            BlendedDataset([a, b], weights, 8)
    with pytest.raises(UsageError, match="has 10"):
        BlendedDataset([a, b], [1, 1], 40)


def test_parse_data_path(tmp_path):
    a = write_dataset(tmp_path / "a", [[1, 2]])
    b = write_dataset(tmp_path / "b", [[3]])
    assert parse_data_path([a]) == [(1.0, a)]
    assert parse_data_path(["0.7", a, "0.3", b]) == [(0.7, a), (0.3, b)]
    assert parse_data_path(f"2 {a} 1 {b}") == [(2.0, a), (1.0, b)]
    with pytest.raises(UsageError, match="pairs"):
        parse_data_path(["0.7", a, "0.3"])
    with pytest.raises(UsageError, match="'x' .* not a number"):
        parse_data_path(["x", a, "0.3", b])
    with pytest.raises(UsageError, match="weight -1 .* non-negative"):
        parse_data_path(["-1", a, "0.3", b])
    with pytest.raises(UsageError, match="all 0"):
        parse_data_path(["0", a, "0", b])
    missing = str(tmp_path / "nope")
    with pytest.raises(UsageError) as info:
        parse_data_path([missing])
    assert f"'{missing}'" in str(info.value) and f"{missing}.bin" in str(info.value) and f"{missing}.idx" in str(info.value)
    with pytest.raises(UsageError, match="without extension"):
        parse_data_path([a + ".bin"])
    # What the user probably meant: preprocess_data's suffix, or a pair inside a folder.
    write_dataset(tmp_path / "c_text_document", [[4]])
    with pytest.raises(UsageError, match=f"did you mean {tmp_path / 'c_text_document'}"):
        parse_data_path([str(tmp_path / "c")])
    with pytest.raises(UsageError, match=f"is a directory.*holds {tmp_path / 'a'}"):
        parse_data_path([str(tmp_path)])


def test_build_train_valid_test_single_and_blended(tmp_path):
    low = write_dataset(tmp_path / "low", [[i % 50 + 1] * 7 for i in range(20)])
    high = write_dataset(tmp_path / "high", [[100 + i] * 5 for i in range(20)])
    train, valid, test = build_train_valid_test_datasets([low], "8,2,0", 4, 1234, (30, 6, 5), progress=False)
    assert test is None and len(train) == 30 and len(valid) == 6
    assert {t for i in range(6) for t in valid[i]["tokens"].tolist()} <= set(range(17, 21))  # docs 16..19
    train, valid, test = build_train_valid_test_datasets(["3", low, "1", high], "8,1,1", 4, 1234,
                                                         (40, 8, 0), progress=False)
    assert test is None and len(train) == 40 and len(valid) == 8
    from_high = [bool(train[i]["tokens"][0] >= 100) for i in range(40)]
    assert sum(from_high) == 10  # 1/4 of 40, exactly, by the greedy blend
    with pytest.raises(UsageError, match="0 of the 20 documents"):
        build_train_valid_test_datasets([low], "1000,1,0", 4, 1, (10, 10, 0), progress=False)


# ---------------------------------------------------------------- tokenizer

ROUND_TRIP_TEXT = (
    "  leading spaces\n"
    "def f(x):\n\tif x:\t\t# tabs\n        return  x   \n\n\n"
    "class Ünïcödé:  # 中文, emoji 🐍, ß\r\n    pass\n"
    "s = '<|endoftext|> is just text here'\n"
    "trailing    "
)


def test_tokenizer_round_trip_exact(tiny_tokenizer):
    tok = load_tokenizer(tiny_tokenizer[0])
    assert tok.vocab_size == 400 and tok.id_to_piece(tok.eod) == "<|endoftext|>"
    ids = tok.encode(ROUND_TRIP_TEXT)
    assert tok.eod not in ids and max(ids) < tok.vocab_size
    assert tok.decode(ids) == ROUND_TRIP_TEXT
    assert tok.decode(ids + [tok.eod]) == ROUND_TRIP_TEXT
    for text in ["", " ", "\n", "\t", "    x", generated_python(99, 3)]:
        assert tok.decode(tok.encode(text)) == text
    # Indentation is learned as whole-run pieces rather than one token per space.
    assert len(tok.encode("        return")) < 4


def test_train_tokenizer_inputs_and_errors(tmp_path, tiny_tokenizer):
    text_file = tmp_path / "plain.txt"
    text_file.write_text(generated_python(5, 20))
    model = train_tokenizer([text_file], tmp_path / "t", 350, progress=False)
    assert load_tokenizer(model).vocab_size == 350 and not list(tmp_path.glob("*.tmp-*"))
    with pytest.raises(UsageError, match="not found"):
        train_tokenizer([tmp_path / "missing.txt"], tmp_path / "t2", 350, progress=False)
    with pytest.raises(UsageError, match="smaller --vocab-size"):
        train_tokenizer([text_file], tmp_path / "t3", 5000, progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n{"body": "y"}\n')
    with pytest.raises(UsageError, match=r"bad.jsonl:2: no string field 'text'"):
        train_tokenizer([bad], tmp_path / "t4", 350, progress=False)
    with pytest.raises(UsageError, match="not a sentencepiece model"):
        load_tokenizer(bad)
    with pytest.raises(UsageError, match="not found"):
        load_tokenizer(tmp_path / "none.model")


# ---------------------------------------------------------------- corpus and default pipeline

def test_stdlib_file_selection(tmp_path):
    for relative in ["a.py", "pkg/b.py", "pkg/test_x.py", "test/c.py", "pkg/tests/d.py",
                     "idlelib/idle_test/e.py", "site-packages/f.py", "notes.txt", "z/y.py"]:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(f"# {relative}\n")
    (tmp_path / "latin.py").write_bytes(b"x = '\xe9'\n")
    assert stdlib_source_files(tmp_path) == ["a.py", "latin.py", "pkg/b.py", "z/y.py"]
    out = collect_stdlib_corpus(tmp_path / "out" / "corpus.jsonl", stdlib_dir=tmp_path, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    paths = [r["path"] for r in rows]
    assert sorted(paths) == ["a.py", "pkg/b.py", "z/y.py"]  # latin.py is not UTF-8
    # the order is a fixed shuffle: the same on every collection, not alphabetical
    again = collect_stdlib_corpus(tmp_path / "again" / "corpus.jsonl", stdlib_dir=tmp_path, progress=False)
    assert [json.loads(line)["path"] for line in again.read_text().splitlines()] == paths
    assert {r["path"]: r["text"] for r in rows}["pkg/b.py"] == "# pkg/b.py\n"
    assert not is_library_source("lib2to3/tests/data/x.py") and is_library_source("json/decoder.py")
    real = stdlib_source_files()
    assert "os.py" in real and not any(p.startswith("test/") for p in real)


def test_prepare_default_data_steps_are_cached(tmp_path, tiny_tokenizer):
    # Seed the corpus step with a tiny corpus so the test trains and tokenizes only a few KB.
    corpus = default_data_dir(tmp_path) / "corpus.jsonl"
    corpus.parent.mkdir(parents=True)
    corpus.write_text(Path(tiny_tokenizer[1]).read_text())
    prefix, model = prepare_default_data(cache_dir=tmp_path, vocab_size=400, progress=False)
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in prefix and "v400" in prefix
    tok, data = load_tokenizer(model), IndexedDataset(prefix)
    assert data.num_documents == 5 and all(data.get(i)[-1] == tok.eod for i in range(5))
    first_doc = json.loads(corpus.read_text().splitlines()[0])["text"]
    assert tok.decode(data.get(0)[:-1].tolist()) == first_doc
    files = [model, prefix + ".bin", prefix + ".idx"]
    mtimes = [os.stat(f).st_mtime_ns for f in files]
    assert prepare_default_data(cache_dir=tmp_path, vocab_size=400, progress=False) == (prefix, model)
    assert [os.stat(f).st_mtime_ns for f in files] == mtimes
    os.unlink(model)  # a redone tokenizer must invalidate the tokens built with the old one
    prepare_default_data(cache_dir=tmp_path, vocab_size=400, progress=False)
    assert os.stat(prefix + ".bin").st_mtime_ns != mtimes[1]


def test_default_data_cache_repairs_itself(tmp_path, tiny_tokenizer, capsys):
    """A damaged cached file (the user did not make it) is rebuilt with one line saying so."""
    corpus = default_data_dir(tmp_path) / "corpus.jsonl"
    corpus.parent.mkdir(parents=True)
    corpus.write_text(Path(tiny_tokenizer[1]).read_text())
    prefix, model = prepare_default_data(cache_dir=tmp_path, vocab_size=400, progress=False)
    files = [Path(model), Path(prefix + ".bin"), Path(prefix + ".idx")]
    good = [f.read_bytes() for f in files]
    assert default_data_ready(tmp_path, vocab_size=400)
    capsys.readouterr()
    files[1].write_bytes(good[1][:-10])                        # truncated: found by its size
    assert not default_data_ready(tmp_path, vocab_size=400)
    prepare_default_data(cache_dir=tmp_path, vocab_size=400, progress=False)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "damaged" in err and "stdlib_text_document.bin has" in err, err
    assert "rebuilding the tokenized corpus" in err and [f.read_bytes() for f in files] == good
    middle = len(good[0]) // 2                                 # same size, other bytes: the checksum
    files[0].write_bytes(good[0][:middle] + bytes([good[0][middle] ^ 1]) + good[0][middle + 1:])
    prepare_default_data(cache_dir=tmp_path, vocab_size=400, progress=False)
    err = capsys.readouterr().err.strip()
    assert "tokenizer.model differs" in err and "rebuilding the tokenizer" in err, err
    assert [f.read_bytes() for f in files] == good              # tokenizer and tokens rebuilt alike
    mtimes = [f.stat().st_mtime_ns for f in files]
    prepare_default_data(cache_dir=tmp_path, vocab_size=400, progress=False)
    assert not capsys.readouterr().err and [f.stat().st_mtime_ns for f in files] == mtimes


# ---------------------------------------------------------------- tools

def run_tool(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_preprocess_cli_workers_give_identical_files(tmp_path, tiny_tokenizer):
    model, corpus = tiny_tokenizer
    code_file = tmp_path / "module.txt"
    code_file.write_text(ROUND_TRIP_TEXT)
    outputs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        result = run_tool("tools/preprocess_data.py", "--input", str(corpus), str(code_file),
                          "--output-prefix", str(prefix), "--tokenizer-model", model,
                          "--append-eod", "--workers", str(workers), "--chunksize", "2")
        assert result.returncode == 0, result.stderr
        assert "docs/s" in result.stderr and "MB/s" in result.stderr
        outputs.append([Path(f"{prefix}_text_document{ext}").read_bytes() for ext in (".bin", ".idx")])
    assert outputs[0] == outputs[1]
    data, tok = IndexedDataset(tmp_path / "w2_text_document"), load_tokenizer(model)
    assert data.num_documents == 6 and tok.decode(data.get(5)[:-1].tolist()) == ROUND_TRIP_TEXT


def test_tools_report_usage_errors_without_traceback(tmp_path, tiny_tokenizer):
    result = run_tool("tools/preprocess_data.py", "--input", str(tiny_tokenizer[1]), "--output-prefix",
                      str(tmp_path / "o"), "--tokenizer-model", str(tmp_path / "missing.model"), "--workers", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "missing.model" in result.stderr and not list(tmp_path.iterdir())
    result = run_tool("tools/train_tokenizer.py", "--input", str(tmp_path / "nope.txt"),
                      "--model-prefix", str(tmp_path / "t"), "--vocab-size", "300")
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def test_train_tokenizer_cli_is_reproducible_across_processes(tmp_path, tiny_tokenizer):
    models = []
    for run in range(2):
        result = run_tool("tools/train_tokenizer.py", "--input", str(tiny_tokenizer[1]), "--vocab-size", "400",
                          "--model-prefix", str(tmp_path / f"run{run}"), "--input-sentence-size", "200")
        assert result.returncode == 0, result.stderr
        models.append((tmp_path / f"run{run}.model").read_bytes())
    assert models[0] == models[1]  # sampled lines and training are seeded, so ranks agree
