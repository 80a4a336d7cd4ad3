"""megazero/data/corpus.py and default_data.py: the embedded corpus's file selection, the default
pipeline's steps cached, and a damaged cache rebuilt with one line saying so."""

import json
import os
import sys
from pathlib import Path

from megazero.data.corpus import collect_stdlib_corpus, is_library_source, stdlib_source_files
from megazero.data.default_data import default_data_dir, default_data_ready, prepare_default_data
from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.tokenizer import load_tokenizer
from tests.data.tiny_data import tiny_tokenizer  # noqa: F401 (a fixture)


def test_stdlib_file_selection(tmp_path):
    for relative in [
        "a.py",
        "pkg/b.py",
        "pkg/test_x.py",
        "test/c.py",
        "pkg/tests/d.py",
        "idlelib/idle_test/e.py",
        "site-packages/f.py",
        "notes.txt",
        "z/y.py",
    ]:
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
    files[1].write_bytes(good[1][:-10])  # truncated: found by its size
    assert not default_data_ready(tmp_path, vocab_size=400)
    prepare_default_data(cache_dir=tmp_path, vocab_size=400, progress=False)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "damaged" in err and "stdlib_text_document.bin has" in err, err
    assert "rebuilding the tokenized corpus" in err and [f.read_bytes() for f in files] == good
    middle = len(good[0]) // 2  # same size, other bytes: the checksum
    files[0].write_bytes(good[0][:middle] + bytes([good[0][middle] ^ 1]) + good[0][middle + 1 :])
    prepare_default_data(cache_dir=tmp_path, vocab_size=400, progress=False)
    err = capsys.readouterr().err.strip()
    assert "tokenizer.model differs" in err and "rebuilding the tokenizer" in err, err
    assert [f.read_bytes() for f in files] == good  # tokenizer and tokens rebuilt alike
    mtimes = [f.stat().st_mtime_ns for f in files]
    prepare_default_data(cache_dir=tmp_path, vocab_size=400, progress=False)
    assert not capsys.readouterr().err and [f.stat().st_mtime_ns for f in files] == mtimes
