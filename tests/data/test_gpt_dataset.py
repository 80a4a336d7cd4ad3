"""megazero/data/gpt_dataset.py: megatron-core's split rule, the golden sample index, samples across
document boundaries, document ranges, and the index cache reused."""

import numpy as np
import pytest

from megazero.core.errors import UsageError
from megazero.data.gpt_dataset import GPTDataset, parse_split, split_document_ranges
from megazero.data.indexed_dataset import IndexedDataset
from tests.data.tiny_data import write_dataset


def test_parse_split_and_megatron_split_rule():
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    for bad in ["a,b", "1,2,3,4", "0,0,0", "-1,2", ""]:
        with pytest.raises(UsageError, match="split"):
            parse_split(bad)
    # Worked by hand, megatron-core's rule: running sums of the fractions, each bound round(sum * N).
    assert split_document_ranges(parse_split("949,50,1"), 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_document_ranges([1 / 3] * 3, 10) == [(0, 3), (3, 7), (7, 10)]  # 3.33, 6.67
    assert split_document_ranges(parse_split("949,50,1"), 3) == [(0, 3), (3, 3), (3, 3)]
    # round(2.5) == 2 (half to even)
    assert split_document_ranges(parse_split("1,1"), 5) == [(0, 2), (2, 5), (5, 5)]


def test_golden_sample_index_single_document(tmp_path):
    # One 5-token document, seq_length 3, 4 samples: 13 tokens needed -> 3 epochs.
    # Stream: 10 11 12 13 14 | 10 11 12 13 14 | 10 11 12 13 14
    # Sample i starts at stream token 3i: 0, 3, 6, 9 and the end marker 12.
    indexed = IndexedDataset(write_dataset(tmp_path / "g", [[10, 11, 12, 13, 14]]))
    ds = GPTDataset(indexed, "train", (0, 1), num_samples=4, seq_length=3, seed=7)
    assert ds.doc_idx.tolist() == [0, 0, 0]
    assert ds.sample_idx.tolist() == [[0, 0], [0, 3], [1, 1], [1, 4], [2, 2]]
    expected = [[10, 11, 12, 13], [13, 14, 10, 11], [11, 12, 13, 14], [14, 10, 11, 12]]
    assert [ds.sample_tokens(j).tolist() for j in range(4)] == expected
    assert sorted(ds[i]["tokens"].tolist() for i in range(4)) == sorted(expected)
    assert sorted(ds.shuffle_idx.tolist()) == [0, 1, 2, 3]
    assert ds[0]["tokens"].dtype == np.int64
    with pytest.raises(IndexError):
        ds[4]


def test_samples_cross_document_boundaries_and_skip_empty_documents(tmp_path):
    docs = [[1, 2], [3, 4, 5, 6, 7], [], [8], [9, 10, 11]]
    indexed = IndexedDataset(write_dataset(tmp_path / "x", docs))
    ds = GPTDataset(indexed, "train", (0, 5), num_samples=6, seq_length=4, seed=3)
    # 6 * 4 + 1 = 25 tokens from 11-token epochs: 3 epochs shuffled as one (megatron-core's rule: the
    # last epoch's 1 sample is not below 80% of an epoch's 2), holding (33 - 1) // 4 = 8 samples.
    assert sorted(ds.doc_idx.tolist()) == sorted([0, 1, 2, 3, 4] * 3)
    assert len(ds) == 8 and sorted(ds.shuffle_idx.tolist()) == list(range(8))
    # The stream written out independently: documents in doc_idx order, back to back.
    stream = [t for d in ds.doc_idx for t in docs[d]]
    for j in range(8):
        assert ds.sample_tokens(j).tolist() == stream[4 * j : 4 * j + 5]
    for position, offset in ds.sample_idx.tolist():  # never points into the empty document
        assert offset < len(docs[ds.doc_idx[position]])
    owners = [{next(i for i, d in enumerate(docs) if t in d) for t in ds.sample_tokens(j).tolist()} for j in range(8)]
    assert max(len(o) for o in owners) >= 3  # some 5-token sample spans three documents


def test_document_range_restricts_tokens(tmp_path):
    docs = [[1, 1, 1], [2, 2], [3, 3, 3, 3], [4]]
    indexed = IndexedDataset(write_dataset(tmp_path / "r", docs))
    ds = GPTDataset(indexed, "valid", (1, 3), num_samples=5, seq_length=2, seed=0)
    seen = {t for i in range(5) for t in ds[i]["tokens"].tolist()}
    assert seen == {2, 3}


def test_index_cache_is_reused(tmp_path):
    indexed = IndexedDataset(write_dataset(tmp_path / "k", [[1, 2, 3], [4, 5, 6, 7]]))
    first = GPTDataset(indexed, "train", (0, 2), num_samples=9, seq_length=3, seed=1)
    assert first.built_indices and all(p.parent == tmp_path for p in first.cache_paths.values())
    mtimes = {p: p.stat().st_mtime_ns for p in first.cache_paths.values()}
    second = GPTDataset(indexed, "train", (0, 2), num_samples=9, seq_length=3, seed=1)
    assert not second.built_indices
    assert {p: p.stat().st_mtime_ns for p in second.cache_paths.values()} == mtimes
    assert [second[i]["tokens"].tolist() for i in range(9)] == [first[i]["tokens"].tolist() for i in range(9)]
    other = GPTDataset(indexed, "train", (0, 2), num_samples=9, seq_length=3, seed=2)
    assert other.built_indices and set(other.cache_paths.values()).isdisjoint(mtimes)
    elsewhere = GPTDataset(indexed, "train", (0, 2), 9, 3, 1, cache_dir=tmp_path / "cache")
    assert elsewhere.built_indices and (tmp_path / "cache").is_dir()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "out-of-range", "wrong-shape"])
def test_a_damaged_index_cache_is_named_and_rebuilt(tmp_path, capsys, damage):
    """A cached index cut short (a killed copy), overwritten with garbage, holding an index past the
    data, or of another shape: one line naming the file, then the same samples as a fresh build.
    (Planted: np.load without the checks, as before, fails every case in a traceback: ValueError,
    UnpicklingError-like ValueError, IndexError at a sample; the wrong shape reads other samples.)"""
    indexed = IndexedDataset(write_dataset(tmp_path / "k", [[1, 2, 3], [4, 5, 6, 7], [8, 9]]))
    fresh = GPTDataset(indexed, "train", (0, 3), num_samples=9, seq_length=3, seed=1)
    expected = [fresh[i]["tokens"].tolist() for i in range(9)]
    name = {
        "truncated": "doc_idx",
        "garbage": "shuffle_idx",
        "out-of-range": "sample_idx",
        "wrong-shape": "sample_idx",
    }[damage]
    path = fresh.cache_paths[name]
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-9])
    elif damage == "garbage":
        path.write_bytes(b"\x93NUMPY\x01\x00garbage" * 5)
    else:
        rows = np.load(path)
        rows = rows[:-1] if damage == "wrong-shape" else rows + [0, 100]
        np.save(path, rows)
    capsys.readouterr()
    again = GPTDataset(indexed, "train", (0, 3), num_samples=9, seq_length=3, seed=1)
    [line] = [x for x in capsys.readouterr().err.splitlines() if "damaged" in x]  # beside the progress line
    assert line.startswith(f"megazero: the train sample index {path} is damaged"), line
    assert again.built_indices and [again[i]["tokens"].tolist() for i in range(9)] == expected
    assert not GPTDataset(indexed, "train", (0, 3), num_samples=9, seq_length=3, seed=1).built_indices
