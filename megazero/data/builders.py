"""From `--data-path`, `--split` and sample counts to the train/valid/test datasets.

Owns the `--data-path` grammar (`prefix` or `w1 prefix1 w2 prefix2 ...`) and the assembly:
each prefix is split by documents, a GPTDataset is built per split, and with several prefixes
the per-prefix datasets of a split are blended by weight.
"""

import math

from megazero.data.blended_dataset import BlendedDataset, normalize_weights
from megazero.data.gpt_dataset import SPLIT_NAMES, GPTDataset, parse_split, split_document_ranges
from megazero.data.indexed_dataset import IndexedDataset, data_file_paths
from megazero.errors import UsageError

# Each member of a blend gets this many more samples than its share, plus one, so rounding in
# the blend's greedy assignment can never ask a member for a sample it lacks.
BLEND_OVERSAMPLE = 1.005


def _check_prefix_files(prefix):
    bin_path, idx_path = data_file_paths(prefix)
    for path in (bin_path, idx_path):
        if not path.is_file():
            hint = " (give the prefix without extension)" if prefix.endswith((".bin", ".idx")) else ""
            raise UsageError(f"--data-path prefix '{prefix}': {path} not found; expected {bin_path} "
                             f"and {idx_path}{hint}")


def parse_data_path(data_path):
    """`["prefix"]` -> [(1.0, prefix)]; `["0.7", "a", "0.3", "b"]` -> [(0.7, "a"), (0.3, "b")].

    A single string is split on whitespace. Weights are returned as given (normalised later);
    every prefix must have both its `.bin` and `.idx`.
    """
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise UsageError("--data-path is empty; give a prefix or 'weight prefix weight prefix ...'")
    if len(items) == 1:
        pairs = [(1.0, items[0])]
    else:
        if len(items) % 2:
            raise UsageError(f"--data-path has {len(items)} entries; with several datasets give "
                             "'weight prefix' pairs, e.g. '0.7 a 0.3 b'")
        pairs = []
        for weight_text, prefix in zip(items[0::2], items[1::2]):
            try:
                weight = float(weight_text)
            except ValueError:
                raise UsageError(f"--data-path weight '{weight_text}' (before '{prefix}') is not a number; "
                                 "give 'weight prefix' pairs, e.g. '0.7 a 0.3 b'") from None
            pairs.append((weight, prefix))
        normalize_weights([w for w, _ in pairs])  # raises on negative or all-zero weights
    for _, prefix in pairs:
        _check_prefix_files(prefix)
    return pairs


def _split_datasets_for_prefix(prefix, fractions, seq_length, seed, samples_per_split, cache_dir, progress):
    """[train, valid, test] GPTDatasets of one prefix (None where the split gets no samples)."""
    indexed = IndexedDataset(prefix)
    ranges = split_document_ranges(fractions, indexed.num_documents)
    datasets = []
    for name, fraction, (start, end), count in zip(SPLIT_NAMES, fractions, ranges, samples_per_split):
        if fraction == 0 or count == 0:
            datasets.append(None)
            continue
        if start == end:
            raise UsageError(f"--split gives the {name} set 0 of the {indexed.num_documents} documents "
                             f"in {prefix}; use more data or a larger {name} share")
        datasets.append(GPTDataset(indexed, name, (start, end), count, seq_length, seed,
                                   cache_dir=cache_dir, progress=progress))
    return datasets


def build_train_valid_test_datasets(data_path, split, seq_length, seed, num_samples,
                                    cache_dir=None, progress=True):
    """(train, valid, test): each a GPTDataset or BlendedDataset, or None when its split fraction
    or requested sample count is 0.

    `num_samples` is (train, valid, test). Index caches go beside the data unless `cache_dir`
    is given (useful when the data directory is read-only).
    """
    pairs = parse_data_path(data_path)
    fractions = parse_split(split)
    num_samples = [int(n) for n in num_samples]
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise UsageError(f"num_samples {num_samples} must be three non-negative counts (train, valid, test)")
    if len(pairs) == 1:
        return tuple(_split_datasets_for_prefix(pairs[0][1], fractions, seq_length, seed,
                                                num_samples, cache_dir, progress))
    weights = normalize_weights([w for w, _ in pairs])
    per_prefix = []
    for weight, (_, prefix) in zip(weights, pairs):
        counts = [math.ceil(weight * n * BLEND_OVERSAMPLE) + 1 if n else 0 for n in num_samples]
        per_prefix.append(_split_datasets_for_prefix(prefix, fractions, seq_length, seed,
                                                     counts, cache_dir, progress))
    blends = []
    for split_number, size in enumerate(num_samples):
        members = [datasets[split_number] for datasets in per_prefix]
        if any(m is None for m in members):
            blends.append(None)
            continue
        blends.append(BlendedDataset(members, weights, size))
    return tuple(blends)

