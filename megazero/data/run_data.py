"""Everything a training run reads, in one call: `run_data(cfg, dp_rank, dp_size, ...)` gives the
train batches (the sampler over the train split, read ahead by threads under --num-workers), the
evaluation batches and the tokenizer record the run's checkpoints keep.

Where the data comes from: --mock-data (random tokens of the vocabulary, no files), --data-path
(Megatron .bin/.idx prefixes, blended by weight), else the embedded corpus, prepared into the cache
once. Building a split's sample indices writes cache files, so one rank builds first and the others
follow once it is done (`first`, the launch's agreement: it runs the build on the rank that prepares
and hands the others its verdict). Reads a TrainConfig's fields; imports nothing above data/.
"""
from __future__ import annotations

import dataclasses

from megazero.data.read_ahead import ReadAhead
from megazero.data.sampler import MicrobatchSource


@dataclasses.dataclass
class RunData:
    train: object                   # batch(i) -> this rank's microbatches of step i
    valid: list                     # the evaluation batches (the same every evaluation)
    tokenizer: dict | None          # the tokenizer as checkpoints keep it; None: none to keep

    def close(self) -> None:
        if isinstance(self.train, ReadAhead):
            self.train.close()


def run_data(cfg, dp_rank: int, dp_size: int, say, *, first=None, keep_tokenizer: bool = False) -> RunData:
    """This data-parallel rank's data for `cfg` (a TrainConfig). `first(build)` runs `build(progress)`
    on the rank that prepares shared files before the others (None: here, with progress lines);
    `keep_tokenizer`: also describe the tokenizer for checkpoints (the rank that saves it)."""
    first = first or (lambda build: build(True))
    train_set, valid_set = datasets(cfg, say, first)
    train = MicrobatchSource(train_set, cfg.global_batch_size, cfg.micro_batch_size, dp_rank, dp_size,
                             ramp=cfg.rampup)
    if cfg.run.num_workers > 0:
        train = ReadAhead(train, cfg.run.num_workers)
    valid = []
    if valid_set is not None and cfg.eval_iters > 0:
        source = MicrobatchSource(valid_set, cfg.global_batch_size, cfg.micro_batch_size, dp_rank, dp_size)
        valid = [source.batch(i) for i in range(cfg.eval_iters)]
    return RunData(train, valid, tokenizer_record(cfg.data) if keep_tokenizer else None)


def datasets(cfg, say, first):
    """(train, valid) datasets of the run."""
    from megazero.data.builders import build_train_valid_test_datasets
    from megazero.data.default_data import prepare_default_data
    from megazero.data.synthetic import SyntheticTokens
    if cfg.data.mock_data:
        vocab, seq = cfg.model.vocab_size, cfg.model.seq_length
        say(f" data: mock (random tokens of a {vocab}-token vocabulary)")
        return SyntheticTokens(vocab, seq, seed=cfg.seed), SyntheticTokens(vocab, seq, seed=cfg.seed + 1)

    def build(progress: bool):
        data_path = cfg.data.data_path
        if not cfg.data.reads_files():
            prefix, _ = prepare_default_data(cfg.data.cache_dir, progress=progress)
            say(f" data: embedded corpus (Python standard library sources) at {prefix}")
            data_path = [prefix]
        train, valid, _ = build_train_valid_test_datasets(
            data_path, cfg.data.split, cfg.model.seq_length, cfg.seed, cfg.sample_counts(), cfg.data.cache_dir,
            progress, mmap=cfg.data.mmap_bin_files, per_split=cfg.data.split_paths,
            threads=cfg.data.builder_threads)
        return train, valid
    return first(build)


def tokenizer_record(data) -> dict | None:
    """The run's tokenizer as its checkpoints keep it (megazero.data.tokenizer.saved_form), from a
    TrainConfig's data settings; None for mock data without a tokenizer, and for a TikTokenizer (its
    checkpoints export with --without-tokenizer only)."""
    from megazero.data.default_data import default_data_files
    from megazero.data.tokenizer import build_tokenizer, load_tokenizer, saved_form
    if data.mock_data and not _names_a_tokenizer(data):
        return None                        # random tokens of the default vocabulary: no tokenizer to keep
    if not data.reads_files() and not data.mock_data:
        return saved_form(load_tokenizer(default_data_files(data.cache_dir)[1]))
    tokenizer = build_tokenizer(data.tokenizer_type, tokenizer_model=data.tokenizer_model,
                                vocab_file=data.vocab_file, merge_file=data.merge_file,
                                vocab_size=data.vocab_size, tiktoken_pattern=data.tiktoken_pattern)
    return saved_form(tokenizer) if hasattr(tokenizer, "files") else None


def _names_a_tokenizer(data) -> bool:
    """Whether mock data's flags name a tokenizer (as the flags' vocabulary check reads them): the
    default SentencePieceTokenizer without a model names none, and mock data then needs none."""
    named = data.tokenizer_model or data.vocab_file or data.vocab_size is not None
    return bool(named) or data.tokenizer_type != "SentencePieceTokenizer"
