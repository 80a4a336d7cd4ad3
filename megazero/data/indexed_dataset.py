"""The Megatron-compatible `.bin/.idx` token store: writing it, memory-mapping it, validating it.

`.idx` layout (little-endian), as Megatron-LM writes it:

    offset 0   9 bytes  magic b"MMIDIDX\\x00\\x00"
    offset 9   u64      version = 1
    offset 17  u8       dtype code (see DTYPE_CODES)
    offset 18  u64      sequence count S
    offset 26  u64      document-index count D (= number of documents + 1, Megatron's convention)
    offset 34  int32[S] sequence lengths in tokens
               int64[S] byte offset of each sequence in the .bin
               int64[D] document indices: sequence number where each document starts, first 0,
                        last S (document k is sequences [doc[k], doc[k+1]))

`.bin` is the tokens of every sequence back to back, nothing else.

Beside them, `{prefix}.stats.json` caches what costs a pass over the tokens (the largest token id,
checked against the model's vocabulary before a run starts), keyed by the pair's sizes and
modification times; it is written when the pair is built, or on first use, and never changes the
Megatron-compatible files themselves.

Owns only the file format. Splits, samples and shuffling live in gpt_dataset.py.
"""

import json
import os
import threading
from pathlib import Path

import numpy as np

from megazero.core.errors import UsageError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # = 34

DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def dtype_code(dtype):
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise UsageError(
        f"token dtype {dtype} has no .idx code; use one of {sorted(np.dtype(d).name for d in DTYPE_CODES.values())}"
    )


def best_dtype(vocab_size):
    """uint16 while every id fits with room to spare (vocab < 65,500, Megatron's cut), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def data_file_paths(prefix):
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def stats_path(prefix):
    return Path(f"{prefix}.stats.json")


def _file_keys(prefix):
    """What identifies the pair's current contents: sizes and modification times."""
    keys = {}
    for path in data_file_paths(prefix):
        info = path.stat()
        keys[f"{path.suffix[1:]}_bytes"], keys[f"{path.suffix[1:]}_mtime_ns"] = info.st_size, info.st_mtime_ns
    return keys


def write_stats(prefix, max_token_id, num_tokens):
    """Records the pair's token statistics beside it; a folder that cannot be written only loses the cache."""
    record = {**_file_keys(prefix), "max_token_id": int(max_token_id), "num_tokens": int(num_tokens)}
    path = stats_path(prefix)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        if tmp.exists():
            tmp.unlink()


def read_stats(prefix):
    """The cached statistics if they describe the pair as it is now, else None."""
    try:
        record = json.loads(stats_path(prefix).read_text())
        current = _file_keys(prefix)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in current.items()):
        return None
    return record


class IndexedDatasetBuilder:
    """Streams sequences into `{prefix}.bin` and writes `{prefix}.idx` on `finalize()`.

    Both files are written under temporary names and renamed into place by `finalize()`, `.idx`
    last, so a reader never sees a half-written pair. Use as a context manager to delete the
    temporary files when an exception interrupts the build.
    """

    def __init__(self, prefix, dtype):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._bin_path, self._idx_path = data_file_paths(self.prefix)
        self._bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = self._bin_path.with_name(f"{self._bin_path.name}.tmp-{os.getpid()}")
        self._tmp_idx = self._idx_path.with_name(f"{self._idx_path.name}.tmp-{os.getpid()}")
        self._bin = open(self._tmp_bin, "wb")
        self._sizes = []
        self._document_indices = [0]
        self.num_tokens = 0
        self.max_token_id = -1

    def add_item(self, tokens):
        """Appends one sequence; ids outside the dtype's range raise instead of wrapping silently."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise UsageError(f"a sequence must be 1-D, got shape {array.shape}")
        if array.size and np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            if array.min() < info.min or array.max() > info.max:
                raise UsageError(
                    f"token ids {array.min()}..{array.max()} do not fit {self.dtype.name}; "
                    "build with best_dtype(vocab_size)"
                )
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        if array.size:
            self.max_token_id = max(self.max_token_id, int(array.max()))
        self._sizes.append(array.size)
        self.num_tokens += array.size

    def end_document(self):
        self._document_indices.append(len(self._sizes))

    def add_document(self, tokens):
        """One sequence that is a whole document (the usual case for GPT pretraining)."""
        self.add_item(tokens)
        self.end_document()

    def finalize(self):
        if self._document_indices[-1] != len(self._sizes):
            self.end_document()  # trailing items without end_document() form the last document
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            pointers[1:] = np.cumsum(sizes[:-1], dtype=np.int64) * self.dtype.itemsize
        with open(self._tmp_idx, "wb") as handle:
            handle.write(MAGIC)
            handle.write(np.uint64(VERSION).tobytes())
            handle.write(np.uint8(self._code).tobytes())
            handle.write(np.uint64(len(sizes)).tobytes())
            handle.write(np.uint64(len(self._document_indices)).tobytes())
            handle.write(sizes.tobytes())
            handle.write(pointers.tobytes())
            handle.write(np.asarray(self._document_indices, dtype=np.int64).tobytes())
        os.replace(self._tmp_bin, self._bin_path)
        os.replace(self._tmp_idx, self._idx_path)
        write_stats(self.prefix, self.max_token_id, self.num_tokens)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._bin.close()
            for tmp in (self._tmp_bin, self._tmp_idx):
                if tmp.exists():
                    tmp.unlink()
        return False


def read_index_header(idx_path):
    """Returns (dtype, sequence_count, document_index_count) after checking magic, version, code, length."""
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as handle:
        header = handle.read(HEADER_BYTES)
    # Compare only the bytes present, so a file cut inside the magic reads as truncated, not foreign.
    if header[: len(MAGIC)] != MAGIC[: len(header)]:
        raise UsageError(
            f"{idx_path} is not a megazero/Megatron .idx file (bad magic); regenerate it with tools/preprocess_data.py"
        )
    if len(header) < HEADER_BYTES:
        raise UsageError(
            f"{idx_path} is truncated ({size} bytes, header needs {HEADER_BYTES}); "
            "regenerate it with tools/preprocess_data.py"
        )
    version = int(np.frombuffer(header, np.uint64, 1, 9)[0])
    code = header[17]
    sequences = int(np.frombuffer(header, np.uint64, 1, 18)[0])
    doc_entries = int(np.frombuffer(header, np.uint64, 1, 26)[0])
    if version != VERSION:
        raise UsageError(
            f"{idx_path} has .idx version {version}, only {VERSION} is supported; "
            "regenerate it with tools/preprocess_data.py"
        )
    if code not in DTYPE_CODES:
        raise UsageError(f"{idx_path} has unknown dtype code {code}; the file is corrupt, regenerate it")
    expected = HEADER_BYTES + sequences * (4 + 8) + doc_entries * 8
    if size < expected:
        raise UsageError(
            f"{idx_path} is truncated ({size} bytes, its header needs {expected}); "
            "regenerate it with tools/preprocess_data.py"
        )
    if size > expected:
        raise UsageError(
            f"{idx_path} has {size - expected} bytes more than its header describes; the file is corrupt, regenerate it"
        )
    return np.dtype(DTYPE_CODES[code]), sequences, doc_entries


class _FileTokens:
    """The .bin's tokens read with plain file reads, one read per slice (Megatron's
    --no-mmap-bin-files: for file systems where mapping many large files misbehaves)."""

    def __init__(self, path, dtype, count: int):
        self.path, self.dtype, self.count = path, dtype, count
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115  (lives as long as the dataset)
        self._lock = threading.Lock()  # the read-ahead thread and the loop share it

    def __len__(self):
        return self.count

    def __getitem__(self, index: slice):
        start, stop, _ = index.indices(self.count)
        with self._lock:
            self._file.seek(start * self.dtype.itemsize)
            data = self._file.read(max(0, stop - start) * self.dtype.itemsize)
        return np.frombuffer(data, dtype=self.dtype)

    def max(self):
        step = 1 << 24
        return max(int(self[s : s + step].max()) for s in range(0, self.count, step))


class IndexedDataset:
    """Read-only memory map of `{prefix}.bin/.idx`, validated on open (with `mmap=False` the .bin is
    read with plain file reads instead).

    `sizes[i]` is sequence i's length, `document_indices` the sequence numbers where documents
    start (length = documents + 1), `get(i, offset, length)` a zero-copy view of sequence i.
    """

    def __init__(self, prefix, mmap: bool = True):
        self.prefix, self.mmap = str(prefix), mmap
        bin_path, idx_path = data_file_paths(self.prefix)
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise UsageError(
                    f"data file {path} not found; expected {bin_path} and {idx_path} "
                    "(pass the path prefix without extension)"
                )
            if not os.access(path, os.R_OK):
                raise UsageError(
                    f"data file {path} cannot be read (permission denied); "
                    "fix its permissions or copy it somewhere readable"
                )
        self.dtype, count, doc_entries = read_index_header(idx_path)
        index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(index, np.int32, count, HEADER_BYTES)
        self.pointers = np.frombuffer(index, np.int64, count, HEADER_BYTES + 4 * count)
        self.document_indices = np.frombuffer(index, np.int64, doc_entries, HEADER_BYTES + 12 * count)
        self._check_index(idx_path, count)
        self._tokens = self._map_bin(bin_path)

    def _check_index(self, idx_path, count):
        docs = self.document_indices
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != count or np.any(np.diff(docs) < 0):
            raise UsageError(f"{idx_path} has inconsistent document indices; the file is corrupt, regenerate it")
        if count and (
            np.any(self.sizes < 0)
            or self.pointers[0] != 0
            or np.any(np.diff(self.pointers) != self.sizes[:-1].astype(np.int64) * self.dtype.itemsize)
        ):
            raise UsageError(
                f"{idx_path} has byte pointers that disagree with its sizes; the file is corrupt, regenerate it"
            )

    def _map_bin(self, bin_path):
        count = len(self.sizes)
        expected = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if count else 0
        actual = bin_path.stat().st_size
        if actual != expected:
            raise UsageError(
                f"{bin_path} has {actual} bytes but its .idx describes {expected}; "
                "the pair is out of sync, regenerate both with tools/preprocess_data.py"
            )
        if expected == 0:
            return np.empty(0, dtype=self.dtype)  # numpy cannot memory-map an empty file
        if not self.mmap:
            return _FileTokens(bin_path, self.dtype, expected // self.dtype.itemsize)
        return np.memmap(bin_path, mode="r", dtype=self.dtype)

    @property
    def max_token_id(self):
        """The largest token id in the `.bin` (-1 when empty), from the stats cache or one pass."""
        if not np.issubdtype(self.dtype, np.integer):
            raise UsageError(
                f"{self.prefix}.idx says its tokens are {self.dtype.name}, not integer ids; "
                "regenerate the pair with tools/preprocess_data.py"
            )
        stats = read_stats(self.prefix)
        if stats is None:
            largest = int(self._tokens.max()) if len(self._tokens) else -1
            write_stats(self.prefix, largest, len(self._tokens))
            return largest
        return int(stats["max_token_id"])

    def __getstate__(self):
        # Pickle (e.g. to spawned DataLoader workers) as the prefix; the receiver maps the files
        # itself instead of receiving a copy of every token.
        return self.prefix, self.mmap

    def __setstate__(self, state):
        self.__init__(*state)

    def __len__(self):
        return len(self.sizes)

    @property
    def num_documents(self):
        return len(self.document_indices) - 1

    @property
    def num_tokens(self):
        return len(self._tokens)

    def get(self, idx, offset=0, length=None):
        """Tokens [offset, offset + length) of sequence `idx` as a read-only view."""
        if not 0 <= idx < len(self.sizes):
            raise IndexError(f"sequence {idx} out of range for {len(self.sizes)} sequences")
        size = int(self.sizes[idx])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} of length {size}")
        start = int(self.pointers[idx]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]

    def __getitem__(self, idx):
        return self.get(idx)
