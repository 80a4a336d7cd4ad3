"""The data and logging flags' parser entries (add_data_flags), and Megatron-LM's data flags that
arguments.py reads beyond the paths: the tokenizer type a GPT-3 launch line implies (--vocab-file and
--merge-file without --tokenizer-type mean the GPT-2 BPE, as Megatron's own GPT-3 recipe writes it),
the TikTokenizer's pattern, --mock-data, a path per split (--train-data-path / --valid-data-path /
--test-data-path instead of --data-path and --split), object storage (refused), and the notes on the
data flags accepted without effect. Part of the edge: raises UsageError before any group exists.
"""

from __future__ import annotations

from megazero.core.errors import UsageError


def add_data_flags(g, add, merged) -> None:
    """The "data and logging" group: data paths, tokenizer, packing, evaluation, log cadence, the run
    folder (`add` and `merged` are flags._add and flags._merged)."""
    add(
        g,
        "--data-path",
        nargs="+",
        default=None,
        help="prefix of a .bin/.idx pair, or 'weight prefix ...'",
        shown="the embedded standard-library corpus",
    )
    add(
        g,
        "--mock-data",
        action="store_true",
        help="train on random tokens of the tokenizer's vocabulary (no data files)",
    )
    add(
        g,
        "--split",
        default=None,
        help="train,valid,test weights cutting --data-path's sequences, as megatron-core does",
        shown="949,50,1",
    )
    _add_split_path_flags(g, add)
    add(
        g,
        "--num-dataset-builder-threads",
        type=int,
        default=1,
        help="threads building a blend's datasets (their sample indices) at once",
    )
    add(
        g,
        "--object-storage-cache-path",
        default=None,
        help="refused: megazero reads data from local files only",
        shown="none",
    )
    add(
        g,
        "--tokenizer-model",
        default=None,
        help="sentencepiece .model, or Hugging Face tokenizer folder/tokenizer.json, the data was tokenized with",
        shown="the embedded corpus's",
    )
    add(
        g,
        "--tokenizer-type",
        choices=["SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer", "TikTokenizer"],
        default=None,
        help="tokenizer kind",
        shown="GPT2BPETokenizer with --vocab-file and --merge-file, else SentencePieceTokenizer",
    )
    add(
        g,
        "--tiktoken-pattern",
        choices=["v1", "v2"],
        default=None,
        help="TikTokenizer's pre-tokenization pattern (needs the tiktoken package)",
        shown="v2",
    )
    add(
        g,
        "--num-workers",
        type=int,
        default=2,
        help="0: batches read in the training loop; >0: read ahead by a background thread",
    )
    add(g, "--no-mmap-bin-files", action="store_true", help="read .bin files with plain reads instead of mmap")
    add(
        g,
        "--reset-position-ids",
        action="store_true",
        help="packed samples: positions restart at 0 after each end-of-document token",
    )
    add(
        g,
        "--reset-attention-mask",
        action="store_true",
        help="packed samples: attention stays inside each document (block-diagonal causal)",
    )
    add(g, "--eod-mask-loss", action="store_true", help="no loss where the input token is the end-of-document token")
    add(
        g,
        "--no-create-attention-mask-in-dataloader",
        action="store_true",
        help="accepted: megazero never builds attention masks",
    )
    add(g, "--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json", shown="none")
    add(g, "--merge-file", default=None, help="GPT2BPETokenizer's merges.txt", shown="none")
    add(
        g, "--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary, eod = vocab-size - 1", shown="none"
    )
    add(
        g,
        "--data-cache-path",
        default=None,
        help="folder for sample indices and the embedded corpus",
        shown="beside the data; $MEGAZERO_CACHE or ~/.cache/megazero",
    )
    add(g, "--eval-interval", type=int, default=100, help="steps between evaluations")
    add(g, "--eval-iters", type=int, default=10, help="batches per evaluation; 0: none")
    merged(g, "log_interval", "steps between log lines", type=int)
    add(g, "--run-dir", default=None, help="folder for this run's outputs", shown="runs/gpt-<date>-<time>-<6 hex>")
    add(g, "--metrics-file", default=None, help="JSON lines of the logged metrics", shown="<run-dir>/metrics.jsonl")


def _add_split_path_flags(g, add) -> None:
    for split in ("train", "valid", "test"):
        add(
            g,
            f"--{split}-data-path",
            nargs="+",
            default=None,
            help=f"the {split} split's own prefix or 'weight prefix ...' blend, whole (instead of --data-path "
            f"and --split)",
            shown="none",
        )


def infer_tokenizer_type(args) -> None:
    """Sets args.tokenizer_type when the flags leave it out: GPT2BPETokenizer when --vocab-file and
    --merge-file are both given, else SentencePieceTokenizer (megazero's default)."""
    if args.tokenizer_type is None:
        gpt2 = args.vocab_file is not None and args.merge_file is not None
        args.tokenizer_type = "GPT2BPETokenizer" if gpt2 else "SentencePieceTokenizer"


SPLIT_PATH_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")
DEFAULT_SPLIT = "949,50,1"


def tokenizer_vocab_size(args) -> int:
    """The vocabulary of the tokenizer the flags name (the embedded corpus's without --data-path)."""
    from megazero.data.default_data import DEFAULT_VOCAB_SIZE

    check_object_storage(args)
    split_paths = per_split_paths(args)
    if args.mock_data:  # random tokens of the named tokenizer's vocabulary, else the default corpus's
        from megazero.data.tokenizer import build_tokenizer

        named = args.tokenizer_model or args.vocab_file or args.vocab_size is not None
        if not named and args.tokenizer_type == "SentencePieceTokenizer":
            return DEFAULT_VOCAB_SIZE
        return build_tokenizer(
            args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            vocab_size=args.vocab_size,
            tiktoken_pattern=args.tiktoken_pattern,
        ).vocab_size
    if args.data_path is None and split_paths is None:
        given = [
            flag
            for flag, value in (
                ("--tokenizer-model", args.tokenizer_model),
                ("--vocab-file", args.vocab_file),
                ("--merge-file", args.merge_file),
                ("--vocab-size", args.vocab_size),
            )
            if value is not None
        ]
        if args.tokenizer_type != "SentencePieceTokenizer":
            given.insert(0, f"--tokenizer-type {args.tokenizer_type}")
        if given:
            raise UsageError(f"{given[0]} needs --data-path (the default corpus brings its own tokenizer)")
        return DEFAULT_VOCAB_SIZE
    from megazero.data.builders import parse_data_path
    from megazero.data.tokenizer import build_tokenizer

    if split_paths is None:
        parse_data_path(args.data_path)
    for flag, paths in zip(SPLIT_PATH_FLAGS, split_paths or ()):
        if paths is not None:
            parse_data_path(paths, flag)
    if args.tokenizer_type == "SentencePieceTokenizer" and not args.tokenizer_model:
        flag = "--data-path" if split_paths is None else "--train-data-path"
        raise UsageError(
            f"{flag} needs --tokenizer-model (the sentencepiece model the data was "
            "tokenized with), or another --tokenizer-type"
        )
    return build_tokenizer(
        args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        tiktoken_pattern=args.tiktoken_pattern,
    ).vocab_size


def per_split_paths(args) -> list | None:
    """[train, valid, test] of --train-data-path / --valid-data-path / --test-data-path (each a
    --data-path-style list or None), or None when none of them is given."""
    paths = [getattr(args, flag[2:].replace("-", "_")) for flag in SPLIT_PATH_FLAGS]
    if all(p is None for p in paths):
        return None
    given = next(flag for flag, p in zip(SPLIT_PATH_FLAGS, paths) if p is not None)
    if args.data_path is not None:
        raise UsageError(
            f"--data-path and {given} are both set; choose one: --data-path with --split cuts "
            "one blend into train/valid/test, the per-split flags give each split its own"
        )
    if args.mock_data:
        raise UsageError(f"--mock-data and {given} are both set; choose one (mock data reads no files)")
    if paths[0] is None:
        raise UsageError(f"{given} needs --train-data-path (the data to train on) beside it")
    return paths


def check_object_storage(args) -> None:
    if args.object_storage_cache_path is not None:
        raise UsageError(
            f"--object-storage-cache-path {args.object_storage_cache_path}: megazero reads data "
            "from local files only (no S3 or multi-storage client); copy the .bin/.idx files to a "
            "local or mounted filesystem, give their prefixes to --data-path and remove this flag"
        )


def data_notes(args) -> list[str]:
    """One note per data flag that has no effect with the others given."""
    notes = []
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        notes.append(
            f"--tiktoken-pattern {args.tiktoken_pattern} has no effect: it is TikTokenizer's "
            f"pattern and the tokenizer is {args.tokenizer_type}"
        )
    if args.mock_data and args.data_path is not None:
        raise UsageError("--mock-data and --data-path are both set; choose one (mock data reads no files)")
    if args.split is not None and per_split_paths(args) is not None:
        notes.append(
            f"--split {args.split} has no effect: --train-data-path (and --valid-data-path, "
            f"--test-data-path) give each split the whole of its own data, as in Megatron-LM"
        )
    if args.mock_data and args.no_mmap_bin_files:
        notes.append("--no-mmap-bin-files has no effect: --mock-data reads no .bin files")
    if args.ckpt_format is not None:
        notes.append(
            f"--ckpt-format {args.ckpt_format}: megazero writes its own sharded checkpoint format "
            f"(each rank its shard, loadable into any layout; docs/checkpoint.md), which serves "
            f"the purpose of Megatron's torch_dist"
        )
    return notes
