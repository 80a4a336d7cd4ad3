"""Tiny synthetic corpora and datasets the data and data-tool tests share (seconds to build)."""

import json
import random

import numpy as np
import pytest

from megazero.data.indexed_dataset import IndexedDatasetBuilder
from megazero.data.tokenizer import train_tokenizer

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


ROUND_TRIP_TEXT = (
    "  leading spaces\n"
    "def f(x):\n\tif x:\t\t# tabs\n        return  x   \n\n\n"
    "class Ünïcödé:  # 中文, emoji 🐍, ß\r\n    pass\n"
    "s = '<|endoftext|> is just text here'\n"
    "trailing    "
)
