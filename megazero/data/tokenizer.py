"""The tokenizer: a thin wrapper over a sentencepiece BPE model, and the recipe that trains one.

Owns the sentencepiece options, chosen so `decode(encode(text)) == text` exactly for source code:
- `normalization_rule_name="identity"`: no NFKC folding of characters;
- `remove_extra_whitespaces=False`, `add_dummy_prefix=False`: indentation, runs of spaces and
  leading/trailing spaces survive, and no space is invented at the start of a document;
- `allow_whitespace_only_pieces=True`: runs of spaces (indentation) become single pieces;
- `split_by_whitespace=True` (the default): no piece straddles a space, so an identifier is
  cut the same way whatever indentation precedes it;
- `"\\n"` is a user-defined piece: the trainer reads one line at a time and would never see a
  newline, yet code is full of them, so each costs one token instead of a byte-fallback token;
- `byte_fallback=True`: any character outside the vocabulary (tabs, rare Unicode) is spelled
  as UTF-8 byte pieces, so no text ever maps to `<unk>`.

End of document: sentencepiece's own EOS id, with its piece renamed to `<|endoftext|>`. It is a
control symbol, so `encode` never produces it from text (even text that contains the literal
string) and `decode` drops it; the preprocessor appends it between documents by id.
A model trained elsewhere works too if it has an EOS id or an `<|endoftext|>` piece.

`build_tokenizer` is the one door for preprocessing and training alike: Megatron's
`--tokenizer-type` names (SentencePieceTokenizer here; GPT2BPETokenizer, HuggingFaceTokenizer and
NullTokenizer in megazero.data.tokenizer_bpe), each with `encode`, `encode_batch`, `decode`,
`vocab_size`, `eod` and `files()`. A checkpoint keeps the run's tokenizer as `saved_form` describes it
and `tokenizer_from_saved` rebuilds it from there.
"""

import io
import os
import random
from pathlib import Path

import sentencepiece as spm

from megazero.data.corpus import Progress, is_jsonl, iter_jsonl_texts, utf8_lines, write_atomically
from megazero.core.errors import UsageError

EOD_PIECE = "<|endoftext|>"


class Tokenizer:
    """encode/decode with a sentencepiece model; `eod` is the id appended after each document."""

    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, processor, model_path):
        self._sp = processor
        self.model_path = str(model_path)
        self.vocab_size = processor.get_piece_size()
        self.eod = processor.eos_id()
        if self.eod < 0:
            self.eod = processor.piece_to_id(EOD_PIECE)
            if processor.id_to_piece(self.eod) != EOD_PIECE:  # piece_to_id answers unk when absent
                raise UsageError(
                    f"tokenizer {model_path} has neither an EOS id nor a '{EOD_PIECE}' piece; "
                    "train one with tools/train_tokenizer.py"
                )

    def encode(self, text):
        return self._sp.encode(text)

    def encode_batch(self, texts, num_threads=-1):
        """Encodes a list of texts; sentencepiece spreads the list over its own threads."""
        return self._sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids):
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id):
        return self._sp.id_to_piece(int(token_id))

    def files(self):
        """The files that rebuild this tokenizer: {name in a checkpoint: path}."""
        return {"tokenizer.model": self.model_path}


def load_tokenizer(path):
    """Loads a sentencepiece `.model`; a missing or foreign file raises UsageError."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(
            f"tokenizer model {path} not found; pass a sentencepiece .model file "
            "(train one with tools/train_tokenizer.py)"
        )
    if not os.access(path, os.R_OK):
        raise UsageError(f"tokenizer model {path} cannot be read (permission denied); fix its permissions")
    processor = spm.SentencePieceProcessor()
    try:
        processor.load(str(path))
    except (RuntimeError, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"{path} is not a sentencepiece model ({first_line}); "
            "pass the .model file written by tools/train_tokenizer.py"
        ) from None
    return Tokenizer(processor, path)


TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "TikTokenizer",
)


def build_tokenizer(
    tokenizer_type="SentencePieceTokenizer",
    tokenizer_model=None,
    vocab_file=None,
    merge_file=None,
    vocab_size=None,
    tiktoken_pattern=None,
):
    """The tokenizer Megatron's flags of the same names describe; a missing input raises UsageError."""
    from megazero.data import tokenizer_bpe

    if tokenizer_type == "SentencePieceTokenizer":
        if not tokenizer_model:
            raise UsageError("SentencePieceTokenizer needs --tokenizer-model (a sentencepiece .model file)")
        return load_tokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise UsageError("GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)")
        return tokenizer_bpe.GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise UsageError(
                "HuggingFaceTokenizer needs --tokenizer-model (a tokenizer directory or its tokenizer.json)"
            )
        return tokenizer_bpe.HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise UsageError("NullTokenizer needs --vocab-size (the largest token id + 2: ids and the eod id)")
        return tokenizer_bpe.NullTokenizer(vocab_size)
    if tokenizer_type == "TikTokenizer":
        if not tokenizer_model:
            raise UsageError("TikTokenizer needs --tokenizer-model (a tiktoken vocabulary .json file)")
        from megazero.data.tokenizer_tiktoken import TikTokenizer

        return TikTokenizer(tokenizer_model, tiktoken_pattern, vocab_size)
    raise UsageError(f"unknown tokenizer type {tokenizer_type!r}; pick one of {', '.join(TOKENIZER_TYPES)}")


SAVED_FILES = {
    "SentencePieceTokenizer": ("tokenizer.model",),
    "GPT2BPETokenizer": ("vocab.json", "merges.txt"),
    "HuggingFaceTokenizer": ("tokenizer.json",),
    "NullTokenizer": (),
}


def saved_form(tokenizer):
    """What a checkpoint keeps of a tokenizer: its type, end-of-document id, vocabulary size and the
    files that rebuild it ({name in the checkpoint's tokenizer/ folder: source path})."""
    return {
        "type": tokenizer.tokenizer_type,
        "eod": int(tokenizer.eod),
        "vocab_size": int(tokenizer.vocab_size),
        "files": {name: str(path) for name, path in tokenizer.files().items()},
    }


def tokenizer_from_saved(folder, record):
    """The tokenizer a checkpoint's tokenizer/ `folder` holds, as `record` (saved_form's) describes it."""
    from megazero.data import tokenizer_bpe

    folder, kind = Path(folder), record.get("type")
    missing = [name for name in SAVED_FILES.get(kind, ()) if not (folder / name).is_file()]
    if kind not in SAVED_FILES or missing:
        what = f"has no {missing[0]}" if missing else f"names an unknown tokenizer type {kind!r}"
        raise UsageError(f"{folder}: the checkpoint's tokenizer {what}; the checkpoint is incomplete")
    if kind == "SentencePieceTokenizer":
        return load_tokenizer(folder / "tokenizer.model")
    if kind == "GPT2BPETokenizer":
        return tokenizer_bpe.GPT2BPETokenizer(folder / "vocab.json", folder / "merges.txt")
    if kind == "HuggingFaceTokenizer":
        return tokenizer_bpe.HuggingFaceTokenizer(folder)
    return tokenizer_bpe.NullTokenizer(record["vocab_size"])


def iter_training_lines(input_files, json_key="text"):
    """Yields the lines sentencepiece trains on: each line of each document, newline removed."""
    for path in input_files:
        path = Path(path)
        if is_jsonl(path):
            for text in iter_jsonl_texts(path, json_key):
                yield from text.split("\n")
        else:
            for _, line in utf8_lines(path):
                yield line.rstrip("\n")


def _explain_training_failure(message, vocab_size):
    """sentencepiece's check failures read `INTERNAL: file(line) [condition] text`; keep the text."""
    text = message.strip().splitlines()[-1] if message.strip() else "training failed"
    text = text.split("] ", 1)[-1]
    if "too high" in text:
        fix = "use a smaller --vocab-size or more input text"
    elif "smaller than required_chars" in text:
        fix = "use a larger --vocab-size (every character seen in the input needs a piece)"
    else:
        fix = "check the input files and options"
    return f"sentencepiece could not train a {vocab_size}-piece vocabulary ({text.rstrip('.')}); {fix}"


def sample_lines(lines, limit, seed):
    """Up to `limit` non-empty lines by reservoir sampling with Python's seeded RNG (all if limit <= 0).

    We sample here rather than with sentencepiece's `input_sentence_size` because its sampler
    gave a different model in every process despite `set_random_generator_seed`; ranks that
    each prepare the default data must end up with the same tokenizer.
    """
    rng = random.Random(seed)
    kept = []
    seen = 0
    for line in lines:
        if not line:
            continue  # sentencepiece skips empty lines; don't let them take sample slots
        if limit <= 0 or seen < limit:
            kept.append(line)
        else:
            slot = rng.randrange(seen + 1)
            if slot < limit:
                kept[slot] = line
        seen += 1
    return kept


def train_tokenizer(
    input_files,
    model_prefix,
    vocab_size,
    json_key="text",
    input_sentence_size=1_000_000,
    num_threads=2,
    seed=1234,
    progress=True,
):
    """Trains a BPE sentencepiece model on text/JSONL files; returns the `.model` path.

    Trains on `input_sentence_size` lines sampled from the input (0 = all): more lines barely
    change a code vocabulary and only slow training. The same input and seed give a
    byte-identical model. Writes `{model_prefix}.model` (and a human-readable `.vocab`,
    "piece<TAB>score" per line), each renamed into place so an interrupted run leaves no
    partial model behind.
    """
    for path in input_files:
        if not Path(path).is_file():
            raise UsageError(f"tokenizer input {path} not found; check the --input paths")
    meter = Progress(f"training tokenizer (vocab {vocab_size})", enabled=progress)
    meter.begin()
    lines = sample_lines(iter_training_lines(input_files, json_key), input_sentence_size, seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            split_by_whitespace=True,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"],
            eos_piece=EOD_PIECE,
            bos_id=-1,
            pad_id=-1,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise UsageError(_explain_training_failure(str(exc), vocab_size)) from None
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    # Escape the newline piece so the listing stays one line per piece.
    pieces = (processor.id_to_piece(i).replace("\n", "\\n") for i in range(vocab_size))
    vocab = "".join(f"{piece}\t{processor.get_score(i)}\n" for i, piece in enumerate(pieces))
    write_atomically(f"{model_prefix}.vocab", lambda handle: handle.write(vocab))
    # .model last: its presence marks a finished training.
    write_atomically(f"{model_prefix}.model", lambda handle: handle.write(model.getvalue()), mode="wb")
    meter.finish(vocab_size, f"pieces from {len(lines)} lines,")
    return Path(f"{model_prefix}.model")
