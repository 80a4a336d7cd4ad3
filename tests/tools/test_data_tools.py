"""tools/preprocess_data.py and tools/train_tokenizer.py as processes: workers give identical
files, usage errors are one line without a traceback, training is reproducible across processes."""

import subprocess
import sys
from pathlib import Path

import pytest

from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.tokenizer import load_tokenizer
from tests.data.tiny_data import ROUND_TRIP_TEXT, tiny_tokenizer  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[2]


def run_tool(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_preprocess_cli_workers_give_identical_files(tmp_path, tiny_tokenizer):
    model, corpus = tiny_tokenizer
    code_file = tmp_path / "module.txt"
    code_file.write_text(ROUND_TRIP_TEXT)
    outputs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        result = run_tool(
            "tools/preprocess_data.py",
            "--input",
            str(corpus),
            str(code_file),
            "--output-prefix",
            str(prefix),
            "--tokenizer-model",
            model,
            "--append-eod",
            "--workers",
            str(workers),
            "--chunksize",
            "2",
        )
        assert result.returncode == 0, result.stderr
        assert "docs/s" in result.stderr and "MB/s" in result.stderr
        outputs.append([Path(f"{prefix}_text_document{ext}").read_bytes() for ext in (".bin", ".idx")])
    assert outputs[0] == outputs[1]
    data, tok = IndexedDataset(tmp_path / "w2_text_document"), load_tokenizer(model)
    assert data.num_documents == 6 and tok.decode(data.get(5)[:-1].tolist()) == ROUND_TRIP_TEXT


def test_tools_report_usage_errors_without_traceback(tmp_path, tiny_tokenizer):
    result = run_tool(
        "tools/preprocess_data.py",
        "--input",
        str(tiny_tokenizer[1]),
        "--output-prefix",
        str(tmp_path / "o"),
        "--tokenizer-model",
        str(tmp_path / "missing.model"),
        "--workers",
        "2",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "missing.model" in result.stderr and not list(tmp_path.iterdir())
    result = run_tool(
        "tools/train_tokenizer.py",
        "--input",
        str(tmp_path / "nope.txt"),
        "--model-prefix",
        str(tmp_path / "t"),
        "--vocab-size",
        "300",
    )
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def test_train_tokenizer_cli_is_reproducible_across_processes(tmp_path, tiny_tokenizer):
    models = []
    for run in range(2):
        result = run_tool(
            "tools/train_tokenizer.py",
            "--input",
            str(tiny_tokenizer[1]),
            "--vocab-size",
            "400",
            "--model-prefix",
            str(tmp_path / f"run{run}"),
            "--input-sentence-size",
            "200",
        )
        assert result.returncode == 0, result.stderr
        models.append((tmp_path / f"run{run}.model").read_bytes())
    assert models[0] == models[1]  # sampled lines and training are seeded, so ranks agree


def _tool(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_input_that_is_not_utf8_ends_in_one_line_naming_file_and_line(tmp_path, capsys):
    """Latin-1 bytes in JSONL and in plain text, for both tools (in-process): one line naming the file,
    the line and the fix. (Planted: reading with open(encoding="utf-8") unguarded, as before, fails
    every case with a UnicodeDecodeError traceback.)"""
    jsonl, text = tmp_path / "bad.jsonl", tmp_path / "bad.txt"
    jsonl.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    text.write_bytes(b"hello\n" * 3000 + b"w\xffrld\n")  # past the reader's first decoded chunk
    runs = [
        (
            "preprocess_data",
            [
                f,
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "300",
                "--workers",
                "2",
            ],
        )
        for f in (str(jsonl), str(text))
    ]
    runs += [
        ("train_tokenizer", [f, "--model-prefix", str(tmp_path / "t"), "--vocab-size", "300", "--tokenizer-type", kind])
        for f, kind in ((str(text), "SentencePieceTokenizer"), (str(jsonl), "GPT2BPETokenizer"))
    ]
    for name, (path, *rest) in runs:
        with pytest.raises(SystemExit) as ended:
            _tool(name).main(["--input", path, *rest])
        err = capsys.readouterr().err
        assert ended.value.code == 2, err
        lines = [x for x in err.splitlines() if x.startswith("error: ")]  # after any progress line
        assert len(lines) == 1 and "Traceback" not in err, (name, err)
        line = lines[0]
        where = f"{jsonl}:2:" if path == str(jsonl) else f"{text}:3001:"
        assert line.startswith(f"error: {where} not UTF-8 text (byte 0x") and "convert the file to UTF-8" in line, line
