"""GPT samples over one IndexedDataset: split strings, document ranges, and the three cached indices.

A split is a contiguous range of documents. Within it, the unit the indices shuffle is the
sequence (with one sequence per document, as tools/preprocess_data.py writes, that is the
document). Three arrays turn a sample number into tokens:

- document index: the split's sequences, shuffled, once per epoch, for as many epochs as the
  requested samples need; concatenated they form one token stream;
- sample index, shape [num_samples + 1, 2]: row i is (position in the document index, token
  offset) of stream token i * seq_length. Sample i is stream tokens [i*L, (i+1)*L] inclusive,
  L + 1 tokens (inputs and shifted labels), so consecutive samples share one token and samples
  run across document boundaries;
- shuffle index: a permutation of the samples.

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
    """'949,50,1' (or '98/1/1', or '0.9,0.1') -> three fractions summing to 1; missing parts are 0."""
    parts = [p.strip() for p in re.split(r"[,/]", str(split))]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise UsageError(f"--split '{split}' is not numbers; write it like '949,50,1' "
                         "(train,valid,test weights)") from None
    if len(values) > 3:
        raise UsageError(f"--split '{split}' has {len(values)} parts; give at most 3 (train,valid,test)")
    if any(v < 0 or not np.isfinite(v) for v in values) or sum(values) <= 0:
        raise UsageError(f"--split '{split}' needs non-negative weights with a positive sum, "
                         "e.g. '949,50,1'")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_document_ranges(fractions, num_documents):
    """Megatron's rule: [(start, end)] per split over `num_documents` documents.

    Boundary k+1 is boundary k plus round(fraction_k * N); if rounding overshoots or undershoots
    N, every boundary after the first moves by the difference so the last one is exactly N.
    (Python's round() is half-to-even, the same one Megatron uses, so the splits agree.)
    """
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * float(num_documents))))
    overshoot = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - overshoot for b in bounds[1:]]
    return [(bounds[k], bounds[k + 1]) for k in range(len(fractions))]


def build_document_index(sequence_ids, num_epochs, rng):
    """The split's sequence ids, each epoch shuffled on its own, epochs back to back."""
    return np.concatenate([rng.permutation(sequence_ids) for _ in range(num_epochs)]).astype(np.int64)


def build_sample_index(sizes, document_index, num_samples, seq_length):
    """Row i = (document-index position, offset) of stream token i * seq_length, for i in 0..num_samples."""
    lengths = sizes[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right": a position equal to a document's end belongs to the next document, and
    # empty documents (start == end) are never chosen.
    doc_positions = np.searchsorted(ends, positions, side="right")
    return np.stack([doc_positions, positions - starts[doc_positions]], axis=1)


def _save_npy_atomically(path, array):
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


class GPTDataset:
    """`num_samples` samples of `seq_length + 1` tokens from documents [start, end) of `indexed`."""

    def __init__(self, indexed, split_name, document_range, num_samples, seq_length, seed,
                 cache_dir=None, progress=True, build=True):
        start, end = document_range
        if not 0 <= start < end <= indexed.num_documents:
            raise UsageError(f"{split_name} split: document range [{start}, {end}) is empty or outside "
                             f"the {indexed.num_documents} documents of {indexed.prefix}; adjust --split")
        if seq_length < 1 or num_samples < 1:
            raise UsageError(f"{split_name} split: seq_length ({seq_length}) and num_samples "
                             f"({num_samples}) must be positive")
        self.indexed = indexed
        self.seq_length = seq_length
        self.num_samples = num_samples
        first, last = int(indexed.document_indices[start]), int(indexed.document_indices[end])
        self.sequence_ids = np.arange(first, last, dtype=np.int64)
        self.tokens_per_epoch = int(indexed.sizes[first:last].sum(dtype=np.int64))
        if self.tokens_per_epoch == 0:
            raise UsageError(f"{split_name} split of {indexed.prefix} has no tokens; use more data or "
                             "a different --split")
        key = (f"{Path(indexed.prefix).name}|{split_name}|{start}:{end}|{num_samples}|{seq_length}"
               f"|{seed}|{self.tokens_per_epoch}")
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        folder = Path(cache_dir) if cache_dir else Path(indexed.prefix).parent
        stem = folder / f"{Path(indexed.prefix).name}_{split_name}_{digest}"
        self.cache_paths = {name: Path(f"{stem}_{name}.npy") for name in ("doc_idx", "sample_idx", "shuffle_idx")}
        self.cache_folder = folder
        self.needs_indices = self.built_indices = not all(p.is_file() for p in self.cache_paths.values())
        if not build:
            return
        damage = None if self.built_indices else self._load_cached()
        if damage is not None:      # a killed copy, a full disk, another tool's file: built again
            print(f"megazero: the {split_name} sample index {damage}; rebuilding the split's indices", file=sys.stderr,
                  flush=True)
            self.built_indices = True
        if self.built_indices:
            try:
                self._build_and_save(seed, split_name, folder, progress)
            except OSError as err:
                raise UsageError(f"cannot write the {split_name} sample indices to {folder} ({err.strerror}); "
                                 "pass --data-cache-path DIR in a writable place") from None
            damage = self._load_cached()
            if damage is not None:        # what was just written does not read back: the disk's fault
                raise UsageError(f"the {split_name} sample index {damage} right after being written; check "
                                 f"the disk of {folder}, or pass --data-cache-path DIR elsewhere")

    def _load_cached(self) -> str | None:
        """Memory-maps the three cached arrays after checking them as the sampler reads them (dtype,
        shape, every index in range: what a damaged or foreign file would break later in a traceback);
        returns what is wrong with the first bad one (its path and why), or None."""
        arrays = {}
        for name, path in self.cache_paths.items():
            try:
                arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError, EOFError) as err:
                return f"{path} is damaged (no .npy array: {str(err).splitlines()[0] if str(err) else type(err).__name__})"
        doc, sample, shuffle = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]
        sizes, first, last = self.indexed.sizes, self.sequence_ids[0], self.sequence_ids[-1]
        problems = {
            "doc_idx": (doc.dtype != np.int64 or doc.ndim != 1 or len(doc) != self.num_epochs * len(self.sequence_ids)
                        or (len(doc) and (doc.min() < first or doc.max() > last))),
            "sample_idx": (sample.dtype != np.int64 or sample.shape != (self.num_samples + 1, 2)),
            "shuffle_idx": (shuffle.dtype != np.int64 or shuffle.shape != (self.num_samples,)
                            or shuffle.min() < 0 or shuffle.max() >= self.num_samples),
        }
        if not problems["doc_idx"] and not problems["sample_idx"]:
            positions, offsets = sample[:, 0], sample[:, 1]
            problems["sample_idx"] = bool(
                positions.min() < 0 or positions.max() >= len(doc) or np.any(np.diff(positions) < 0)
                or offsets.min() < 0 or np.any(offsets >= sizes[doc[positions]]))
        for name, bad in problems.items():
            if bad:
                return (f"{self.cache_paths[name]} is damaged (not the {self.num_samples}-sample index of this "
                        f"split: dtype, shape or an index out of range)")
        self.doc_idx, self.sample_idx, self.shuffle_idx = doc, sample, shuffle
        return None

    @property
    def num_epochs(self) -> int:
        """Passes over the split the samples need: one more token than num_samples * seq_length (the
        last sample's shifted label)."""
        return -(-(self.num_samples * self.seq_length + 1) // self.tokens_per_epoch)

    def _build_and_save(self, seed, split_name, folder, progress):
        meter = Progress(f"building {split_name} indices ({self.num_samples} samples)", enabled=progress)
        meter.begin()
        num_epochs = self.num_epochs
        rng = np.random.RandomState(seed)
        doc_idx = build_document_index(self.sequence_ids, num_epochs, rng)
        sample_idx = build_sample_index(self.indexed.sizes, doc_idx, self.num_samples, self.seq_length)
        shuffle_idx = rng.permutation(self.num_samples).astype(np.int64)
        folder.mkdir(parents=True, exist_ok=True)
        for name, array in (("doc_idx", doc_idx), ("sample_idx", sample_idx), ("shuffle_idx", shuffle_idx)):
            _save_npy_atomically(self.cache_paths[name], array)
        meter.finish(self.num_samples, f"samples, {num_epochs} epochs,")

    def __len__(self):
        return self.num_samples

    def sample_tokens(self, sample):
        """Tokens of sample `sample` in stream order (before the shuffle index), as int64."""
        (doc_start, offset_start), (doc_end, offset_end) = self.sample_idx[sample], self.sample_idx[sample + 1]
        if doc_start == doc_end:
            return self.indexed.get(int(self.doc_idx[doc_start]), int(offset_start),
                                    int(offset_end - offset_start + 1)).astype(np.int64)
        pieces = [self.indexed.get(int(self.doc_idx[doc_start]), int(offset_start))]
        pieces += [self.indexed.get(int(self.doc_idx[d])) for d in range(doc_start + 1, doc_end)]
        pieces.append(self.indexed.get(int(self.doc_idx[doc_end]), 0, int(offset_end) + 1))
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, index):
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return {"tokens": self.sample_tokens(int(self.shuffle_idx[index]))}
