"""Megatron-LM's data flags that arguments.py reads beyond the paths: the tokenizer type a GPT-3
launch line implies (--vocab-file and --merge-file without --tokenizer-type mean the GPT-2 BPE, as
Megatron's own GPT-3 recipe writes it), the TikTokenizer's pattern, --mock-data, and the notes on
the data flags accepted without effect. Part of the edge: raises UsageError before any group exists.
"""
from __future__ import annotations

from megazero.core.errors import UsageError


def infer_tokenizer_type(args) -> None:
    """Sets args.tokenizer_type when the flags leave it out: GPT2BPETokenizer when --vocab-file and
    --merge-file are both given, else SentencePieceTokenizer (megazero's default)."""
    if args.tokenizer_type is None:
        gpt2 = args.vocab_file is not None and args.merge_file is not None
        args.tokenizer_type = "GPT2BPETokenizer" if gpt2 else "SentencePieceTokenizer"


def data_notes(args) -> list[str]:
    """One note per data flag that has no effect with the others given."""
    notes = []
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        notes.append(f"--tiktoken-pattern {args.tiktoken_pattern} has no effect: it is TikTokenizer's "
                     f"pattern and the tokenizer is {args.tokenizer_type}")
    if args.mock_data and args.data_path is not None:
        raise UsageError("--mock-data and --data-path are both set; choose one (mock data reads no files)")
    if args.mock_data and args.no_mmap_bin_files:
        notes.append("--no-mmap-bin-files has no effect: --mock-data reads no .bin files")
    if args.ckpt_format is not None:
        notes.append(f"--ckpt-format {args.ckpt_format}: megazero writes its own sharded checkpoint format "
                     f"(each rank its shard, loadable into any layout; docs/checkpoint.md), which serves "
                     f"the purpose of Megatron's torch_dist")
    return notes
