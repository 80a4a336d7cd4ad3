"""megazero/data/hf_files.py: Hugging Face `datasets` files on disk (Parquet, Arrow stream and file,
a save_to_disk folder) read as the same documents as JSON lines, through
megazero.data.corpus.iter_documents; a wrong column, and raw text or object storage given to
--data-path, each get one line. (Planted: the Arrow reader without its streaming-format fallback
fails the stream case; parse_data_path without the raw-text check fails the tokenise-first case.)"""

import json

import pytest

from megazero.core.errors import UsageError
from megazero.data.builders import parse_data_path
from megazero.data.corpus import iter_documents

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install -e '.[hf-data]')")
import pyarrow.ipc  # noqa: E402
import pyarrow.parquet  # noqa: E402

TEXTS = ["def a():\n    return 1\n", "x = 'é'\n", "", "class B:\n    pass\n"]


def _table():
    return pa.table({"id": list(range(len(TEXTS))), "text": TEXTS})


def test_parquet_arrow_and_saved_folder_read_as_jsonl(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    pyarrow.parquet.write_table(_table(), tmp_path / "d.parquet", row_group_size=2)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink, pyarrow.ipc.new_stream(sink, _table().schema) as w:
        for batch in _table().to_batches(max_chunksize=3):  # as `datasets` writes its cache files
            w.write_batch(batch)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pyarrow.ipc.new_file(sink, _table().schema) as w:
        w.write_table(_table())
    saved = tmp_path / "saved"
    saved.mkdir()
    halves = [_table().slice(0, 2), _table().slice(2)]
    for k, half in enumerate(halves):
        with (
            pa.OSFile(str(saved / f"data-0000{k}-of-00002.arrow"), "wb") as sink,
            pyarrow.ipc.new_stream(sink, half.schema) as w,
        ):
            w.write_table(half)
    (saved / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": f"data-0000{k}-of-00002.arrow"} for k in range(2)]})
    )
    expected = list(iter_documents([jsonl]))
    assert [d["text"] for d in expected] == TEXTS
    for source in ("d.parquet", "stream.arrow", "file.arrow", "saved"):
        assert list(iter_documents([tmp_path / source])) == expected, source
    with pytest.raises(UsageError, match="has no column 'body' .*name the text column with --json-keys"):
        list(iter_documents([tmp_path / "d.parquet"], keys=("body",)))
    with pytest.raises(UsageError, match="row of column 'id' is int, not text"):
        list(iter_documents([tmp_path / "stream.arrow"], keys=("id",)))


def test_raw_text_or_object_storage_as_data_path_is_one_line(tmp_path):
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text('{"text": "a"}\n')
    with pytest.raises(
        UsageError,
        match=r"--data-path .*corpus.jsonl is raw text, not a .bin/.idx prefix; "
        r"tokenise it first: python tools/preprocess_data.py --input ",
    ):
        parse_data_path([str(jsonl)])
    pyarrow.parquet.write_table(_table(), tmp_path / "d.parquet")
    with pytest.raises(UsageError, match=r"--train-data-path .*d.parquet is raw text.*--json-keys text"):
        parse_data_path(["1", str(tmp_path / "d.parquet")], "--train-data-path")
    with pytest.raises(UsageError, match="local files only"):
        parse_data_path(["s3://bucket/corpus_text_document"])
