"""megazero/data/builders.py: --data-path parsed (weights and prefixes), train/valid/test datasets
built from one prefix and from a blend."""

import pytest

from megazero.core.errors import UsageError
from megazero.data.builders import build_train_valid_test_datasets, parse_data_path
from tests.data.tiny_data import write_dataset


def test_parse_data_path(tmp_path):
    a = write_dataset(tmp_path / "a", [[1, 2]])
    b = write_dataset(tmp_path / "b", [[3]])
    assert parse_data_path([a]) == [(1.0, a)]
    assert parse_data_path(["0.7", a, "0.3", b]) == [(0.7, a), (0.3, b)]
    assert parse_data_path(f"2 {a} 1 {b}") == [(2.0, a), (1.0, b)]
    with pytest.raises(UsageError, match="pairs"):
        parse_data_path(["0.7", a, "0.3"])
    with pytest.raises(UsageError, match="'x' .* not a number"):
        parse_data_path(["x", a, "0.3", b])
    with pytest.raises(UsageError, match="weight -1 .* non-negative"):
        parse_data_path(["-1", a, "0.3", b])
    with pytest.raises(UsageError, match="all 0"):
        parse_data_path(["0", a, "0", b])
    missing = str(tmp_path / "nope")
    with pytest.raises(UsageError) as info:
        parse_data_path([missing])
    assert (
        f"'{missing}'" in str(info.value)
        and f"{missing}.bin" in str(info.value)
        and f"{missing}.idx" in str(info.value)
    )
    with pytest.raises(UsageError, match="without extension"):
        parse_data_path([a + ".bin"])
    # What the user probably meant: preprocess_data's suffix, or a pair inside a folder.
    write_dataset(tmp_path / "c_text_document", [[4]])
    with pytest.raises(UsageError, match=f"did you mean {tmp_path / 'c_text_document'}"):
        parse_data_path([str(tmp_path / "c")])
    with pytest.raises(UsageError, match=f"is a directory.*holds {tmp_path / 'a'}"):
        parse_data_path([str(tmp_path)])


def test_build_train_valid_test_single_and_blended(tmp_path):
    low = write_dataset(tmp_path / "low", [[i % 50 + 1] * 7 for i in range(20)])
    high = write_dataset(tmp_path / "high", [[100 + i] * 5 for i in range(20)])
    train, valid, test = build_train_valid_test_datasets([low], "8,2,0", 4, 1234, (30, 6, 5), progress=False)
    # Every whole sample of the epochs the request needs, as megatron-core: 30 * 4 + 1 tokens of 112-token epochs
    assert test is None and len(train) == (2 * 112 - 1) // 4 and len(valid) >= 6
    assert {t for i in range(6) for t in valid[i]["tokens"].tolist()} <= set(range(17, 21))  # docs 16..19
    train, valid, test = build_train_valid_test_datasets(
        ["3", low, "1", high], "8,1,1", 4, 1234, (40, 8, 0), progress=False
    )
    assert test is None and len(train) == 30 + 10 and len(valid) == 6 + 2  # sum of ceil(n * weight)
    from_high = [bool(train[i]["tokens"][0] >= 100) for i in range(40)]
    assert sum(from_high) == 10  # 1/4 of 40, exactly, by the greedy blend
    with pytest.raises(UsageError, match="0 of the 20 sequences"):
        build_train_valid_test_datasets([low], "1000,1,0", 4, 1, (10, 10, 0), progress=False)
