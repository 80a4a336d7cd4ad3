"""GPT samples over one IndexedDataset: split strings, document ranges, and the three cached indices.

A split is a contiguous range of sequences, as megatron-core cuts it (with one sequence per
document, as tools/preprocess_data.py writes, that is the document); the sequence is also the unit
the indices shuffle. Three arrays turn a sample number into tokens:

Their construction is megatron-core's GPTDataset's (same seed, same numpy calls, same arithmetic),
so sample i is the token run megatron-core's GPTDataset gives for sample i on the same files:

- document index: the split's sequences repeated for as many epochs as the requested samples need
  (int32), shuffled as one array; when the last epoch contributes fewer than 80% of an epoch's
  samples it is shuffled on its own after the others. Concatenated they form one token stream;
- sample index, shape [total + 1, 2], total = (epochs * tokens per epoch - 1) // seq_length (every
  whole sample the epochs hold, not only the requested ones): row i is (position in the document
  index, token offset) of stream token i * seq_length. Sample i is stream tokens [i*L, (i+1)*L]
  inclusive, L + 1 tokens (inputs and shifted labels), so consecutive samples share one token and
  samples run across document boundaries;
- shuffle index: a permutation of the `total` samples (with a separate last epoch, the samples
  before it and those in it are permuted apart), drawn from the same random state after the
  document index. Item i is sample shuffle[i], for every i below `total` (at least the requested
  `num_samples`).

They are built once, saved as .npy beside the data (or in `cache_dir`) under a name that hashes
every parameter they depend on, and memory-mapped on later runs. With `build=False` a dataset only
says whether its indices are cached (`needs_indices`) and where they would go (`cache_folder`):
what the checks before a run need, without writing anything.

Owns sampling only; the file format is indexed_dataset.py's, blending is blended_dataset.py's.
"""

import hashlib
import os
import re
import sys
from pathlib import Path

import numpy as np

from megazero.data.corpus import Progress
from megazero.core.errors import UsageError

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split):
    """'949,50,1' (or '98/1/1', or '0.9,0.1') -> three fractions summing to 1; missing parts are 0.
    Normalised as megatron-core does (float64 weights over their numpy sum), so the bounds below
    round the same way."""
    parts = [p.strip() for p in re.split(r"[,/]", str(split))]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise UsageError(
            f"--split '{split}' is not numbers; write it like '949,50,1' (train,valid,test weights)"
        ) from None
    if len(values) > 3:
        raise UsageError(f"--split '{split}' has {len(values)} parts; give at most 3 (train,valid,test)")
    if any(v < 0 or not np.isfinite(v) for v in values) or sum(values) <= 0:
        raise UsageError(f"--split '{split}' needs non-negative weights with a positive sum, e.g. '949,50,1'")
    weights = np.array(values + [0.0] * (3 - len(values)), dtype=np.float64)
    return (weights / np.sum(weights)).tolist()


def split_document_ranges(fractions, num_sequences):
    """megatron-core's rule (BlendedMegatronDatasetBuilder): [(start, end)] of sequence numbers per
    split over `num_sequences` sequences (one per document, as tools/preprocess_data.py writes).

    The fractions' running sums, added as Python floats from 0, are each split's book-ends (lo, hi);
    the split takes sequences [round(lo * N), round(hi * N)). A split of weight 0 gets an empty
    range (megatron-core builds none). Python's round() is half-to-even, as megatron-core's.
    """
    ends = [0]
    for fraction in fractions:
        ends.append(ends[-1] + fraction)
    return [
        (int(round(lo * float(num_sequences))), int(round(hi * float(num_sequences))))
        for lo, hi in zip(ends[:-1], ends[1:])
    ]


INDEX_RULE = "megatron-core-0.16"
SEPARATE_LAST_EPOCH_BELOW = 0.80  # megatron-core's threshold, a fraction of one epoch's samples


def epoch_plan(num_samples, seq_length, tokens_per_epoch):
    """(epochs, total samples they hold, samples before the last epoch or None when the last epoch is
    shuffled with the others), by megatron-core's arithmetic (one extra token: the last label)."""
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    if num_epochs == 1:
        return num_epochs, total, None
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    separate = num_samples - before_last < int(SEPARATE_LAST_EPOCH_BELOW * per_epoch)
    return num_epochs, total, before_last if separate else None


def build_document_index(sequence_ids, num_epochs, rng, separate_last=False):
    """The split's sequences for `num_epochs` epochs as one shuffled int32 array (the last epoch
    shuffled on its own after the others when `separate_last`)."""
    if separate_last and num_epochs > 1:
        return np.concatenate(
            [build_document_index(sequence_ids, num_epochs - 1, rng), build_document_index(sequence_ids, 1, rng)]
        )
    index = np.tile(np.asarray(sequence_ids, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_shuffle_index(total, before_last, rng):
    """A permutation of range(total); with `before_last`, [0, before_last) and [before_last, total)
    are permuted apart (the first drawn first), in megatron-core's dtype (its draws depend on it)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    cut = total if before_last is None else before_last
    first = np.arange(cut, dtype=dtype)
    rng.shuffle(first)
    if cut == total:
        return first
    last = np.arange(cut, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_sample_index(sizes, document_index, num_samples, seq_length):
    """Row i = (document-index position, offset) of stream token i * seq_length, for i in 0..num_samples."""
    lengths = sizes[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right": a position equal to a document's end belongs to the next document, and
    # empty documents (start == end) are never chosen. (megatron-core writes such a position as
    # the end of the document before; the tokens a sample reads are the same.)
    doc_positions = np.searchsorted(ends, positions, side="right")
    return np.stack([doc_positions, positions - starts[doc_positions]], axis=1)


def _save_npy_atomically(path, array):
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


class GPTDataset:
    """At least `num_samples` samples of `seq_length + 1` tokens from sequences [start, end) of
    `indexed` (its documents, where each is one sequence)."""

    def __init__(
        self,
        indexed,
        split_name,
        document_range,
        num_samples,
        seq_length,
        seed,
        cache_dir=None,
        progress=True,
        build=True,
    ):
        start, end = document_range
        if not 0 <= start < end <= len(indexed):
            raise UsageError(
                f"{split_name} split: sequence range [{start}, {end}) is empty or outside "
                f"the {len(indexed)} sequences of {indexed.prefix}; adjust --split"
            )
        if seq_length < 1 or num_samples < 1:
            raise UsageError(
                f"{split_name} split: seq_length ({seq_length}) and num_samples ({num_samples}) must be positive"
            )
        self.indexed = indexed
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.sequence_ids = np.arange(start, end, dtype=np.int64)
        self.tokens_per_epoch = int(indexed.sizes[start:end].sum(dtype=np.int64))
        if self.tokens_per_epoch == 0:
            raise UsageError(
                f"{split_name} split of {indexed.prefix} has no tokens; use more data or a different --split"
            )
        # INDEX_RULE: indices cached by an earlier rule are never read back as this one's.
        key = (
            f"{INDEX_RULE}|{Path(indexed.prefix).name}|{split_name}|{start}:{end}|{num_samples}|{seq_length}"
            f"|{seed}|{self.tokens_per_epoch}"
        )
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        folder = Path(cache_dir) if cache_dir else Path(indexed.prefix).parent
        stem = folder / f"{Path(indexed.prefix).name}_{split_name}_{digest}"
        self.cache_paths = {name: Path(f"{stem}_{name}.npy") for name in ("doc_idx", "sample_idx", "shuffle_idx")}
        self.cache_folder = folder
        self.needs_indices = self.built_indices = not all(p.is_file() for p in self.cache_paths.values())
        if not build:
            return
        damage = None if self.built_indices else self._load_cached()
        if damage is not None:  # a killed copy, a full disk, another tool's file: built again
            print(
                f"megazero: the {split_name} sample index {damage}; rebuilding the split's indices",
                file=sys.stderr,
                flush=True,
            )
            self.built_indices = True
        if self.built_indices:
            try:
                self._build_and_save(seed, split_name, folder, progress)
            except OSError as err:
                raise UsageError(
                    f"cannot write the {split_name} sample indices to {folder} ({err.strerror}); "
                    "pass --data-cache-path DIR in a writable place"
                ) from None
            damage = self._load_cached()
            if damage is not None:  # what was just written does not read back: the disk's fault
                raise UsageError(
                    f"the {split_name} sample index {damage} right after being written; check "
                    f"the disk of {folder}, or pass --data-cache-path DIR elsewhere"
                )

    def _load_cached(self) -> str | None:
        """Memory-maps the three cached arrays after checking them as the sampler reads them (dtype,
        shape, every index in range: what a damaged or foreign file would break later in a traceback);
        returns what is wrong with the first bad one (its path and why), or None."""
        arrays = {}
        for name, path in self.cache_paths.items():
            try:
                arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError, EOFError) as err:
                return (
                    f"{path} is damaged (no .npy array: {str(err).splitlines()[0] if str(err) else type(err).__name__})"
                )
        doc, sample, shuffle = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]
        sizes, first, last = self.indexed.sizes, self.sequence_ids[0], self.sequence_ids[-1]
        num_epochs, total, _ = epoch_plan(self.num_samples, self.seq_length, self.tokens_per_epoch)
        problems = {
            "doc_idx": (
                not np.issubdtype(doc.dtype, np.integer)
                or doc.ndim != 1
                or len(doc) != num_epochs * len(self.sequence_ids)
                or (len(doc) and (doc.min() < first or doc.max() > last))
            ),
            "sample_idx": (not np.issubdtype(sample.dtype, np.integer) or sample.shape != (total + 1, 2)),
            "shuffle_idx": (
                not np.issubdtype(shuffle.dtype, np.integer)
                or shuffle.shape != (total,)
                or shuffle.min() < 0
                or shuffle.max() >= total
            ),
        }
        if not problems["doc_idx"] and not problems["sample_idx"]:
            positions, offsets = sample[:, 0], sample[:, 1]
            problems["sample_idx"] = bool(
                positions.min() < 0
                or positions.max() >= len(doc)
                or np.any(np.diff(positions) < 0)
                or offsets.min() < 0
                or np.any(offsets >= sizes[doc[positions]])
            )
        for name, bad in problems.items():
            if bad:
                return (
                    f"{self.cache_paths[name]} is damaged (not the {self.num_samples}-sample index of this "
                    f"split: dtype, shape or an index out of range)"
                )
        self.doc_idx, self.sample_idx, self.shuffle_idx = doc, sample, shuffle
        return None

    @property
    def num_epochs(self) -> int:
        """Passes over the split the samples need: one more token than num_samples * seq_length (the
        last sample's shifted label)."""
        return epoch_plan(self.num_samples, self.seq_length, self.tokens_per_epoch)[0]

    def _build_and_save(self, seed, split_name, folder, progress):
        meter = Progress(f"building {split_name} indices ({self.num_samples} samples)", enabled=progress)
        meter.begin()
        num_epochs, total, before_last = epoch_plan(self.num_samples, self.seq_length, self.tokens_per_epoch)
        rng = np.random.RandomState(seed)
        doc_idx = build_document_index(self.sequence_ids, num_epochs, rng, separate_last=before_last is not None)
        sample_idx = build_sample_index(self.indexed.sizes, doc_idx, total, self.seq_length)
        shuffle_idx = build_shuffle_index(total, before_last, rng).astype(np.int64)
        folder.mkdir(parents=True, exist_ok=True)
        for name, array in (("doc_idx", doc_idx), ("sample_idx", sample_idx), ("shuffle_idx", shuffle_idx)):
            _save_npy_atomically(self.cache_paths[name], array)
        meter.finish(self.num_samples, f"samples, {num_epochs} epochs,")

    def __len__(self):
        """Every whole sample of the epochs built (at least `num_samples`), as megatron-core's."""
        return len(self.shuffle_idx)

    def sample_tokens(self, sample):
        """Tokens of sample `sample` in stream order (before the shuffle index), as int64."""
        (doc_start, offset_start), (doc_end, offset_end) = self.sample_idx[sample], self.sample_idx[sample + 1]
        if doc_start == doc_end:
            return self.indexed.get(
                int(self.doc_idx[doc_start]), int(offset_start), int(offset_end - offset_start + 1)
            ).astype(np.int64)
        pieces = [self.indexed.get(int(self.doc_idx[doc_start]), int(offset_start))]
        pieces += [self.indexed.get(int(self.doc_idx[d])) for d in range(doc_start + 1, doc_end)]
        pieces.append(self.indexed.get(int(self.doc_idx[doc_end]), 0, int(offset_end) + 1))
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, index):
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        return {"tokens": self.sample_tokens(int(self.shuffle_idx[index]))}
