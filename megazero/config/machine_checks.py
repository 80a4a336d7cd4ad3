"""Checks of a validated TrainConfig against this machine and its files, before any process group
starts: every path the run will write can be written, the model fits in memory, and the data opens
and matches the model's vocabulary. Each failure is one UsageError line naming the flag or variable
and the fix.

Writes nothing (probes are removed at once; the one exception is a data file's token statistics,
cached beside it, see megazero.data.indexed_dataset). The flags were already checked against each
other by megazero.config.train_flags; here they meet the world. Under torchrun the driver runs this on every
rank and lets rank 0 speak for all.
"""

from __future__ import annotations

import torch

from megazero.config.train_config import TrainConfig
from megazero.core.errors import UsageError, check_writable_dir, check_writable_file
from megazero.config.memory_estimate import available_bytes, describe_refusal, estimate


def check_output_paths(cfg: TrainConfig) -> None:
    """The run folder, the metrics file and nvme offload's swap folder can be created and written."""
    check_writable_dir(cfg.run_dir, f"run folder {cfg.run_dir} (--run-dir)", "pass --run-dir PATH in a writable place")
    check_writable_file(
        cfg.metrics_file,
        f"metrics file {cfg.metrics_file} (--metrics-file)",
        "pass --metrics-file PATH in a writable place",
    )
    for key in ("offload_optimizer", "offload_param"):
        block = getattr(cfg.zero, key)
        if block is not None and block.device == "nvme":
            check_writable_dir(
                block.nvme_path,
                f"swap folder {block.nvme_path} ({key}.nvme_path, --zero-nvme-path)",
                "point it at a writable directory on a local disk",
            )


def check_memory(cfg: TrainConfig, world_size: int, ranks_on_node: int, device: torch.device) -> None:
    """Refuses a run whose estimated memory per rank exceeds what this machine has for it."""
    found = estimate(cfg, world_size, device.type)
    available = available_bytes(device, ranks_on_node)
    if available is not None and found.total > available[0]:
        raise UsageError(describe_refusal(cfg, found, *available))


def check_data(cfg: TrainConfig) -> None:
    """The data opens, its token ids fit the vocabulary, and the caches it needs can be written."""
    from megazero.data.builders import check_datasets
    from megazero.data.default_data import cache_origin, default_data_dir, default_data_files, default_data_ready

    data = cfg.data
    if data.mock_data:  # random tokens: nothing to open
        return
    embedded = not data.reads_files()
    if embedded:
        if not default_data_ready(data.cache_dir):
            # The embedded corpus will be built (or repaired) into the cache by rank 0.
            check_writable_dir(
                default_data_dir(data.cache_dir),
                cache_origin(data.cache_dir),
                "point MEGAZERO_CACHE (or --data-cache-path) at a writable directory",
            )
            return
        prefix, model = default_data_files(data.cache_dir)
        data_path, vocab_source = [prefix], f"the embedded corpus's tokenizer {model}"
    else:
        data_path, vocab_source = data.data_path, _tokenizer_named(data)
    folders = check_datasets(
        data_path,
        data.split,
        cfg.model.seq_length,
        cfg.seed,
        cfg.sample_counts(),
        data.cache_dir,
        cfg.model.vocab_size,
        vocab_source,
        per_split=data.split_paths,
    )
    for folder in folders:
        if data.cache_dir:
            what = f"--data-cache-path {folder}"
        elif embedded:
            what = f"{cache_origin()} (its folder {folder} holds the sample indices)"
        else:
            what = f"the data folder {folder} (sample indices are cached beside --data-path)"
        check_writable_dir(folder, what, "pass --data-cache-path DIR in a writable place")


def _tokenizer_named(data) -> str:
    """The tokenizer as the user gave it, for messages."""
    if data.tokenizer_type == "GPT2BPETokenizer":
        return f"--vocab-file {data.vocab_file} (GPT2BPETokenizer)"
    if data.tokenizer_type == "NullTokenizer":
        return f"--vocab-size {data.vocab_size} (NullTokenizer)"
    return f"--tokenizer-model {data.tokenizer_model} ({data.tokenizer_type})"


def check_machine(cfg: TrainConfig, world_size: int, ranks_on_node: int, device: torch.device) -> None:
    """Every check of this module, cheapest first."""
    check_output_paths(cfg)
    check_memory(cfg, world_size, ranks_on_node, device)
    check_data(cfg)
