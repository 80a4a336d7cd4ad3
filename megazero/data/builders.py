"""From `--data-path` and `--split` (or `--train-data-path` / `--valid-data-path` /
`--test-data-path`) and sample counts to the train/valid/test datasets.

Owns the `--data-path` grammar (`prefix` or `w1 prefix1 w2 prefix2 ...`) and the assembly:
each prefix is split by sequences as megatron-core splits it, a GPTDataset is built per split, and
with several prefixes the per-prefix datasets of a split are blended by weight. With a path per
split, each split takes the whole of its own prefixes (Megatron's blend per split, `--split`
unused). Several prefixes build on `threads` threads (--num-dataset-builder-threads).
"""

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megazero.data.blended_dataset import BlendedDataset, normalize_weights
from megazero.data.hf_files import is_raw_text_data, tokenise_first
from megazero.data.gpt_dataset import SPLIT_NAMES, GPTDataset, parse_split, split_document_ranges
from megazero.data.indexed_dataset import IndexedDataset, data_file_paths
from megazero.core.errors import UsageError

# megatron-core's sizes for a blend of n samples: member k is asked for ceil(ceil(n * w_k) * 1.005)
# samples (its mid_level_dataset_surplus) and the blend holds sum_k ceil(n * w_k). The member's
# sample count sets its epochs and so its shuffle: equal sizes make equal samples.
BLEND_SURPLUS = 0.005


def _prefix_hint(prefix):
    """What the user probably meant, for a prefix whose files are missing."""
    path = Path(prefix)
    if prefix.endswith((".bin", ".idx")):
        return f"; give the prefix without extension: {prefix[:-4]}"
    if all(p.is_file() for p in data_file_paths(f"{prefix}_text_document")):
        return f"; did you mean {prefix}_text_document (tools/preprocess_data.py appends _<key>_document)?"
    if path.is_dir():
        found = sorted(p.name[:-4] for p in path.glob("*.idx") if p.with_suffix(".bin").is_file())
        shown = (
            f"; it holds {', '.join(str(path / name) for name in found[:3])}"
            if found
            else "; it holds no .bin/.idx pair"
        )
        return f" ({prefix} is a directory: give the prefix of a pair inside it{shown})"
    return ""


OBJECT_STORAGE = ("s3://", "msc://", "gs://", "az://")


def _check_prefix_files(prefix, flag="--data-path"):
    if prefix.startswith(OBJECT_STORAGE):
        raise UsageError(
            f"{flag} {prefix}: megazero reads data from local files only (no object storage); "
            f"copy the .bin/.idx pair to a local or mounted filesystem and give that prefix"
        )
    if is_raw_text_data(prefix):
        raise tokenise_first(prefix, flag)
    bin_path, idx_path = data_file_paths(prefix)
    for path in (bin_path, idx_path):
        if not path.is_file():
            raise UsageError(
                f"{flag} prefix '{prefix}': {path} not found; expected {bin_path} and {idx_path}{_prefix_hint(prefix)}"
            )


def _weighted(data_path) -> bool:
    """Whether the blend names weights ('w prefix ...'), which makes megatron-core blend even one prefix."""
    return len(data_path.split() if isinstance(data_path, str) else list(data_path)) > 1


def parse_data_path(data_path, flag="--data-path"):
    """`["prefix"]` -> [(1.0, prefix)]; `["0.7", "a", "0.3", "b"]` -> [(0.7, "a"), (0.3, "b")].

    A single string is split on whitespace. Weights are returned as given (normalised later);
    every prefix must have both its `.bin` and `.idx`.
    """
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise UsageError(f"{flag} is empty; give a prefix or 'weight prefix weight prefix ...'")
    if len(items) == 1:
        pairs = [(1.0, items[0])]
    else:
        if len(items) % 2:
            raise UsageError(
                f"{flag} has {len(items)} entries; with several datasets give 'weight prefix' pairs, e.g. '0.7 a 0.3 b'"
            )
        pairs = []
        for weight_text, prefix in zip(items[0::2], items[1::2]):
            try:
                weight = float(weight_text)
            except ValueError:
                raise UsageError(
                    f"{flag} weight '{weight_text}' (before '{prefix}') is not a number; "
                    "give 'weight prefix' pairs, e.g. '0.7 a 0.3 b'"
                ) from None
            if weight < 0 or not math.isfinite(weight):
                raise UsageError(
                    f"{flag} weight {weight_text} (before '{prefix}') must be a "
                    "non-negative number; give 'weight prefix' pairs, e.g. '0.7 a 0.3 b'"
                )
            pairs.append((weight, prefix))
        if sum(w for w, _ in pairs) <= 0:
            raise UsageError(f"{flag} weights are all 0; give at least one dataset a positive weight")
    for _, prefix in pairs:
        _check_prefix_files(prefix, flag)
    return pairs


def _split_datasets_for_prefix(
    prefix, fractions, seq_length, seed, samples_per_split, cache_dir, progress, build=True, mmap=True
):
    """[train, valid, test] GPTDatasets of one prefix (None where the split gets no samples)."""
    indexed = IndexedDataset(prefix, mmap=mmap)
    if indexed.num_documents == 0:
        raise UsageError(
            f"--data-path {prefix} holds no documents; preprocess a non-empty corpus with tools/preprocess_data.py"
        )
    ranges = split_document_ranges(fractions, len(indexed))
    datasets = []
    for name, fraction, (start, end), count in zip(SPLIT_NAMES, fractions, ranges, samples_per_split):
        if fraction == 0 or count == 0:
            datasets.append(None)
            continue
        if start == end:
            raise UsageError(
                f"--split gives the {name} set 0 of the {len(indexed)} sequences (documents) "
                f"in {prefix}; use more data or a larger {name} share"
            )
        datasets.append(
            GPTDataset(
                indexed,
                name,
                (start, end),
                count,
                seq_length,
                seed,
                cache_dir=cache_dir,
                progress=progress,
                build=build,
            )
        )
    return datasets


def _blended_splits(
    pairs, weighted, fractions, seq_length, seed, num_samples, cache_dir, progress, build, mmap, threads
):
    """(train, valid, test) of one blend of (weight, prefix) pairs cut by `fractions`. As megatron-core
    builds it: one prefix without a weight is its GPTDataset itself; given weights make a blend (of
    the prefixes of positive weight), even of one prefix."""
    if not weighted:
        return tuple(
            _split_datasets_for_prefix(
                pairs[0][1], fractions, seq_length, seed, num_samples, cache_dir, progress, build, mmap
            )
        )
    pairs = [(w, prefix) for w, prefix in pairs if w > 0]
    weights = normalize_weights([w for w, _ in pairs])
    targets = [[math.ceil(n * weight) for n in num_samples] for weight in weights]

    def member(job):
        counts, prefix = job
        counts = [math.ceil(count * (1 + BLEND_SURPLUS)) for count in counts]
        return _split_datasets_for_prefix(prefix, fractions, seq_length, seed, counts, cache_dir, progress, build, mmap)

    jobs = list(zip(targets, [prefix for _, prefix in pairs]))
    with ThreadPoolExecutor(max(1, min(threads, len(jobs)))) as pool:
        per_prefix = list(pool.map(member, jobs))
    if not build:
        return tuple([d for d in datasets if d is not None] for datasets in zip(*per_prefix))
    blends = []
    for split_number in range(3):
        members = [datasets[split_number] for datasets in per_prefix]
        if any(m is None for m in members):
            blends.append(None)
            continue
        blends.append(BlendedDataset(members, weights, sum(counts[split_number] for counts in targets)))
    return tuple(blends)


def build_train_valid_test_datasets(
    data_path,
    split,
    seq_length,
    seed,
    num_samples,
    cache_dir=None,
    progress=True,
    build=True,
    mmap=True,
    *,
    per_split=None,
    threads=1,
):
    """(train, valid, test): each a GPTDataset or BlendedDataset, or None when its split fraction
    or requested sample count is 0.

    `num_samples` is (train, valid, test). Index caches go beside the data unless `cache_dir`
    is given (useful when the data directory is read-only). With `build=False` nothing is written
    and the GPTDatasets hold no indices (see GPTDataset); blends are not assembled. With
    `mmap=False` the .bin files are read with plain reads (Megatron's --no-mmap-bin-files).
    `per_split`: (train, valid, test) blends, each in `data_path`'s grammar or None, used instead of
    `data_path` and `split`: a split takes the whole of its own prefixes (--train-data-path, ...).
    """
    num_samples = [int(n) for n in num_samples]
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise UsageError(f"num_samples {num_samples} must be three non-negative counts (train, valid, test)")
    if per_split is None:
        pairs = parse_data_path(data_path)
        return _blended_splits(
            pairs,
            _weighted(data_path),
            parse_split(split),
            seq_length,
            seed,
            num_samples,
            cache_dir,
            progress,
            build,
            mmap,
            threads,
        )
    datasets = []
    for number, (name, paths) in enumerate(zip(SPLIT_NAMES, per_split)):
        if paths is None or num_samples[number] == 0:
            datasets.append([] if not build else None)
            continue
        only = [1.0 if k == number else 0.0 for k in range(3)]
        counts = [n if k == number else 0 for k, n in enumerate(num_samples)]
        pairs = parse_data_path(paths, f"--{name}-data-path")
        # megatron-core takes a split's one prefix whole, weight or not
        datasets.append(
            _blended_splits(
                pairs, len(pairs) > 1, only, seq_length, seed, counts, cache_dir, progress, build, mmap, threads
            )[number]
        )
    return tuple(datasets)


def check_datasets(
    data_path, split, seq_length, seed, num_samples, cache_dir, vocab_size, vocab_source, per_split=None
):
    """What building the datasets needs, found without writing anything: every prefix opens (its
    files validated), its largest token id is below `vocab_size` (`vocab_source` names where the
    vocabulary came from), and the splits fit. Returns the folders sample indices must be written to."""
    splits = build_train_valid_test_datasets(
        data_path, split, seq_length, seed, num_samples, cache_dir, progress=False, build=False, per_split=per_split
    )
    members = []
    for found in splits:
        members += found if isinstance(found, list) else [found] if found is not None else []
    checked = set()
    for dataset in members:
        indexed = dataset.indexed
        if indexed.prefix not in checked:
            checked.add(indexed.prefix)
            largest = indexed.max_token_id
            if largest >= vocab_size:
                raise UsageError(
                    f"{indexed.prefix} holds token id {largest} but {vocab_source} has "
                    f"{vocab_size} pieces; give the tokenizer the data was made with, or "
                    f"re-run tools/preprocess_data.py with this one"
                )
    return sorted({d.cache_folder for d in members if d.needs_indices})
