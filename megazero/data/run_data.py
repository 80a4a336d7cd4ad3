"""Everything a training run reads, in one call: `run_data(cfg, dp_rank, dp_size, ...)` gives the
train batches (the sampler over the train split, read ahead by threads under --num-workers), the
evaluation batches and the tokenizer record the run's checkpoints keep.

Where the data comes from: --mock-data (random tokens of the vocabulary, no files), --data-path
(Megatron .bin/.idx prefixes, blended by weight), else the embedded corpus, prepared into the cache
once. Building a split's sample indices writes cache files, so one rank builds first and the others
follow once it is done (`first`, the launch's agreement: it runs the build on the rank that prepares
and hands the others its verdict). With document masking on (--reset-position-ids,
--reset-attention-mask, --eod-mask-loss) it also says the end-of-document id they look for: the
tokenizer's (mock data without one: vocabulary size - 1, the NullTokenizer's rule), and mock data is
then made of documents ending with it. Reads a TrainConfig's fields; imports nothing above data/.
"""

from __future__ import annotations

import dataclasses

from megazero.data.read_ahead import ReadAhead
from megazero.data.sampler import MicrobatchSource


@dataclasses.dataclass
class RunData:
    train: object  # batch(i) -> this rank's microbatches of step i
    valid: list  # the evaluation batches (the same every evaluation)
    tokenizer: dict | None  # the tokenizer as checkpoints keep it; None: none to keep
    eod: int | None = None  # the end-of-document id, when document masking is on

    def close(self) -> None:
        if isinstance(self.train, ReadAhead):
            self.train.close()


def run_data(cfg, dp_rank: int, dp_size: int, say, *, first=None, keep_tokenizer: bool = False) -> RunData:
    """This data-parallel rank's data for `cfg` (a TrainConfig). `first(build)` runs `build(progress)`
    on the rank that prepares shared files before the others (None: here, with progress lines);
    `keep_tokenizer`: also describe the tokenizer for checkpoints (the rank that saves it)."""
    first = first or (lambda build: build(True))
    masking = masks_documents(cfg.data)
    eod = end_of_document(cfg) if masking and cfg.data.mock_data else None
    train_set, valid_set = datasets(cfg, say, first, eod)
    if masking and eod is None:
        eod = end_of_document(cfg)  # after datasets(): the embedded corpus is prepared by then
    train = MicrobatchSource(train_set, cfg.global_batch_size, cfg.micro_batch_size, dp_rank, dp_size, ramp=cfg.rampup)
    if cfg.run.num_workers > 0:
        train = ReadAhead(train, cfg.run.num_workers, end=cfg.train_iters)
    valid = []
    if valid_set is not None and cfg.eval_iters > 0:
        source = MicrobatchSource(valid_set, cfg.global_batch_size, cfg.micro_batch_size, dp_rank, dp_size)
        valid = [source.batch(i) for i in range(cfg.eval_iters)]
    return RunData(train, valid, tokenizer_record(cfg.data) if keep_tokenizer else None, eod)


def masks_documents(data) -> bool:
    return data.reset_position_ids or data.reset_attention_mask or data.eod_mask_loss


def end_of_document(cfg) -> int:
    """The end-of-document id of the run's tokenizer: the embedded corpus's (once prepared), the
    named one's, or for mock data without one vocabulary size - 1."""
    from megazero.data.default_data import default_data_files
    from megazero.data.tokenizer import build_tokenizer, load_tokenizer

    data = cfg.data
    if data.mock_data and not _names_a_tokenizer(data):
        return cfg.model.vocab_size - 1
    if data.data_path is None and not data.mock_data:
        return int(load_tokenizer(default_data_files(data.cache_dir)[1]).eod)
    return int(
        build_tokenizer(
            data.tokenizer_type,
            tokenizer_model=data.tokenizer_model,
            vocab_file=data.vocab_file,
            merge_file=data.merge_file,
            vocab_size=data.vocab_size,
            tiktoken_pattern=data.tiktoken_pattern,
        ).eod
    )


def datasets(cfg, say, first, eod: int | None = None):
    """(train, valid) datasets of the run; mock data with `eod` is made of documents ending with it."""
    from megazero.data.builders import build_train_valid_test_datasets
    from megazero.data.default_data import prepare_default_data
    from megazero.data.synthetic import DocumentTokens, SyntheticTokens

    if cfg.data.mock_data:
        vocab, seq = cfg.model.vocab_size, cfg.model.seq_length
        if eod is not None:
            say(
                f" data: mock (documents of 1 to {seq} tokens of a {vocab}-token vocabulary, each ending "
                f"with the end-of-document id {eod})"
            )
            return DocumentTokens(vocab, seq, eod, seed=cfg.seed), DocumentTokens(vocab, seq, eod, seed=cfg.seed + 1)
        say(f" data: mock (random tokens of a {vocab}-token vocabulary)")
        return SyntheticTokens(vocab, seq, seed=cfg.seed), SyntheticTokens(vocab, seq, seed=cfg.seed + 1)

    def build(progress: bool):
        data_path = cfg.data.data_path
        if not cfg.data.reads_files():
            prefix, _ = prepare_default_data(cfg.data.cache_dir, progress=progress)
            say(f" data: embedded corpus (Python standard library sources) at {prefix}")
            data_path = [prefix]
        train, valid, _ = build_train_valid_test_datasets(
            data_path,
            cfg.data.split,
            cfg.model.seq_length,
            cfg.seed,
            cfg.sample_counts(),
            cfg.data.cache_dir,
            progress,
            mmap=cfg.data.mmap_bin_files,
            per_split=cfg.data.split_paths,
            threads=cfg.data.builder_threads,
        )
        return train, valid

    return first(build)


def tokenizer_record(data) -> dict | None:
    """The run's tokenizer as its checkpoints keep it (megazero.data.tokenizer.saved_form), from a
    TrainConfig's data settings; None for mock data without a tokenizer, and for a TikTokenizer (its
    checkpoints export with --without-tokenizer only)."""
    from megazero.data.default_data import default_data_files
    from megazero.data.tokenizer import build_tokenizer, load_tokenizer, saved_form

    if data.mock_data and not _names_a_tokenizer(data):
        return None  # random tokens of the default vocabulary: no tokenizer to keep
    if not data.reads_files() and not data.mock_data:
        return saved_form(load_tokenizer(default_data_files(data.cache_dir)[1]))
    tokenizer = build_tokenizer(
        data.tokenizer_type,
        tokenizer_model=data.tokenizer_model,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        vocab_size=data.vocab_size,
        tiktoken_pattern=data.tiktoken_pattern,
    )
    return saved_form(tokenizer) if hasattr(tokenizer, "files") else None


def _names_a_tokenizer(data) -> bool:
    """Whether mock data's flags name a tokenizer (as the flags' vocabulary check reads them): the
    default SentencePieceTokenizer without a model names none, and mock data then needs none."""
    named = data.tokenizer_model or data.vocab_file or data.vocab_size is not None
    return bool(named) or data.tokenizer_type != "SentencePieceTokenizer"
