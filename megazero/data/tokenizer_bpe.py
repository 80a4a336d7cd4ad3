"""The tokenizers that are not sentencepiece: GPT-2 byte-level BPE, a Hugging Face `tokenizer.json`,
and the null tokenizer for pre-tokenized text. Each offers what megazero.data.tokenizer's
sentencepiece `Tokenizer` does: `encode`, `encode_batch`, `decode`, `vocab_size`, `eod`.

The BPE work is the Hugging Face `tokenizers` library's (Rust), never hand-written here; this
module only assembles its pieces the way each format expects and finds the end-of-document id,
and trains a GPT-2-style byte-level BPE (`train_byte_level_bpe`) for tools/train_tokenizer.py.
It must not know about flags: `megazero.data.tokenizer.build_tokenizer` picks a tokenizer.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from megazero.data.corpus import iter_documents, write_atomically
from megazero.core.errors import UsageError

GPT2_EOD = "<|endoftext|>"
# Tried in order when a tokenizer.json comes without a tokenizer_config.json naming its eos_token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def _readable_file(path, flag, fix):
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{flag} {path} not found; {fix}")
    return path


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE from its `vocab.json` + `merges.txt` (Megatron's `GPT2BPETokenizer`).

    Like Megatron's, the text is split with GPT-2's regex, no space is prepended, and the literal
    string `<|endoftext|>` inside a document is ordinary text: only the preprocessor appends `eod`.
    """

    tokenizer_type = "GPT2BPETokenizer"

    def __init__(self, vocab_file, merge_file):
        vocab_file = _readable_file(vocab_file, "--vocab-file", "pass GPT-2's vocab.json")
        merge_file = _readable_file(merge_file, "--merge-file", "pass GPT-2's merges.txt")
        try:
            model = models.BPE.from_file(str(vocab_file), str(merge_file))
        except Exception as exc:  # the Rust side raises plain Exception for any unreadable file
            raise UsageError(
                f"--vocab-file {vocab_file} / --merge-file {merge_file} are not a GPT-2 BPE pair "
                f"({str(exc).strip() or type(exc).__name__}); pass vocab.json and merges.txt"
            ) from None
        self._tok = _RustTokenizer(model)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        vocab = self._tok.get_vocab()
        if GPT2_EOD not in vocab:
            raise UsageError(f"--vocab-file {vocab_file} has no '{GPT2_EOD}' entry; pass GPT-2's vocab.json")
        self.eod = vocab[GPT2_EOD]
        self.vocab_size = max(vocab.values()) + 1
        self.model_path = str(vocab_file)
        self.merge_file = str(merge_file)

    def encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts, num_threads=-1):
        """The library spreads the batch over its own thread pool (RAYON_NUM_THREADS bounds it)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def files(self):
        """The files that rebuild this tokenizer: {name in a checkpoint: path}."""
        return {"vocab.json": self.model_path, "merges.txt": self.merge_file}

    def rust_tokenizer(self):
        """The `tokenizers` object doing the work (export writes it as tokenizer.json)."""
        return self._tok


def _configured_eos(folder):
    """The eos_token named by tokenizer_config.json or special_tokens_map.json beside the file."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise UsageError(f"{path} is not a JSON object; fix or remove it") from None
        if isinstance(eos, dict):  # transformers writes AddedToken as {"content": ..., ...}
            eos = eos.get("content")
        if eos:
            return eos, path
    return None, None


class HuggingFaceTokenizer:
    """A Hugging Face fast tokenizer (`tokenizer.json`, or the directory holding it).

    `encode` adds the tokenizer's own special tokens (a Llama tokenizer's BOS), as
    `AutoTokenizer(text).input_ids` and Megatron's `HuggingFaceTokenizer` do; `eod` is the
    `eos_token` of `tokenizer_config.json` when present, else a usual end-of-text token.
    """

    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        _readable_file(file, "--tokenizer-model", "pass a Hugging Face tokenizer directory or its tokenizer.json")
        try:
            self._tok = _RustTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises plain Exception for a malformed file
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UsageError(
                f"--tokenizer-model {file} is not a Hugging Face tokenizer.json ({first}); "
                "pass the tokenizer.json a fast tokenizer saves"
            ) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos, source = _configured_eos(file.parent)
        if eos is None:
            eos = next((c for c in EOS_CANDIDATES if c in vocab), None)
            reason = f"no eos_token configured and none of {', '.join(EOS_CANDIDATES)} in the vocabulary"
        else:
            reason = f"{source} names eos_token {eos!r}, which is not in the vocabulary"
        if eos not in vocab:
            raise UsageError(
                f"--tokenizer-model {file}: no end-of-document token ({reason}); "
                "set eos_token in tokenizer_config.json beside it"
            )
        self.eod = vocab[eos]
        self.vocab_size = max(vocab.values()) + 1
        self.model_path = str(file)

    def encode(self, text):
        return self._tok.encode(text).ids

    def encode_batch(self, texts, num_threads=-1):
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def files(self):
        """tokenizer.json and the configuration files transformers writes beside it."""
        folder = Path(self.model_path).parent
        extra = [n for n in ("tokenizer_config.json", "special_tokens_map.json") if (folder / n).is_file()]
        return {"tokenizer.json": self.model_path, **{n: str(folder / n) for n in extra}}


class NullTokenizer:
    """Pre-tokenized text: a document is whitespace-separated integer ids below `vocab_size`.

    `eod` is `vocab_size - 1`, the last id of the vocabulary, so `--vocab-size` counts it.
    """

    tokenizer_type = "NullTokenizer"

    def __init__(self, vocab_size):
        if vocab_size is None or int(vocab_size) < 2:
            raise UsageError(
                f"NullTokenizer needs --vocab-size >= 2 (got {vocab_size}): the largest token id "
                "plus one, plus one for the end-of-document id"
            )
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1
        self.model_path = None

    def encode(self, text):
        ids = []
        for word in text.split():
            try:
                value = int(word)
            except ValueError:
                raise UsageError(
                    f"NullTokenizer reads integer token ids, got {word[:40]!r}; pre-tokenize "
                    "the text or pick another --tokenizer-type"
                ) from None
            if not 0 <= value < self.vocab_size:
                raise UsageError(
                    f"NullTokenizer: token id {value} is outside [0, {self.vocab_size}); raise --vocab-size"
                )
            ids.append(value)
        return ids

    def encode_batch(self, texts, num_threads=-1):
        return [self.encode(text) for text in texts]

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)

    def files(self):
        return {}


def train_byte_level_bpe(input_files, model_prefix, vocab_size, json_key="text"):
    """Trains GPT-2's kind of BPE on whole documents; returns the paths written.

    Writes `{prefix}-vocab.json` and `{prefix}-merges.txt` (GPT2BPETokenizer's --vocab-file and
    --merge-file) and `{prefix}/tokenizer.json` with a `tokenizer_config.json` naming
    `<|endoftext|>` as eos (HuggingFaceTokenizer's folder). Whole documents, not lines, so that
    newlines and indentation runs take part in the merges as they do in the text.
    """
    if vocab_size < 257:
        raise UsageError(
            f"--vocab-size {vocab_size} is below 257 (256 byte tokens and <|endoftext|>); use a larger --vocab-size"
        )
    tok = _RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[GPT2_EOD],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = (doc[json_key] for doc in iter_documents([str(p) for p in input_files], (json_key,)))
    tok.train_from_iterator(texts, trainer)
    folder = Path(f"{model_prefix}")
    model = json.loads(tok.to_str())["model"]
    vocab_json = json.dumps(model["vocab"], ensure_ascii=False)
    # merges.txt as GPT-2 ships it: a version line, then one "left right" pair per line.
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    merges_txt = "#version: 0.2\n" + "".join(f"{m}\n" for m in merges)
    config = json.dumps(
        {"eos_token": GPT2_EOD, "bos_token": GPT2_EOD, "unk_token": GPT2_EOD, "tokenizer_class": "GPT2TokenizerFast"}
    )
    paths = [
        Path(f"{model_prefix}-vocab.json"),
        Path(f"{model_prefix}-merges.txt"),
        folder / "tokenizer.json",
        folder / "tokenizer_config.json",
    ]
    for path, text in zip(paths, (vocab_json, merges_txt, tok.to_str(), config)):
        write_atomically(path, lambda handle, text=text: handle.write(text))
    return paths
