"""Megatron-LM's TikTokenizer (--tokenizer-type TikTokenizer --tokenizer-model VOCAB.json
--tiktoken-pattern v1|v2) through the optional `tiktoken` package (pip install -e '.[tiktoken]').

The vocabulary is Megatron's JSON file: a list of {"rank", "token_bytes" (base64), "token_str"},
rank i the i-th merge, the first 256 the single bytes; it is read from a local path only (nothing is
downloaded). Ids as Megatron gives them: the first `num_special_tokens` (1000) ids are special tokens
(<unk>, <s>, </s>, <mask>, <pad>, <cls>, <sep>, then <SPECIAL_7> ...), the vocabulary's ranks follow,
cut so that the whole is `vocab_size` (--vocab-size, default 2^17); end of document is </s> (id 2).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from megazero.core.errors import UsageError

# Megatron's split patterns, by the names --tiktoken-pattern takes.
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
NUM_SPECIAL_TOKENS = 1000
DEFAULT_VOCAB_SIZE = 2**17


def _tiktoken():
    try:
        import tiktoken
    except ImportError:
        raise UsageError(
            "--tokenizer-type TikTokenizer needs the tiktoken package; install it with "
            "pip install -e '.[tiktoken]' (or pip install tiktoken)"
        ) from None
    return tiktoken


def _mergeable_ranks(path: Path, inner_vocab: int) -> dict[bytes, int]:
    try:
        entries = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(
            f"--tokenizer-model {path} is not a readable TikTokenizer vocabulary JSON ({err}); "
            f"give Megatron's tiktoken vocabulary file"
        ) from None
    if not isinstance(entries, list):
        raise UsageError(
            f"--tokenizer-model {path}: a TikTokenizer vocabulary is a JSON list of {{rank, token_bytes, token_str}}"
        )
    ranks = {}
    for i, entry in enumerate(entries[:inner_vocab]):
        if not isinstance(entry, dict) or entry.get("rank") != i or "token_bytes" not in entry:
            raise UsageError(
                f'--tokenizer-model {path}: entry {i} is not {{"rank": {i}, "token_bytes": '
                f"...}}; the file is not a TikTokenizer vocabulary"
            )
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise UsageError(f"--tokenizer-model {path}: rank {i} must be the single byte {i}")
        ranks[token] = i + NUM_SPECIAL_TOKENS
    return ranks


class TikTokenizer:
    tokenizer_type = "TikTokenizer"

    def __init__(self, model_path, pattern: str | None = None, vocab_size: int | None = None):
        tiktoken = _tiktoken()
        path = Path(model_path)
        if not path.is_file():
            raise UsageError(
                f"--tokenizer-model {model_path}: no such file; TikTokenizer reads a local "
                f"vocabulary JSON (nothing is downloaded)"
            )
        self.vocab_size = int(vocab_size or DEFAULT_VOCAB_SIZE)
        if self.vocab_size <= NUM_SPECIAL_TOKENS + 256:
            raise UsageError(
                f"--vocab-size {self.vocab_size} leaves no room for TikTokenizer's "
                f"{NUM_SPECIAL_TOKENS} special tokens and 256 bytes"
            )
        ranks = _mergeable_ranks(path, self.vocab_size - NUM_SPECIAL_TOKENS)
        self.vocab_size = NUM_SPECIAL_TOKENS + len(ranks)
        specials = SPECIAL_TOKENS + [f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), NUM_SPECIAL_TOKENS)]
        self.encoding = tiktoken.Encoding(
            name=path.stem,
            pat_str=PATTERNS[pattern or "v2"],
            mergeable_ranks=ranks,
            special_tokens={t: i for i, t in enumerate(specials)},
        )
        self.eod = SPECIAL_TOKENS.index("</s>")
        self.model_path = str(path)

    def encode(self, text):
        return self.encoding.encode(text, disallowed_special=())

    def encode_batch(self, texts, num_threads=-1):
        return self.encoding.encode_ordinary_batch(list(texts))

    def decode(self, ids):
        return self.encoding.decode([int(i) for i in ids])
