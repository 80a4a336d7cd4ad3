"""Hugging Face `datasets` files already on disk, read as documents: Parquet files, Arrow files (the
IPC stream `datasets` writes, or the IPC file format), a `save_to_disk` folder (its `state.json`
lists the Arrow files in order), and JSON lines. Each row's text column is one document.

Also what a raw-text path given where tokens are expected gets: the one line naming the tokenising
step (`tokenise_first`). Local files only: nothing here reaches the hub.

Parquet and Arrow are read through pyarrow (`pip install -e '.[hf-data]'`), one record batch at a
time, the text column only; JSON lines need nothing. Owns reading these files; tokenising them is
tools/preprocess_data.py's (through megazero.data.corpus.iter_documents).
"""

from __future__ import annotations

import json
from pathlib import Path

from megazero.core.errors import UsageError

TABLE_SUFFIXES = (".parquet", ".arrow")
RAW_SUFFIXES = TABLE_SUFFIXES + (".jsonl", ".json", ".txt")


def is_saved_dataset(path) -> bool:
    """A `datasets` save_to_disk folder (one split): state.json beside its .arrow files."""
    return Path(path).is_dir() and (Path(path) / "state.json").is_file()


def is_table(path) -> bool:
    return str(path).endswith(TABLE_SUFFIXES) or is_saved_dataset(path)


def is_raw_text_data(path) -> bool:
    """Text that needs tokenising (a file of documents or a saved dataset), not a .bin/.idx prefix."""
    return (str(path).endswith(RAW_SUFFIXES) and Path(path).is_file()) or is_saved_dataset(path)


def tokenise_first(path, flag: str = "--data-path") -> UsageError:
    """The line for raw text given where a .bin/.idx prefix belongs."""
    stem = Path(path).with_suffix("") if Path(path).is_file() else Path(path)
    keys = "" if str(path).endswith(".txt") else " --json-keys text"
    return UsageError(
        f"{flag} {path} is raw text, not a .bin/.idx prefix; tokenise it first: python "
        f"tools/preprocess_data.py --input {path}{keys} --output-prefix {stem} --append-eod "
        f"with this run's tokenizer flags, then {flag} {stem}_text_document"
    )


def _pyarrow(path):
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise UsageError(
            f"{path}: reading Parquet and Arrow files needs pyarrow; pip install -e '.[hf-data]' (or give JSON lines)"
        ) from None
    return pyarrow


def _arrow_files(folder: Path) -> list[Path]:
    state = json.loads((folder / "state.json").read_text())
    files = [folder / entry["filename"] for entry in state.get("_data_files", [])]
    if not files:
        raise UsageError(f"{folder}/state.json lists no data files; give the folder save_to_disk wrote")
    return files


def _batches(path: Path, column: str):
    """Record batches of `path` holding `column` (the whole file's other columns are never read)."""
    pa = _pyarrow(path)
    if str(path).endswith(".parquet"):
        reader = pa.parquet.ParquetFile(path)
        names = reader.schema_arrow.names
        _check_column(path, column, names)
        yield from reader.iter_batches(columns=[column], batch_size=1024)
        return
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # `datasets` writes the streaming format
            source.seek(0)
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        _check_column(path, column, reader.schema.names)
        for batch in batches:
            yield batch.select([column])


def _check_column(path, column, names):
    if column not in names:
        raise UsageError(
            f"{path} has no column '{column}' (it has {', '.join(names)}); name the text column with --json-keys"
        )


def iter_table_records(path, keys=("text",)):
    """Yields `{key: row[key]}` for every row of a Parquet / Arrow file or saved dataset folder."""
    if len(keys) != 1:
        raise UsageError(f"{path}: give one --json-keys column for Parquet and Arrow input ({len(keys)} given)")
    key = keys[0]
    files = _arrow_files(Path(path)) if is_saved_dataset(path) else [Path(path)]
    for file in files:
        if not file.is_file():
            raise UsageError(f"{file} not found; the dataset folder {path} is incomplete")
        for batch in _batches(file, key):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise UsageError(
                        f"{file}: row of column '{key}' is {type(text).__name__}, not text; "
                        f"name the text column with --json-keys"
                    )
                yield {key: text}
