"""The zero-configuration dataset: this Python's standard library, tokenized, ready to train on.

`prepare_default_data()` runs three cached steps, each skipped when its output exists and
redone (with everything after it) when it does not:

    collect corpus   -> <cache>/data/stdlib-<impl>-<version>-shuffled/corpus.jsonl
    train tokenizer  -> <cache>/data/stdlib-<impl>-<version>-shuffled/v<vocab>/tokenizer.model
    tokenize (+EOD)  -> <cache>/data/stdlib-<impl>-<version>-shuffled/v<vocab>/stdlib_text_document.{bin,idx}

The directory names carry the interpreter version and the vocabulary size, so different
Pythons or vocabularies never read each other's files. Every step writes atomically.

The cache repairs itself, since the user did not make it: each step records its output's size and
SHA-256 in `<folder>/manifest.json`, and a file that no longer matches (truncated, edited) is
rebuilt, with everything built from it, after one line saying so. A file the manifest does not know
(a cache from before the manifest) is kept if it reads back whole, and recorded.

Owns this recipe only; the pieces live in corpus.py, tokenizer.py and indexed_dataset.py.
"""

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

from megazero.data.corpus import Progress, collect_stdlib_corpus, default_cache_dir, iter_jsonl_texts, write_atomically
from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype, data_file_paths
from megazero.data.tokenizer import load_tokenizer, train_tokenizer
from megazero.core.errors import UsageError

# 8192 pieces: measured on CPython 3.11's stdlib (12 MB of source) on 2 cores, training takes
# ~1.5 s and gives ~3.5 bytes per token (4096: 3.2); the whole first run stays a few seconds,
# far inside the 90 s budget, and the embedding table stays small for CPU test models.
DEFAULT_VOCAB_SIZE = 8192

# Lines sampled for tokenizer training; the stdlib has ~330k, and 200k trains in about a second
# with no measurable change in tokens per byte.
TOKENIZER_TRAINING_LINES = 200_000

# Documents handed to sentencepiece per call: its threads split a call's list between them, and
# with 64 one long file kept a thread busy alone (1.8 s vs 1.3 s for the stdlib at 256).
ENCODE_BATCH = 256


def default_data_dir(cache_dir=None):
    """The folder of the default corpus for this interpreter (the key includes its version)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    # "-shuffled": the corpus order changed (documents are shuffled before the split); older caches
    # hold the sorted order and must not be reused.
    return root / "data" / f"stdlib-{sys.implementation.name}-{platform.python_version()}-shuffled"


def tokenize_corpus(corpus_path, tokenizer, output_prefix, progress=True):
    """Writes every document of the JSONL corpus as one sequence, EOD appended, to `output_prefix`."""
    texts = list(iter_jsonl_texts(corpus_path, "text"))
    meter = Progress("tokenizing corpus", total=len(texts), enabled=progress)
    with IndexedDatasetBuilder(output_prefix, best_dtype(tokenizer.vocab_size)) as builder:
        for first in range(0, len(texts), ENCODE_BATCH):
            for ids in tokenizer.encode_batch(texts[first : first + ENCODE_BATCH]):
                builder.add_document(ids + [tokenizer.eod])
            meter.update(min(first + ENCODE_BATCH, len(texts)), "documents")
        builder.finalize()
    meter.finish(len(texts), f"documents, {builder.num_tokens} tokens,")
    return builder.num_tokens


def cache_origin(cache_dir=None):
    """How to name the cache root in a message: the flag or variable that chose it."""
    if cache_dir:
        return f"--data-cache-path {cache_dir}"
    if os.environ.get("MEGAZERO_CACHE"):
        return f"MEGAZERO_CACHE={os.environ['MEGAZERO_CACHE']}"
    return f"the default cache {default_cache_dir()} (MEGAZERO_CACHE moves it)"


def _default_paths(cache_dir, vocab_size):
    folder = default_data_dir(cache_dir)
    vocab_folder = folder / f"v{vocab_size}"
    data_prefix = vocab_folder / "stdlib_text_document"
    return folder, folder / "corpus.jsonl", vocab_folder / "tokenizer", data_prefix


def default_data_files(cache_dir=None, vocab_size=DEFAULT_VOCAB_SIZE):
    """(data_prefix, tokenizer_model) where prepare_default_data puts them; nothing is checked."""
    _, _, model_prefix, data_prefix = _default_paths(cache_dir, vocab_size)
    return str(data_prefix), f"{model_prefix}.model"


def _digest(path):
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _read_manifest(folder):
    try:
        record = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _record(folder, manifest, paths):
    for path in map(Path, paths):
        manifest[path.relative_to(folder).as_posix()] = {"bytes": path.stat().st_size, "sha256": _digest(path)}
    text = json.dumps(manifest, indent=1, sort_keys=True)
    write_atomically(folder / "manifest.json", lambda handle: handle.write(text))


def _damage(folder, manifest, paths, reads_back):
    """Why the step's cached `paths` cannot be used (missing, or not what was recorded), or None.
    Files the manifest does not know are kept when `reads_back()` succeeds."""
    for path in map(Path, paths):
        if not path.is_file():
            return "missing"
        known = manifest.get(path.relative_to(folder).as_posix())
        if known is None:
            try:
                reads_back()
            except UsageError:
                return f"{path.name} does not read back"
            continue
        size = path.stat().st_size
        if size != known.get("bytes"):
            return f"{path.name} has {size} bytes, {known.get('bytes')} were written"
        if _digest(path) != known.get("sha256"):
            return f"{path.name} differs from what was written (checksum)"
    return None


def default_data_ready(cache_dir=None, vocab_size=DEFAULT_VOCAB_SIZE):
    """True when every cached step is present with its recorded size (a quick look, no checksums):
    the run will then read the cache and write nothing there but sample indices."""
    folder, corpus, model_prefix, data_prefix = _default_paths(cache_dir, vocab_size)
    manifest = _read_manifest(folder)
    for path in (corpus, Path(f"{model_prefix}.model"), *data_file_paths(data_prefix)):
        known = manifest.get(path.relative_to(folder).as_posix())
        if known is None or not path.is_file() or path.stat().st_size != known.get("bytes"):
            return False
    return True


def prepare_default_data(cache_dir=None, vocab_size=DEFAULT_VOCAB_SIZE, progress=True):
    """Returns (data_prefix, tokenizer_model) for the stdlib corpus, building or repairing what is
    missing or damaged.

    `data_prefix` is what `--data-path` takes (no extension); `tokenizer_model` is the
    sentencepiece `.model` the data was tokenized with.
    """
    folder, corpus_path, model_prefix, data_prefix = _default_paths(cache_dir, vocab_size)
    model_path = Path(f"{model_prefix}.model")
    manifest = _read_manifest(folder)
    steps = [
        (
            "corpus",
            [corpus_path],
            lambda: sum(1 for _ in iter_jsonl_texts(corpus_path)),
            lambda: collect_stdlib_corpus(corpus_path, progress=progress),
        ),
        (
            "tokenizer",
            [model_path],
            lambda: load_tokenizer(model_path),
            lambda: train_tokenizer(
                [corpus_path], model_prefix, vocab_size, input_sentence_size=TOKENIZER_TRAINING_LINES, progress=progress
            ),
        ),
        (
            "tokenized corpus",
            data_file_paths(data_prefix),
            lambda: IndexedDataset(data_prefix),
            lambda: tokenize_corpus(corpus_path, load_tokenizer(model_path), data_prefix, progress=progress),
        ),
    ]
    try:
        _run_steps(folder, manifest, steps)
    except OSError as err:  # a full disk, or a cache that changed under us
        raise UsageError(
            f"cannot write the embedded corpus cache in {folder} ({err.strerror or err}); "
            "free space there or point MEGAZERO_CACHE elsewhere"
        ) from None
    return str(data_prefix), str(model_path)


def _run_steps(folder, manifest, steps):
    """Each (name, outputs, reads_back, build) step: kept if intact, else rebuilt with those after it."""
    # A redone step invalidates what was built from its old output.
    stale = False
    for name, paths, reads_back, build in steps:
        damage = None if stale else _damage(folder, manifest, paths, reads_back)
        if stale or damage:
            if damage and damage != "missing":
                print(
                    f"megazero: the embedded corpus cache in {folder} is damaged ({damage}); rebuilding the {name}",
                    file=sys.stderr,
                    flush=True,
                )
            for path in paths:
                Path(path).unlink(missing_ok=True)
            build()
            stale = True
        if stale or any(Path(p).relative_to(folder).as_posix() not in manifest for p in paths):
            _record(folder, manifest, paths)
