"""Train a BPE tokenizer for megazero on text or JSONL files: sentencepiece, or GPT-2's byte-level BPE.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix out/tok --vocab-size 8192
    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix out/bpe --vocab-size 8192 \\
        --tokenizer-type GPT2BPETokenizer

The second writes out/bpe-vocab.json + out/bpe-merges.txt (for --tokenizer-type GPT2BPETokenizer
--vocab-file ... --merge-file ...) and the folder out/bpe/ with tokenizer.json (for
--tokenizer-type HuggingFaceTokenizer --tokenizer-model out/bpe); it trains on whole documents
(a plain text file is one), with the `tokenizers` library.

Text files are read line by line; JSONL files (`.jsonl`/`.json`) give the field `--json-key`
of each object, for sentencepiece. The options that keep code whitespace exact are fixed in
megazero/data/tokenizer.py; this script only maps flags onto `train_tokenizer` /
`train_byte_level_bpe`.
"""

import argparse
import sys
from pathlib import Path

from megazero.data.tokenizer import train_tokenizer
from megazero.data.tokenizer_bpe import train_byte_level_bpe
from megazero.core.errors import UsageError, check_writable_dir


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help="text files (one training line per line) or JSONL files (.jsonl/.json)",
    )
    parser.add_argument("--json-key", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument(
        "--model-prefix",
        required=True,
        help="writes PREFIX.model and PREFIX.vocab (sentencepiece), or PREFIX-vocab.json, "
        "PREFIX-merges.txt and PREFIX/tokenizer.json (byte-level BPE)",
    )
    parser.add_argument(
        "--tokenizer-type",
        default="SentencePieceTokenizer",
        choices=["SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer"],
        help="SentencePieceTokenizer (default), or a GPT-2 byte-level BPE (both other names)",
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="number of pieces (default: 8192)")
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        default=1_000_000,
        help="lines sampled from the input for training; 0 = all (default: 1000000)",
    )
    parser.add_argument("--num-threads", type=int, default=2, help="sentencepiece trainer threads")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed, for reproducible models")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        folder = Path(args.model_prefix).parent
        check_writable_dir(
            folder,
            f"--model-prefix {args.model_prefix}: its folder {folder}",
            "give a --model-prefix in a writable place",
        )
        if args.tokenizer_type == "SentencePieceTokenizer":
            written = [
                train_tokenizer(
                    args.input,
                    args.model_prefix,
                    args.vocab_size,
                    json_key=args.json_key,
                    input_sentence_size=args.input_sentence_size,
                    num_threads=args.num_threads,
                    seed=args.seed,
                )
            ]
        else:
            written = train_byte_level_bpe(args.input, args.model_prefix, args.vocab_size, json_key=args.json_key)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
