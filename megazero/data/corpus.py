"""Where documents come from: the embedded default corpus and the readers for user corpora.

Owns:
- the cache directory rule (`$MEGAZERO_CACHE`, else `~/.cache/megazero`);
- collecting the Python standard library's own `.py` sources (tests and site-packages left out)
  into a JSONL file, one `{"text": ..., "path": ...}` object per source file, sorted by path so
  two runs on the same Python produce the same bytes;
- reading documents back from JSONL (one object per line) or plain text (one document per file);
- `Progress`, the rate-limited stderr progress line every long data step prints.

It knows nothing about tokenizers or the `.bin/.idx` format.
"""

import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

from megazero.core.errors import UsageError

# Directory names that hold the standard library's own test suites, not library code.
EXCLUDED_DIR_NAMES = frozenset({"test", "tests", "idle_test", "site-packages"})


class Progress:
    """Prints `label: done/total (pct%) extra` to stderr at most every `every_s` seconds.

    Long steps call `update` as often as they like; the rate limit keeps logs short, and
    `finish` always prints one closing line so the reader sees the step ended.
    """

    def __init__(self, label, total=None, enabled=True, every_s=2.0):
        self.label = label
        self.total = total
        self.enabled = enabled
        self.every_s = every_s
        self.start = time.monotonic()
        self._last_print = self.start

    def begin(self):
        """One line saying the step started; for steps that cannot report along the way."""
        if self.enabled:
            print(f"{self.label} ...", file=sys.stderr, flush=True)

    def elapsed(self):
        return time.monotonic() - self.start

    def update(self, done, extra=""):
        now = time.monotonic()
        if now - self._last_print >= self.every_s:
            self._last_print = now
            self._print(done, extra)

    def finish(self, done, extra=""):
        self._print(done, f"{extra} done in {self.elapsed():.1f}s".strip())

    def _print(self, done, extra):
        if not self.enabled:
            return
        if self.total:
            text = f"{self.label}: {done}/{self.total} ({100.0 * done / self.total:.0f}%)"
        else:
            text = f"{self.label}: {done}"
        print(f"{text} {extra}".rstrip(), file=sys.stderr, flush=True)


def default_cache_dir():
    """The root of every megazero cache: `$MEGAZERO_CACHE` if set, else `~/.cache/megazero`."""
    env = os.environ.get("MEGAZERO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "megazero"


def is_library_source(relative_path):
    """True for a stdlib `.py` file that is library code (not a test, not site-packages)."""
    parts = Path(relative_path).parts
    if not parts or not parts[-1].endswith(".py") or parts[-1].startswith("test_"):
        return False
    return not any(part in EXCLUDED_DIR_NAMES for part in parts[:-1])


def stdlib_source_files(stdlib_dir=None):
    """Sorted relative paths (with `/` separators) of the stdlib's library `.py` files."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise UsageError(f"standard library directory {root} not found; pass stdlib_dir explicitly")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune excluded trees so we never walk into site-packages (it can be huge).
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIR_NAMES]
        for name in filenames:
            relative = Path(dirpath, name).relative_to(root).as_posix()
            if is_library_source(relative):
                found.append(relative)
    return sorted(found)


def write_atomically(path, write_fn, mode="w"):
    """Calls `write_fn(file)` on a temporary file beside `path`, then renames it into place.

    A crash mid-write leaves only a stray `.tmp-<pid>` file, never a half-written `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        handle = open(tmp, mode) if "b" in mode else open(tmp, mode, encoding="utf-8")
        with handle:
            write_fn(handle)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


CORPUS_ORDER_SEED = 20261130


def collect_stdlib_corpus(output_path, stdlib_dir=None, progress=True):
    """Writes the stdlib corpus JSONL to `output_path` (skipped if it exists); returns the path.

    Files that are not valid UTF-8 are left out (the count is printed): the tokenizer only sees
    text, and guessing an encoding would make the corpus depend on the guess.
    """
    output_path = Path(output_path)
    if output_path.exists():
        return output_path
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    # A fixed-seed shuffle of the sorted list: still deterministic, but the train/valid/test split
    # (contiguous document ranges, as Megatron's) then samples modules from the whole library
    # instead of giving validation only the alphabetically last packages.
    relative_paths = stdlib_source_files(root)
    random.Random(CORPUS_ORDER_SEED).shuffle(relative_paths)
    meter = Progress("collecting corpus", total=len(relative_paths), enabled=progress)
    skipped = []

    def write(handle):
        for count, relative in enumerate(relative_paths, start=1):
            try:
                text = (root / relative).read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                skipped.append(relative)
                continue
            handle.write(json.dumps({"text": text, "path": relative}) + "\n")
            meter.update(count, "files")

    write_atomically(output_path, write)
    meter.finish(len(relative_paths), f"files ({len(skipped)} not UTF-8, skipped)")
    return output_path


def not_utf8(path) -> UsageError:
    """The one-line refusal of a file whose bytes are not UTF-8, naming the first bad byte's line
    (read again in binary: the text reader decodes ahead of the lines it has returned)."""
    with open(path, "rb") as raw:
        for line_number, line in enumerate(raw, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                return UsageError(
                    f"{path}:{line_number}: not UTF-8 text (byte 0x{line[err.start]:02x} at column "
                    f"{err.start + 1}); convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) "
                    f"or leave it out of --input"
                )
    return UsageError(f"{path}: not UTF-8 text; convert the file to UTF-8 or leave it out of --input")


def utf8_lines(path, newline=None):
    """The lines of the text file `path` (numbered from 1); a byte that is not UTF-8 raises `not_utf8`."""
    with open(path, encoding="utf-8", newline=newline) as handle:
        try:
            yield from enumerate(handle, start=1)
        except UnicodeDecodeError:
            raise not_utf8(path) from None


def iter_jsonl_records(path, keys=("text",)):
    """Yields `{key: obj[key]}` for each line of a JSONL file; bad lines raise UsageError naming the line."""
    for line_number, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"{path}:{line_number}: not valid JSON ({exc.msg}); expected one JSON object per line"
            ) from None
        for key in keys:
            if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
                raise UsageError(
                    f"{path}:{line_number}: no string field '{key}'; pick the field with --json-key/--json-keys"
                )
        yield {key: obj[key] for key in keys}


def iter_jsonl_texts(path, key="text"):
    """Yields `obj[key]` for each line of a JSONL file."""
    for record in iter_jsonl_records(path, (key,)):
        yield record[key]


def is_jsonl(path):
    return str(path).endswith((".jsonl", ".json"))


def iter_documents(paths, keys=("text",)):
    """Yields `{key: text}` documents from several files: JSONL (`.jsonl`/`.json`), Hugging Face
    `datasets` Parquet / Arrow files and save_to_disk folders (megazero.data.hf_files), or plain text.

    A plain text file is ONE document, read whole: our corpora are source code, where blank
    lines are part of the text and cannot serve as document separators. Put many documents in
    one file with JSONL instead. Plain text has a single field, so it takes a single key.
    """
    from megazero.data.hf_files import is_saved_dataset, is_table, iter_table_records

    for path in paths:
        if not Path(path).is_file() and not is_saved_dataset(path):
            raise UsageError(f"input file {path} not found; check the --input path")
        if is_table(path):
            yield from iter_table_records(path, keys)
        elif is_jsonl(path):
            yield from iter_jsonl_records(path, keys)
        elif len(keys) == 1:
            # newline="": keep "\r\n" as written; the tokens must reproduce the file exactly.
            yield {keys[0]: "".join(line for _, line in utf8_lines(path, newline=""))}
        else:
            raise UsageError(
                f"{path} is plain text but {len(keys)} --json-keys were given; use JSONL input for several fields"
            )
