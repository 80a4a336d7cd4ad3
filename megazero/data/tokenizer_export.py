"""The run's tokenizer in the form `transformers` loads from a model folder, so that an exported model
leaves with it: `AutoTokenizer.from_pretrained(folder)` and `pipeline("text-generation", model=folder)`
then work from the folder alone.

`HFTokenizer(tokenizer)` builds and checks everything before a file is written; `.write(folder)`
writes it. Every kind is written as a `tokenizer.json` (the `tokenizers` library's own format, which transformers
reads as it is) beside a `tokenizer_config.json` naming the special tokens, plus the kind's own files:

- SentencePieceTokenizer: `tokenizer.model`, and a tokenizer.json built from it: BPE over the model's
  pieces with merges ranked by the merged piece's score (sentencepiece's BPE rule), spaces as U+2581,
  sentencepiece's whitespace split (a word is a run of spaces and the text after it), byte fallback,
  user-defined pieces (megazero's newline) as added tokens. The class named is the generic fast
  tokenizer: transformers' LlamaTokenizer would rebuild the pipeline with a dummy prefix the model
  was not trained with.
- GPT2BPETokenizer: `vocab.json`, `merges.txt` and the byte-level BPE megazero encodes with.
- HuggingFaceTokenizer: its own files, the eos token filled in where the config lacked it.

What is written is checked before it is kept: it must encode a sample (code, runs of spaces, tabs,
CRLF, accents, other scripts, emoji, and every piece of the vocabulary in context) to exactly the ids
megazero's tokenizer gives. A tokenizer that cannot be written so (the null tokenizer of pre-tokenized
ids, a sentencepiece model with normalization rules or a unigram model) is refused with one line.
transformers treats the literal text of a special token ("<|endoftext|>") as that token, where
megazero's tokenizers encode it as text; the sample leaves such strings out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from megazero.core.errors import UsageError

SPACE = "\u2581"
SAMPLE = [
    "def f(x, y=2):\n    return  x * y   # two spaces, three\n",
    "\tindented with a tab\r\nand a CRLF line\n\n\n",
    "   leading and trailing spaces   ",
    "Größe, naïve café; ελληνικά, русский, 日本語のテキスト, 한국어 🙂🙂 ✓",
    "numbers 3.14159 and 1e-5, snake_case, CamelCase, x[i+1]",
]


class TokenizerExportError(UsageError):
    """The run's tokenizer cannot be written in a form transformers loads exactly."""


class HFTokenizer:
    """A megazero tokenizer ready to be written into a model folder: its `tokenizers` pipeline (already
    checked to encode as megazero does), its special tokens, and the files of its own it brings."""

    def __init__(self, tokenizer):
        self.tokenizer, kind = tokenizer, tokenizer.tokenizer_type
        if kind == "NullTokenizer":
            raise TokenizerExportError(
                "the run's tokenizer is NullTokenizer (pre-tokenized integer ids): it "
                "has no text form transformers can load; pass --without-tokenizer to "
                "export the weights alone"
            )
        self.files = dict(tokenizer.files())  # name in the folder -> source
        self.config = {}  # the tokenizer's own tokenizer_config.json
        if kind == "SentencePieceTokenizer":
            self.rust, self.special = _from_sentencepiece(tokenizer)
        elif kind == "GPT2BPETokenizer":
            self.rust = RustTokenizer.from_str(tokenizer.rust_tokenizer().to_str())
            eos = "<|endoftext|>"
            self.rust.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
            self.special = {"eos_token": eos, "bos_token": eos, "unk_token": eos}
        else:
            self.rust, self.special, self.config = _from_hugging_face(tokenizer)
            self.files.pop("tokenizer.json")  # written below, as checked
        self.special.setdefault("pad_token", self.special["eos_token"])
        _check_same_ids(tokenizer, self.rust)

    def special_ids(self) -> dict[str, int]:
        """bos_token_id, eos_token_id and pad_token_id, for config.json and generation_config.json."""
        vocab = self.rust.get_vocab(with_added_tokens=True)
        return {f"{role}_id": vocab[self.special[role]] for role in ("bos_token", "eos_token", "pad_token")}

    def write(self, folder: Path, model_max_length: int) -> None:
        """tokenizer.json, tokenizer_config.json and the tokenizer's own files into `folder`."""
        folder = Path(folder)
        for name, source in self.files.items():
            if name != "tokenizer_config.json":
                shutil.copyfile(source, folder / name)
        self.rust.save(str(folder / "tokenizer.json"))
        # the generic class reads tokenizer.json as it is, which is what megazero encodes with
        config = {
            **self.config,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            **self.special,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


def _from_hugging_face(tokenizer):
    """The tokenizer.json as it is, its special tokens (eos is megazero's eod) and its own config."""
    files = tokenizer.files()
    rust = RustTokenizer.from_file(files["tokenizer.json"])
    read = {
        name: _read_json(Path(files[name]))
        for name in ("special_tokens_map.json", "tokenizer_config.json")
        if name in files
    }
    config = read.get("tokenizer_config.json", {})
    named = {**read.get("special_tokens_map.json", {}), **config}
    pieces = {i: t for t, i in rust.get_vocab(with_added_tokens=True).items()}
    special = {"eos_token": pieces[tokenizer.eod]}
    for role in ("bos_token", "pad_token", "unk_token"):
        if _token_text(named.get(role)):
            special[role] = _token_text(named[role])
    special.setdefault("bos_token", special["eos_token"])
    return rust, special, {k: v for k, v in config.items() if not k.endswith("_token")}


def _sentencepiece_proto(path: str):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def _refuse_unexpressible(proto, path: str) -> None:
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    problems = [
        (trainer.model_type != trainer.BPE, "it is not a BPE model (unigram models are not exported)"),
        (norm.name not in ("identity", ""), f"it normalizes text ({norm.name!r} rules)"),
        (norm.remove_extra_whitespaces, "it removes extra whitespace"),
        (trainer.treat_whitespace_as_suffix, "it treats whitespace as a suffix"),
    ]
    for bad, why in problems:
        if bad:
            raise TokenizerExportError(
                f"the run's sentencepiece tokenizer {path} cannot be written as a "
                f"tokenizer.json transformers loads exactly: {why}; pass "
                f"--without-tokenizer to export the weights alone"
            )


def _from_sentencepiece(tokenizer):
    """A `tokenizers` pipeline that encodes as the sentencepiece BPE model does."""
    proto = _sentencepiece_proto(tokenizer.model_path)
    _refuse_unexpressible(proto, tokenizer.model_path)
    kinds = proto.SentencePiece
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    merges = []
    for p in proto.pieces:
        if p.type != kinds.NORMAL:
            continue
        for cut in range(1, len(p.piece)):
            left, right = p.piece[:cut], p.piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-p.score, vocab[left], vocab[right], left, right))
    merges.sort()
    unknown = next(p.piece for p in proto.pieces if p.type == kinds.UNKNOWN)
    rust = RustTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(m[3], m[4]) for m in merges],
            unk_token=unknown,
            byte_fallback=proto.trainer_spec.byte_fallback,
            fuse_unk=True,
        )
    )
    steps = [normalizers.Replace(" ", SPACE)]
    if proto.normalizer_spec.add_dummy_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    rust.normalizer = normalizers.Sequence(steps)
    if proto.trainer_spec.split_by_whitespace:
        rust.pre_tokenizer = pre_tokenizers.Split(Regex(f"{SPACE}+[^{SPACE}]*|[^{SPACE}]+"), behavior="isolated")
    rust.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    rust.add_special_tokens(
        [
            AddedToken(p.piece, special=True, normalized=False)
            for p in proto.pieces
            if p.type in (kinds.CONTROL, kinds.UNKNOWN)
        ]
    )
    rust.add_tokens(
        [AddedToken(p.piece, special=False, normalized=False) for p in proto.pieces if p.type == kinds.USER_DEFINED]
    )
    special = {"eos_token": proto.pieces[tokenizer.eod].piece, "unk_token": unknown}
    for role, index in (("bos_token", proto.trainer_spec.bos_id), ("pad_token", proto.trainer_spec.pad_id)):
        if index >= 0:
            special[role] = proto.pieces[index].piece
    special.setdefault("bos_token", special["eos_token"])
    return rust, special


def _check_same_ids(tokenizer, rust: RustTokenizer) -> None:
    """Refuses a written pipeline that encodes the sample differently from megazero's tokenizer."""
    specials = [added.content for added in rust.get_added_tokens_decoder().values() if added.special]
    texts = list(SAMPLE)
    pieces = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size) if i != tokenizer.eod]
    texts += [" ".join(pieces[k : k + 64]) for k in range(0, len(pieces), 64)]
    for text in texts:
        if any(s in text for s in specials):
            continue
        ours = tokenizer.encode(text)
        theirs = rust.encode(text).ids
        if ours != theirs:
            raise TokenizerExportError(
                f"the run's {tokenizer.tokenizer_type} ({tokenizer.model_path}) cannot be "
                f"written as a tokenizer.json that encodes exactly as it does (they differ "
                f"on {text[:40]!r}); pass --without-tokenizer to export the weights alone"
            )
