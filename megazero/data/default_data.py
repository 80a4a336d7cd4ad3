"""The zero-configuration dataset: this Python's standard library, tokenized, ready to train on.

`prepare_default_data()` runs three cached steps, each skipped when its output exists and
redone (with everything after it) when it does not:

    collect corpus   -> <cache>/data/stdlib-<impl>-<version>-shuffled/corpus.jsonl
    train tokenizer  -> <cache>/data/stdlib-<impl>-<version>-shuffled/v<vocab>/tokenizer.model
    tokenize (+EOD)  -> <cache>/data/stdlib-<impl>-<version>-shuffled/v<vocab>/stdlib_text_document.{bin,idx}

The directory names carry the interpreter version and the vocabulary size, so different
Pythons or vocabularies never read each other's files. Every step writes atomically.

Owns this recipe only; the pieces live in corpus.py, tokenizer.py and indexed_dataset.py.
"""

import platform
import sys
from pathlib import Path

from megazero.data.corpus import Progress, collect_stdlib_corpus, default_cache_dir, iter_jsonl_texts
from megazero.data.indexed_dataset import IndexedDatasetBuilder, best_dtype, data_file_paths
from megazero.data.tokenizer import load_tokenizer, train_tokenizer

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
            for ids in tokenizer.encode_batch(texts[first:first + ENCODE_BATCH]):
                builder.add_document(ids + [tokenizer.eod])
            meter.update(min(first + ENCODE_BATCH, len(texts)), "documents")
        builder.finalize()
    meter.finish(len(texts), f"documents, {builder.num_tokens} tokens,")
    return builder.num_tokens


def prepare_default_data(cache_dir=None, vocab_size=DEFAULT_VOCAB_SIZE, progress=True):
    """Returns (data_prefix, tokenizer_model) for the stdlib corpus, building what is missing.

    `data_prefix` is what `--data-path` takes (no extension); `tokenizer_model` is the
    sentencepiece `.model` the data was tokenized with.
    """
    folder = default_data_dir(cache_dir)
    corpus_path = folder / "corpus.jsonl"
    vocab_folder = folder / f"v{vocab_size}"
    model_prefix = vocab_folder / "tokenizer"
    model_path = Path(f"{model_prefix}.model")
    data_prefix = vocab_folder / "stdlib_text_document"

    # A redone step invalidates what was built from its old output.
    stale = not corpus_path.is_file()
    collect_stdlib_corpus(corpus_path, progress=progress)
    stale = stale or not model_path.is_file()
    if stale:
        train_tokenizer([corpus_path], model_prefix, vocab_size,
                        input_sentence_size=TOKENIZER_TRAINING_LINES, progress=progress)
    stale = stale or not all(p.is_file() for p in data_file_paths(data_prefix))
    if stale:
        tokenize_corpus(corpus_path, load_tokenizer(model_path), data_prefix, progress=progress)
    return str(data_prefix), str(model_path)
