"""wandb and TensorBoard monitors and tools/plot_metrics.py: one tiny in-process run with both monitors
(wandb offline) whose wandb history and event file must hold the losses of its metrics.jsonl; two runs
plotted into a PNG; a monitor asked for without its package is one line naming the extra."""

import contextlib
import io
import json
import struct
import sys
from pathlib import Path

import pytest

from megazero.run import launch
from tests.metrics_reading import metrics_records

REPO = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "64", "--log-interval", "1"]


def _import_repo_module(name: str):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / "tools"))


def _main(argv, capsys):
    code = launch.main(argv)
    return code, capsys.readouterr()


@pytest.fixture(scope="module")
def monitored_run(tmp_path_factory):
    """3 iterations, evaluated at 2 and 3, logged to metrics.jsonl, an offline wandb run and TensorBoard."""
    root = tmp_path_factory.mktemp("monitored")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing under ~
            mp.setenv(var, str(root / "wandb-home"))
        with contextlib.redirect_stdout(out):
            code = launch.main(
                TINY
                + [
                    "--train-iters",
                    "3",
                    "--eval-interval",
                    "2",
                    "--eval-iters",
                    "1",
                    "--run-dir",
                    "run",
                    "--wandb-project",
                    "mz-test",
                    "--wandb-exp-name",
                    "tiny",
                    "--tensorboard-dir",
                    "tb",
                ]
            )
    assert code == 0, out.getvalue()
    records = metrics_records(root / "run" / "metrics.jsonl")
    return root, records, out.getvalue()


def _losses(records, split):
    return {r["iteration"]: r["loss"] for r in records if r["split"] == split}


def _wandb_log_records(path: Path) -> list[bytes]:
    """The records of a .wandb file: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB
    blocks of chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a wandb transaction log"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too small for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def _finished_wandb_records(run_dir: Path, timeout: float = 300.0) -> list:
    """The records of the run's transaction log once it holds the run's `exit` record. wandb's
    service process writes the log; run.finish() can return before the last records reach the
    file (seen on a loaded machine: an empty history), so wait for the record that ends a run."""
    import time
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout
    while True:
        records = []
        try:
            (log,) = run_dir.glob("run-*.wandb")
            for raw in _wandb_log_records(log):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(raw)
                records.append(record)
        except (ValueError, struct.error, AssertionError, DecodeError):  # not there yet, or half written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{run_dir}: no exit record after {timeout:.0f} s"
        time.sleep(0.2)


def _wandb_history_and_config(run_dir: Path) -> tuple[dict, dict]:
    history, config = {}, {}
    for record in _finished_wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = history.setdefault(record.history.step.num, {})
            for item in record.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind in ("run", "config"):  # the config comes with the run record, updates after
            update = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in update})
    return history, config


def test_wandb_offline_run_history_holds_the_logged_losses(monitored_run):
    root, records, stdout = monitored_run
    lines = [line for line in stdout.splitlines() if "wandb: offline run at" in line]
    assert len(lines) == 1, stdout
    run_dir = root / lines[0].split("offline run at ")[1].split(" (")[0]
    assert run_dir.is_dir() and run_dir.parent == root / "run" / "wandb", run_dir
    history, config = _wandb_history_and_config(run_dir)
    assert {step: row["train/loss"] for step, row in history.items() if "train/loss" in row} == _losses(
        records, "train"
    ) and len(_losses(records, "train")) == 3
    assert {step: row["valid/loss"] for step, row in history.items() if "valid/loss" in row} == _losses(
        records, "valid"
    ) and len(_losses(records, "valid")) == 2
    assert history[3]["train/lr"] == records[-2]["lr"] and "train/tokens_per_s" in history[3]
    assert config["model"]["hidden_size"] == 64 and config["train_iters"] == 3
    assert config["zero"]["stage"] == 0 and config["monitor"]["wandb_project"] == "mz-test"


def test_tensorboard_event_file_holds_the_logged_losses(monitored_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, records, stdout = monitored_run
    assert "tensorboard: event files in tb" in stdout
    events = EventAccumulator(str(root / "tb"))
    events.Reload()
    for split in ("train", "valid"):
        logged = {e.step: e.value for e in events.Scalars(f"{split}/loss")}
        expected = _losses(records, split)
        assert logged.keys() == expected.keys() and logged
        assert all(logged[it] == pytest.approx(loss, rel=1e-6) for it, loss in expected.items())  # float32
    assert {e.step for e in events.Scalars("train/grad_norm")} == {1, 2, 3}


def test_plot_metrics_on_two_runs_writes_a_png(monitored_run, tmp_path, capsys):
    from PIL import Image

    root, records, _ = monitored_run
    other = tmp_path / "other"
    other.mkdir()
    with (other / "metrics.jsonl").open("w") as f:  # a second run: halved losses, one more iteration
        for record in records + [dict(records[0], iteration=4)]:
            f.write(json.dumps(dict(record, loss=record["loss"] / 2)) + "\n")
    plot_metrics = _import_repo_module("plot_metrics")
    output = tmp_path / "plots.png"
    assert plot_metrics.main([str(root / "run"), str(other), "--output", str(output)]) == 0
    assert "(2 runs)" in capsys.readouterr().out
    with Image.open(output) as image:
        assert image.format == "PNG"
        width, height = plot_metrics.FIGSIZE
        assert image.size == (round(width * plot_metrics.DPI), round(height * plot_metrics.DPI))
        assert len(image.getcolors(maxcolors=1 << 20)) > 2, "something was drawn"
    assert plot_metrics.main([str(tmp_path / "missing"), "--output", str(output)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no metrics.jsonl there" in err[0]


@pytest.mark.parametrize(
    "package,argv,extra",
    [
        ("wandb", ["--wandb-project", "p"], ".[wandb]"),
        ("tensorboard", ["--tensorboard-dir", "tb"], ".[tensorboard]"),
    ],
)
def test_monitor_without_its_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch, package, argv, extra):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    code, out = _main(TINY + ["--train-iters", "1"] + argv, capsys)
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and extra in lines[0] and argv[0] in lines[0], out.err
    assert not (tmp_path / "tb").exists() and not out.out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--wandb-exp-name", "x"], "--wandb-exp-name needs --wandb-project"),
        (["--tensorboard-dir", "afile"], "--tensorboard-dir afile is a file, not a directory"),
        (["--wandb-project", "p", "--wandb-save-dir", "afile/sub"], "--wandb-save-dir afile/sub cannot be created"),
    ],
)
def test_bad_monitor_flags_are_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    code, out = _main(TINY + ["--train-iters", "1"] + argv, capsys)
    assert code == 2 and message in out.err and len(out.err.splitlines()) == 1, out.err


def test_wandb_without_network_falls_back_to_an_offline_run(tmp_path, monkeypatch):
    import wandb
    from megazero.config.train_config import MonitorConfig
    from megazero.training.monitor import WandbMonitor

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-home"))
    real_init = wandb.init

    def init_without_network(**kwargs):
        if kwargs.get("mode") != "offline":
            raise wandb.errors.CommError("Network error (ConnectionError), entering retry loop")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init_without_network)
    said = []
    config = MonitorConfig(wandb_project="p", wandb_save_dir=str(tmp_path))
    monitor = WandbMonitor(config, {"seed": 7}, said.append)
    monitor.log({"iteration": 5, "split": "train", "loss": 2.5, "time_ms": {"forward": 1.5}})
    monitor.close()
    assert len(said) == 2 and "cannot go online (Network error" in said[0], said
    assert f"offline run at {monitor.run_dir}" in said[1] and monitor.run_dir.parent == tmp_path / "wandb"
    history, config = _wandb_history_and_config(monitor.run_dir)
    assert history[5]["train/loss"] == 2.5 and history[5]["train/time_ms/forward"] == 1.5
    assert config["seed"] == 7
