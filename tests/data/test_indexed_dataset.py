"""megazero/data/indexed_dataset.py: the .bin/.idx bytes as docs/design's format says, the token
dtype and its range check, the largest token id cached beside the index, and damaged files named."""

import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from megazero.core.errors import UsageError
from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype
from tests.data.tiny_data import write_dataset


@pytest.mark.parametrize("dtype, code", [(np.uint16, 8), (np.int32, 4)])
def test_bin_idx_bytes_match_design(tmp_path, dtype, code):
    with IndexedDatasetBuilder(tmp_path / "d", dtype) as builder:
        builder.add_document([1, 2, 3])
        builder.add_document([4, 5])
        builder.add_item([6])  # a document of two sequences
        builder.add_item([7, 8, 9, 10])
        builder.end_document()
        builder.finalize()
    raw = (tmp_path / "d.idx").read_bytes()
    itemsize = np.dtype(dtype).itemsize
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == code
    assert struct.unpack("<QQ", raw[18:34]) == (4, 4)  # 4 sequences, 3 documents + 1
    assert struct.unpack("<4i", raw[34:50]) == (3, 2, 1, 4)
    assert struct.unpack("<4q", raw[50:82]) == (0, 3 * itemsize, 5 * itemsize, 6 * itemsize)
    assert struct.unpack("<4q", raw[82:114]) == (0, 1, 2, 4)
    assert len(raw) == 114
    assert (tmp_path / "d.bin").read_bytes() == np.arange(1, 11, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()

    data = IndexedDataset(tmp_path / "d")
    assert len(data) == 4 and data.num_documents == 3 and data.dtype == np.dtype(dtype)
    assert list(data.sizes) == [3, 2, 1, 4] and list(data.document_indices) == [0, 1, 2, 4]
    assert list(data.get(3)) == [7, 8, 9, 10] and list(data.get(0, offset=1, length=2)) == [2, 3]
    assert list(data[1]) == [4, 5]
    assert list(pickle.loads(pickle.dumps(data)).get(3)) == [7, 8, 9, 10]
    with pytest.raises(IndexError):
        data.get(0, offset=2, length=2)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_best_dtype_and_range_check(tmp_path):
    assert best_dtype(8192) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(100_000) == np.int32
    with pytest.raises(UsageError, match="uint16"):
        with IndexedDatasetBuilder(tmp_path / "big", np.uint16) as builder:
            builder.add_document([70_000])
    assert not list(tmp_path.iterdir())  # temporary files removed


def _corrupt(tmp_path, edit):
    prefix = write_dataset(tmp_path / "c", [[1, 2, 3], [4, 5]])
    edit(Path(prefix + ".idx"), Path(prefix + ".bin"))
    return prefix


def test_largest_token_id_cached_beside_the_index(tmp_path):
    prefix = write_dataset(tmp_path / "s", [[1, 2, 3], [700, 5]])
    stats_file = Path(prefix + ".stats.json")
    assert json.loads(stats_file.read_text())["max_token_id"] == 700  # written with the pair
    assert IndexedDataset(prefix).max_token_id == 700
    stats_file.unlink()  # a pair made elsewhere: one pass, then cached
    assert IndexedDataset(prefix).max_token_id == 700 and stats_file.is_file()
    bin_path = Path(prefix + ".bin")
    tokens = np.fromfile(bin_path, np.uint16)
    tokens[0] = 900
    tokens.tofile(bin_path)  # same size, new contents: the cache must not answer
    info = bin_path.stat()
    os.utime(bin_path, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000))
    assert IndexedDataset(prefix).max_token_id == 900


@pytest.mark.parametrize(
    "edit, needle, which",
    [
        (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-8]), "truncated", ".idx"),
        (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]), "truncated", ".idx"),
        (lambda idx, bin_: idx.write_bytes(b"NOTMEGA!!" + idx.read_bytes()[9:]), "magic", ".idx"),
        (lambda idx, bin_: idx.write_bytes(b"PK\x03\x04"), "magic", ".idx"),
        (
            lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:9] + struct.pack("<Q", 2) + idx.read_bytes()[17:]),
            "version 2",
            ".idx",
        ),
        (
            lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:17] + b"\x09" + idx.read_bytes()[18:]),
            "dtype code 9",
            ".idx",
        ),
        (lambda idx, bin_: bin_.unlink(), "not found", ".bin"),
        (lambda idx, bin_: idx.unlink(), "not found", ".idx"),
        (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]), "bytes but", ".bin"),
    ],
)
def test_bad_files_raise_usage_error_naming_the_file(tmp_path, edit, needle, which):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(UsageError, match=needle) as info:
        IndexedDataset(prefix)
    assert prefix + which in str(info.value) and "\n" not in str(info.value)
