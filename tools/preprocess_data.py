"""Tokenize documents into Megatron-style `{output_prefix}_{key}_document.bin/.idx` files.

    python tools/preprocess_data.py --input data.jsonl --json-keys text \\
        --output-prefix out/mydata --tokenizer-model tok.model --append-eod --workers 4
    python tools/preprocess_data.py --input data.jsonl --output-prefix out/gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod

Input, by file extension:
- `.jsonl` / `.json`: one JSON object per line; each `--json-keys` field is one document and
  goes to its own output pair (`out/mydata_text_document.bin/.idx`);
- Hugging Face `datasets` files on disk: `.parquet`, `.arrow` (the IPC stream `datasets` writes, or
  the IPC file format) or a `save_to_disk` folder; each row's `--json-keys` column (one) is a
  document (needs pyarrow: `pip install -e '.[hf-data]'`; nothing is downloaded);
- anything else: plain UTF-8 text, the WHOLE file is one document (source code has blank
  lines inside documents, so blank lines cannot separate them); give many files to --input.

`--tokenizer-type` takes Megatron's names (SentencePieceTokenizer, the default; GPT2BPETokenizer
with --vocab-file/--merge-file; HuggingFaceTokenizer with --tokenizer-model a directory or
tokenizer.json; NullTokenizer with --vocab-size for text that already is token ids), so the
files match Megatron's preprocess_data.py for the same tokenizer.

Each document is one sequence; `--append-eod` adds the tokenizer's end-of-document id after
it. With `--workers N` a process pool tokenizes in parallel; results come back in input order,
so the output files are byte-identical for any N.
"""

import argparse
import contextlib
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

from megazero.data.corpus import Progress, iter_documents
from megazero.data.hf_files import is_saved_dataset
from megazero.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megazero.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from megazero.core.errors import UsageError, check_writable_dir


class DocumentEncoder:
    """Tokenizes one `{key: text}` document; returns ({key: int32 ids}, bytes of text read)."""

    def __init__(self, tokenizer_spec, append_eod):
        self.tokenizer = build_tokenizer(**tokenizer_spec)
        self.append_eod = append_eod

    def encode(self, document):
        encoded = {}
        for key, text in document.items():
            ids = self.tokenizer.encode(text)
            if self.append_eod:
                ids.append(self.tokenizer.eod)
            encoded[key] = np.asarray(ids, dtype=np.int32)
        return encoded, sum(len(text.encode("utf-8")) for text in document.values())


# The one per-process slot a Pool initializer can fill: each worker loads the tokenizer once
# into it, instead of unpickling it with every task. Only ever set inside worker processes.
_WORKER_ENCODER = []


def _init_worker(tokenizer_spec, append_eod):
    _WORKER_ENCODER.append(DocumentEncoder(tokenizer_spec, append_eod))


def _encode_in_worker(document):
    return _WORKER_ENCODER[0].encode(document)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help="JSONL files (.jsonl/.json, one object per line), Parquet / Arrow files or a datasets "
        "save_to_disk folder (a text column), or text files (one document each)",
    )
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL fields to tokenize (default: text)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    parser.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default="SentencePieceTokenizer",
        help="tokenizer kind, Megatron's names (default: SentencePieceTokenizer)",
    )
    parser.add_argument(
        "--tokenizer-model",
        default=None,
        help="sentencepiece .model, or a Hugging Face tokenizer directory / tokenizer.json",
    )
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    parser.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids below it, eod = it - 1")
    parser.add_argument(
        "--tiktoken-pattern", choices=["v1", "v2"], default=None, help="TikTokenizer's split pattern (default v2)"
    )
    parser.add_argument("--append-eod", action="store_true", help="append the end-of-document id to each document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1, in-process)")
    parser.add_argument("--chunksize", type=int, default=32, help="documents per task sent to a worker")
    parser.add_argument("--log-interval", type=float, default=2.0, help="seconds between progress lines")
    return parser.parse_args(argv)


def tokenizer_spec(args):
    """build_tokenizer's keyword arguments: plain values a worker process receives once."""
    return dict(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        tiktoken_pattern=args.tiktoken_pattern,
    )


def _encoded_documents(args, documents):
    """Encoded documents in input order, from a pool or, with one worker, from this process."""
    if args.workers <= 1:
        encoder = DocumentEncoder(tokenizer_spec(args), args.append_eod)
        yield from map(encoder.encode, documents)
        return
    with multiprocessing.Pool(
        args.workers, initializer=_init_worker, initargs=(tokenizer_spec(args), args.append_eod)
    ) as pool:
        yield from pool.imap(_encode_in_worker, documents, chunksize=args.chunksize)


def preprocess(args):
    if args.workers < 1 or args.chunksize < 1:
        raise UsageError(f"--workers ({args.workers}) and --chunksize ({args.chunksize}) must be at least 1")
    tokenizer = build_tokenizer(**tokenizer_spec(args))  # fail here, not in every worker
    for path in args.input:
        if not Path(path).is_file() and not is_saved_dataset(path):
            raise UsageError(f"input file {path} not found; check the --input paths")
    folder = Path(args.output_prefix).parent
    check_writable_dir(
        folder,
        f"--output-prefix {args.output_prefix}: its folder {folder}",
        "give an --output-prefix in a writable place",
    )
    dtype = best_dtype(tokenizer.vocab_size)
    meter = Progress("preprocessing", enabled=True, every_s=args.log_interval)
    start = time.monotonic()
    count = total_bytes = 0

    def rates():
        elapsed = max(time.monotonic() - start, 1e-9)
        return f"documents ({count / elapsed:.1f} docs/s, {total_bytes / elapsed / 1e6:.2f} MB/s)"

    # The builders' context exits delete their temporary files if anything below raises.
    with contextlib.ExitStack() as stack:
        builders = {
            key: stack.enter_context(IndexedDatasetBuilder(f"{args.output_prefix}_{key}_document", dtype))
            for key in args.json_keys
        }
        for encoded, num_bytes in _encoded_documents(args, iter_documents(args.input, args.json_keys)):
            for key, ids in encoded.items():
                builders[key].add_document(ids)
            count += 1
            total_bytes += num_bytes
            meter.update(count, rates())
        for builder in builders.values():
            builder.finalize()
    meter.finish(count, rates())
    return [f"{args.output_prefix}_{key}_document" for key in args.json_keys]


def main(argv=None):
    args = parse_args(argv)
    try:
        prefixes = preprocess(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    for prefix in prefixes:
        print(prefix)


if __name__ == "__main__":
    main()
