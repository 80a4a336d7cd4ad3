"""Every mistake a user can make ends in one clear line, before any work is lost or any group starts.

One table: each row is a launch line (and the files or environment it meets) that must end with
exit code 2, a single `error: ...` line on stderr naming what the user wrote and the fix, no
traceback, and every file written before it left as it was. Rows run in-process through
megazero.run.launch.main; a process boundary is crossed only where it is the point (one plain process,
two torchrun launches of 2 ranks). Beside the table: the spellings that must be accepted, --help,
the agreement between ranks and the memory formulas.
"""

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from megazero.run import launch
from megazero.data.tokenizer import train_tokenizer
from tests.data.tiny_data import write_dataset
from tests.launching import run_torchrun

REPO = Path(__file__).resolve().parents[2]

VOCAB = 400
TEXT = "".join(f"def f{i}(x, y={i}):\n    return x * {i} + y  # line {i}\n\n" for i in range(300))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A 400-piece tokenizer and token files made with it (and some that were not)."""
    root = tmp_path_factory.mktemp("shared")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": TEXT[i::7]}) + "\n" for i in range(7)))
    model = train_tokenizer([corpus], root / "tok", VOCAB, progress=False)
    docs = [list(range(i, i + 50)) for i in range(0, 300, 10)]
    write_dataset(root / "corpus_text_document", docs)
    write_dataset(root / "big_text_document", docs + [[999, 3, 4]])
    write_dataset(root / "empty_text_document", [])
    write_dataset(root / "float_text_document", docs, np.float32)
    return dataclasses.make_dataclass("Shared", ["root", "model", "corpus"])(root, str(model), corpus)


class Files:
    """What a row's launch line refers to, made in the test's folder on demand."""

    def __init__(self, root: Path, shared):
        self.root, self.shared = root, shared
        self.model, self.data = shared.model, str(shared.root / "corpus_text_document")

    def file(self, name, text="x"):
        path = self.root / name
        path.write_text(text)
        return str(path)

    def folder(self, name):
        path = self.root / name
        path.mkdir(exist_ok=True)
        return str(path)

    def ds(self, config):
        return self.file("ds.json", json.dumps(config))

    def pair(self, name):
        return str(self.shared.root / f"{name}_text_document")

    def copied_pair(self, folder):
        """The shared pair, copied into `folder` (where no sample indices are cached yet)."""
        for ext in (".bin", ".idx"):
            (Path(self.folder(folder)) / f"c{ext}").write_bytes(Path(self.data + ext).read_bytes())
        return str(self.root / folder / "c")

    def truncated(self):
        prefix = write_dataset(self.root / "cut", [[1, 2, 3], [4, 5]])
        with open(prefix + ".bin", "r+b") as handle:
            handle.truncate(6)
        return prefix


# (id, launch line from Files, environment, what the line must contain, what it must not).
# Rank 0 of 2 as a user starts it by hand (megazero.run.rendezvous refuses a WORLD_SIZE without the rest)
HAND_STARTED_RANK_0 = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
ROWS = [
    # offload and ZeRO++ settings
    (
        "nvme-swap-folder-is-a-file",
        lambda f: ["--zero-stage", "2", "--zero-offload-optimizer", "nvme", "--zero-nvme-path", f.file("taken")],
        {},
        ["swap folder", "--zero-nvme-path", "is a file"],
        [],
    ),
    (
        "nvme-without-a-path",
        lambda f: ["--zero-stage", "3", "--zero-offload-param", "nvme"],
        {},
        ["--zero-offload-param nvme needs --zero-nvme-path"],
        [],
    ),
    (
        "param-offload-below-stage-3",
        lambda f: ["--zero-stage", "2", "--zero-offload-param", "cpu"],
        {},
        ["--zero-offload-param cpu", "only ZeRO stage 3"],
        [],
    ),
    (
        "cpu-offload-at-stage-0",
        lambda f: ["--optimizer-cpu-offload"],
        {},
        ["--optimizer-cpu-offload needs ZeRO stage 1-3"],
        [],
    ),
    (
        "quantized-weights-below-stage-3",
        lambda f: ["--zero-stage", "1", "--zero-quantized-weights"],
        {},
        ["--zero-quantized-weights", "stage 3"],
        [],
    ),
    (
        "nvme-path-without-nvme",
        lambda f: ["--zero-stage", "1", "--zero-nvme-path", f.folder("swap")],
        {},
        ["--zero-nvme-path is only used with nvme offload"],
        [],
    ),
    (
        "hpz-larger-than-the-node",
        lambda f: ["--zero-stage", "3", "--zero-hpz-partition-size", "2"],
        {},
        ["zero_hpz_partition_size 2 must divide the 1 ranks"],
        [],
    ),
    # paths a run writes, token ids, lr, memory, precision, misspelled or foreign flags
    ("run-dir-uncreatable", lambda f: ["--run-dir", "/proc/megazero-test/run"], {}, ["--run-dir", "/proc"], []),
    ("run-dir-is-a-file", lambda f: ["--run-dir", f.file("taken")], {}, ["--run-dir", "is a file"], []),
    ("run-dir-under-a-file", lambda f: ["--run-dir", f.file("taken") + "/run"], {}, ["taken is a file"], []),
    ("metrics-file-is-a-folder", lambda f: ["--metrics-file", f.folder("m")], {}, ["--metrics-file", "directory"], []),
    (
        "metrics-file-under-a-file",
        lambda f: ["--metrics-file", f.file("taken") + "/m.jsonl"],
        {},
        ["--metrics-file", "taken is a file"],
        [],
    ),
    ("cache-is-a-file", lambda f: [], {"MEGAZERO_CACHE": "@taken"}, ["MEGAZERO_CACHE=", "is a file"], []),
    (
        "cache-uncreatable",
        lambda f: [],
        {"MEGAZERO_CACHE": "/proc/megazero-cache"},
        ["MEGAZERO_CACHE=/proc/megazero-cache"],
        [],
    ),
    (
        "token-ids-beyond-tokenizer",
        lambda f: ["--data-path", f.pair("big"), "--tokenizer-model", f.model],
        {},
        ["token id 999", f"{VOCAB} pieces", "--tokenizer-model"],
        [],
    ),
    ("negative-lr-and-min-lr", lambda f: ["--lr", "-0.001", "--min-lr", "-0.01"], {}, ["--lr must be >= 0"], []),
    ("negative-lr-alone", lambda f: ["--lr", "-0.001"], {}, ["--lr must be >= 0"], ["--min-lr"]),
    (
        "model-too-big-for-memory",
        lambda f: ["--seq-length", "400000", "--micro-batch-size", "64"],
        {},
        ["GiB per rank", "--seq-length 400000"],
        [],
    ),
    # one sample, every layer recomputed: what remains is the CPU's attention kernel (math, with dropout)
    (
        "attention-kernel-too-big-for-memory",
        lambda f: [
            "--seq-length",
            "400000",
            "--max-position-embeddings",
            "400000",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
        {},
        ["GiB per rank", "math attention kernel's", "--attention-dropout 0"],
        [],
    ),
    (
        "config-bf16-vs-flag-fp16",
        lambda f: ["--fp16", "--zero-config", f.ds({"bf16": {"enabled": True}})],
        {},
        ["bf16.enabled in", "ds.json", "--fp16"],
        ["--bf16"],
    ),
    ("misspelled-hidden-size", lambda f: ["--hiden-size", "64"], {}, ["did you mean --hidden-size?"], []),
    (
        "misspelled-tp-size",
        lambda f: ["--tensor-parallel-size", "2"],
        {},
        ["did you mean --tensor-model-parallel-size?"],
        [],
    ),
    (
        "prefix-without-text-document",
        lambda f: ["--data-path", f.data[: -len("_text_document")], "--tokenizer-model", f.model],
        {},
        ["did you mean", "corpus_text_document"],
        [],
    ),
    (
        "megatron-flag-megazero-lacks",
        lambda f: ["--use-flash-attn"],
        {},
        ["--use-flash-attn is a Megatron-LM flag"],
        [],
    ),
    (
        "megatron-flag-near-a-megazero-one",
        lambda f: ["--fp8-format", "e4m3"],
        {},
        ["--fp8-format is a Megatron-LM flag"],
        ["did you mean"],
    ),
    # more mistakes
    (
        "config-wrong-json-type",
        lambda f: ["--zero-config", f.ds({"train_micro_batch_size_per_gpu": "4"})],
        {},
        ["train_micro_batch_size_per_gpu must be a number", "ds.json"],
        [],
    ),
    ("config-is-a-folder", lambda f: ["--zero-config", f.folder("conf")], {}, ["--zero-config", "is a directory"], []),
    (
        "config-negative-lr",
        lambda f: ["--zero-config", f.ds({"optimizer": {"type": "AdamW", "params": {"lr": -1}}})],
        {},
        ["optimizer.params.lr in", "ds.json", ">= 0"],
        [],
    ),
    (
        "tokenizer-not-sentencepiece",
        lambda f: ["--data-path", f.data, "--tokenizer-model", f.file("t.model")],
        {},
        ["not a sentencepiece model"],
        [],
    ),
    ("data-path-without-tokenizer", lambda f: ["--data-path", f.data], {}, ["--data-path needs --tokenizer-model"], []),
    (
        "empty-corpus",
        lambda f: ["--data-path", f.pair("empty"), "--tokenizer-model", f.model],
        {},
        ["empty_text_document holds no documents"],
        [],
    ),
    (
        "idx-of-float-tokens",
        lambda f: ["--data-path", f.pair("float"), "--tokenizer-model", f.model],
        {},
        ["float32", "not integer ids"],
        [],
    ),
    (
        "bin-truncated",
        lambda f: ["--data-path", f.truncated(), "--tokenizer-model", f.model],
        {},
        ["cut.bin", "bytes but its .idx describes"],
        [],
    ),
    (
        "data-path-is-a-folder",
        lambda f: ["--data-path", str(f.shared.root), "--tokenizer-model", f.model],
        {},
        ["is a directory", "corpus_text_document"],
        [],
    ),
    (
        "data-path-with-extension",
        lambda f: ["--data-path", f.data + ".bin", "--tokenizer-model", f.model],
        {},
        ["without extension"],
        [],
    ),
    (
        "negative-blend-weight",
        lambda f: ["--data-path", "-1", f.data, "2", f.data, "--tokenizer-model", f.model],
        {},
        ["--data-path weight -1", "non-negative"],
        [],
    ),
    ("split-all-zero", lambda f: ["--split", "0,0,0"], {}, ["--split '0,0,0'"], []),
    ("adam-eps-zero", lambda f: ["--adam-eps", "0"], {}, ["--adam-eps must be > 0"], []),
    ("adam-beta2-one", lambda f: ["--adam-beta2", "1"], {}, ["--adam-beta2 must be in [0, 1)"], []),
    ("clip-negative", lambda f: ["--clip-grad", "-1"], {}, ["--clip-grad must be >= 0"], []),
    ("dropout-one", lambda f: ["--hidden-dropout", "1"], {}, ["--hidden-dropout"], []),
    ("weight-decay-negative", lambda f: ["--weight-decay", "-0.1"], {}, ["--weight-decay must be >= 0"], []),
    ("iters-and-samples", lambda f: ["--train-iters", "5", "--train-samples", "80"], {}, ["choose one"], []),
    ("two-warmups", lambda f: ["--lr-warmup-iters", "5", "--lr-warmup-samples", "80"], {}, ["choose one"], []),
    (
        "distributed-optimizer-vs-stage-0",
        lambda f: ["--use-distributed-optimizer", "--zero-stage", "0"],
        {},
        ["--use-distributed-optimizer", "--zero-stage 0"],
        [],
    ),
    (
        "two-deepspeed-configs",
        lambda f: ["--zero-config", f.ds({}), "--deepspeed_config", "other.json"],
        {},
        ["--deepspeed_config other.json"],
        [],
    ),
    ("local-rank-not-a-number", lambda f: ["--local_rank=abc"], {}, ["--local-rank", "invalid int"], []),
    ("loss-scale-not-power-of-2", lambda f: ["--initial-loss-scale", "3"], {}, ["power of two"], []),
    ("eval-iters-negative", lambda f: ["--eval-iters", "-1"], {}, ["--eval-iters must be >= 0"], []),
    ("world-size-without-launcher", lambda f: [], {"WORLD_SIZE": "2"}, ["WORLD_SIZE=2", "torchrun"], []),
    (
        "vocab-divisor-zero",
        lambda f: ["--make-vocab-size-divisible-by", "0"],
        {},
        ["--make-vocab-size-divisible-by must be >= 1"],
        [],
    ),
    # each names what the user wrote (the file, the flag as typed) and the way out
    # (a 2-rank world's flags, checked before anything connects)
    (
        "layers-not-divisible-by-pp",
        lambda f: ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
        HAND_STARTED_RANK_0,
        ["--num-layers 3 is not divisible", "--pipeline-layer-split with 2 counts"],
        [],
    ),
    (
        "layer-split-not-summing",
        lambda f: ["--num-layers", "3", "--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "1", "1"],
        HAND_STARTED_RANK_0,
        ["--pipeline-layer-split [1, 1]", "summing to --num-layers 3"],
        [],
    ),
    (
        "deepspeed-batch-not-divisible",
        lambda f: ["--deepspeed_config", f.ds({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 4})],
        {},
        ["train_batch_size = 7 (", "ds.json)", "train_micro_batch_size_per_gpu = 4"],
        ["--global-batch-size"],
    ),
    (
        "deepspeed-accumulation-mismatch",
        lambda f: [
            "--zero-config",
            f.ds({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}),
        ],
        {},
        ["train_batch_size = 16 (", "gradient_accumulation_steps = 3 (", "ds.json)"],
        [],
    ),
    (
        "deepspeed-config-not-json",
        lambda f: ["--deepspeed_config", f.file("bad.json", "{bad")],
        {},
        ["--deepspeed_config", "bad.json: not valid JSON", "column 2"],
        ["--zero-config"],
    ),
]
# Permission rows: root writes and reads through mode bits, so these only mean something for others.
AS_USER = [
    (
        "run-dir-read-only",
        lambda f: ["--run-dir", f.folder("ro")],
        {},
        ["--run-dir", "ro (--run-dir) is not writable"],
        [],
    ),
    (
        "run-dir-in-read-only",
        lambda f: ["--run-dir", f.folder("ro") + "/run"],
        {},
        ["cannot be created", "not writable"],
        [],
    ),
    ("metrics-file-read-only", lambda f: ["--metrics-file", f.file("ro.jsonl")], {}, ["--metrics-file"], []),
    (
        "data-unreadable",
        lambda f: ["--data-path", f.truncated(), "--tokenizer-model", f.model],
        {},
        ["cut.bin cannot be read"],
        [],
    ),
    ("config-unreadable", lambda f: ["--zero-config", f.file("ro.json", "{}")], {}, ["ro.json cannot be read"], []),
    (
        "tokenizer-unreadable",
        lambda f: ["--data-path", f.data, "--tokenizer-model", f.file("ro.model")],
        {},
        ["ro.model cannot be read"],
        [],
    ),
    (
        "data-folder-read-only",
        lambda f: ["--data-path", f.copied_pair("ro"), "--tokenizer-model", f.model],
        {},
        ["the data folder", "sample indices", "--data-cache-path"],
        [],
    ),
]


def _snapshot(root: Path) -> dict:
    """Every file's bytes (its size and time where this process may not read it)."""
    return {
        p: p.read_bytes() if os.access(p, os.R_OK) else (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def _launch(files, capsys, monkeypatch, row):
    _, argv_of, env, needles, forbidden = row
    for name, value in env.items():
        monkeypatch.setenv(name, files.file(value[1:]) if value.startswith("@") else value)
    argv = argv_of(files)
    before = {**_snapshot(files.root), **_snapshot(files.shared.root)}
    assert launch.main(argv) == 2, argv
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert all(n in lines[0] for n in needles) and not any(f in lines[0] for f in forbidden), lines[0]
    after = {**_snapshot(files.root), **_snapshot(files.shared.root)}
    assert {p: after.get(p) for p in before} == before, "a file written before the launch changed"
    # New files may only be the token statistics cached beside a .idx; probes leave nothing.
    assert all(p.name.endswith(".stats.json") for p in set(after) - set(before)), set(after) - set(before)
    assert not list(files.root.rglob(".megazero-probe*"))


@pytest.fixture
def files(tmp_path, shared, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run folder goes here
    monkeypatch.setenv("MEGAZERO_CACHE", str(tmp_path / "cache"))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    return Files(tmp_path, shared)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_mistake_ends_in_one_line(files, capsys, monkeypatch, row):
    _launch(files, capsys, monkeypatch, row)


def _permission_bits_honoured() -> bool:
    """False for root (and any process allowed to override file modes)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        locked = Path(folder, "locked")
        locked.mkdir(mode=0o500)
        try:
            (locked / "probe").mkdir()
        except PermissionError:
            return True
        finally:
            locked.chmod(0o700)
        return False


@pytest.mark.skipif(not _permission_bits_honoured(), reason="this process ignores permission bits (root)")
@pytest.mark.parametrize("row", AS_USER, ids=[r[0] for r in AS_USER])
def test_permission_mistake_ends_in_one_line(files, capsys, monkeypatch, row):
    _, argv_of, env, needles, forbidden = row
    argv = argv_of(files)
    for path in files.root.iterdir():  # "ro*" may be read, not written; "cut.bin", "ro.json"
        if path.name in ("cut.bin", "ro.json", "ro.model"):  # and "ro.model" not even read
            path.chmod(0)
        elif path.name.startswith("ro"):
            path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        _launch(files, capsys, monkeypatch, (row[0], lambda f: argv, env, needles, forbidden))
    finally:
        for path in files.root.iterdir():
            path.chmod(0o755 if path.is_dir() else 0o644)


def test_mistake_in_a_real_process_ends_in_one_line(tmp_path):
    """Across the process boundary too: a path mistake found before any work, exit 2, one line."""
    (tmp_path / "taken").write_text("x")
    env = dict(os.environ, MEGAZERO_CACHE=str(tmp_path / "taken"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "pretrain_gpt.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "MEGAZERO_CACHE=" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def _torchrun(tmp_path, argv, env=()):
    """A 2-rank torchrun launch; returns the launcher's process (with rank 0's stdout) and the ranks'
    stderr, one file each: [rank 0's, rank 1's]."""
    logs = tmp_path / "logs"
    proc = run_torchrun(2, [str(REPO / "pretrain_gpt.py"), *argv], tmp_path, timeout=300, env=dict(env), log_dir=logs)
    ranks = [next(logs.rglob(f"attempt_0/{r}/stderr.log")).read_text() for r in range(2)]
    proc.stdout = next(logs.rglob("attempt_0/0/stdout.log")).read_text()
    return proc, ranks


def test_torchrun_error_before_the_group_is_printed_once(tmp_path, shared):
    """A data mistake under torchrun is found before the process group starts, on every rank, and
    rank 0 alone prints it; the launch fails with that rank's exit code 2."""
    proc, (first, second) = _torchrun(
        tmp_path, ["--data-path", str(tmp_path / "corpus"), "--tokenizer-model", shared.model, "--run-dir", "r"]
    )
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-2000:]
    assert first.count("\n") == 1 and first.startswith("error: --data-path") and "corpus.bin" in first, first
    assert second == "" and not (tmp_path / "r").exists() and "megazero:" not in proc.stdout


def test_torchrun_error_after_the_group_is_printed_once(tmp_path, shared):
    """Found only once the embedded corpus is built (rank 0, after the group started): rank 0 prints
    the one line and every rank stops with exit code 2, no connection traceback."""
    from megazero.data.default_data import default_data_dir

    folder = default_data_dir(tmp_path / "cache")
    (folder / "v8192").mkdir(parents=True)
    (folder / "corpus.jsonl").write_bytes(shared.corpus.read_bytes())  # a small corpus, already cached
    (folder / "v8192" / "tokenizer.model").write_bytes(Path(shared.model).read_bytes())
    argv = ["--split", "1,100000,0", "--num-layers", "1", "--hidden-size", "32", "--seq-length", "16", "--run-dir", "r"]
    proc, (first, second) = _torchrun(tmp_path, argv, {"MEGAZERO_CACHE": str(tmp_path / "cache")})
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-2000:]
    assert "megazero: world=2" in proc.stdout  # the process group had started
    errors = [line for line in first.splitlines() if line.startswith("error")]
    assert errors == [line for line in first.splitlines() if "error" in line.lower()], first
    assert len(errors) == 1 and "--split gives the train set 0" in errors[0], first
    assert "Traceback" not in first + second and "error" not in second.lower(), second


class _Rank(launch.Launch):
    def __init__(self, rank, store):
        super().__init__()
        self.world, self.rank, self.store = 2, rank, store


def _both(fn):
    """fn(launch) on two ranks sharing one store, in threads; returns [rank 0's, rank 1's] results."""
    store, out = dist.HashStore(), [None, None]
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(_Rank(r, store)))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_ranks_agree_on_the_first_error_and_rank_0_speaks():
    errors = {0: None, 1: "--data-path x: not found on this node"}
    verdicts = _both(lambda launch: (launch.agree("check", errors[launch.rank]), launch.speaks))
    assert verdicts == [
        ("rank 1: --data-path x: not found on this node", True),
        ("rank 1: --data-path x: not found on this node", False),
    ]
    assert _both(lambda launch: launch.agree("quiet", None)) == [None, None]
    errors = {0: "rank 0's own", 1: "rank 1's own"}
    assert _both(lambda launch: launch.agree("both", errors[launch.rank])) == ["rank 0's own"] * 2


def test_a_rank_cut_off_by_another_ones_failure_stays_quiet():
    """The first rank to end speaks; one cut off by it stays quiet and reports the first one's line
    (and exit code) to torchrun. (Planted: end_first answering True to every rank fails here.)"""
    store = dist.HashStore()
    failing, other = _Rank(1, store), _Rank(0, store)
    assert failing.end_first("rank 1: the data is gone", 2) == (True, "rank 1: the data is gone", 2)
    assert other.end_first("rank 0: lost rank 1", 1) == (False, "rank 1: the data is gone", 2)


def _config(*argv, world=1):
    from megazero.config.train_flags import config_from_args, parse_args

    return config_from_args(parse_args(list(argv)), world_size=world)


def test_launch_lines_users_already_have_are_accepted(tmp_path):
    from megazero.config.train_flags import parse_args

    assert parse_args(["--local_rank=3"]).local_rank == 3 and parse_args(["--local-rank", "1"]).local_rank == 1
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2}))
    cfg = _config("--deepspeed", "--deepspeed_config", str(ds), world=2)
    assert cfg.zero.stage == 2 and cfg.micro_batch_size == 2 and any("--deepspeed" in n for n in cfg.notes)
    assert _config("--use-distributed-optimizer").zero.stage == 1
    assert _config("--use-distributed-optimizer", "--zero-config", str(ds)).zero.stage == 2
    cfg = _config("--overlap-grad-reduce", "--overlap-param-gather", "--zero-stage", "1")
    assert cfg.zero.overlap and any("--overlap-param-gather has no effect" in n for n in cfg.notes)
    cfg = _config(
        "--train-samples", "800", "--lr-decay-samples", "480", "--lr-warmup-samples", "160", "--global-batch-size", "16"
    )
    assert (cfg.train_iters, cfg.optimizer.decay_iters, cfg.optimizer.warmup_iters) == (50, 30, 10)


def test_help_gives_every_flag_one_line_with_its_default(capsys):
    from megazero.config.flags import build_parser

    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 60
    for action in flags:
        assert action.help and "\n" not in action.help and "(default: " in action.help, action.option_strings
    assert "(default: 0.001)" in next(a.help for a in flags if "--lr" in a.option_strings)
    with pytest.raises(SystemExit) as done:
        launch.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and all(
        f"\n{group}:" in out for group in ("model", "parallelism", "training", "data and logging")
    )


def test_memory_formulas_are_the_engines():
    """Per-parameter bytes equal the table tests/zero/test_engine_accounting.py checks the engine against,
    and the parameter count equals the model's."""
    from tests.zero.test_engine_accounting import FORMULA, FORMULA_BF16_GRADS, FORMULA_FP32
    from megazero.config.memory_estimate import model_state_bytes_per_param, parameter_counts
    from megazero.models.config import GPTConfig
    from megazero.models.gpt import GPT

    for table, weight, grad in ((FORMULA, 2, 4), (FORMULA_BF16_GRADS, 2, 2), (FORMULA_FP32, 4, 4)):
        for stage in range(4):
            got = model_state_bytes_per_param(stage, 4, weight, grad, separate_master=weight == 2)
            assert got == pytest.approx(table[stage](1, 4)), (stage, weight, grad)
    for tied in (True, False):
        cfg = GPTConfig(vocab_size=500, hidden_size=64, num_layers=3, num_attention_heads=4, tie_embeddings=tied)
        embedding, layer, head = parameter_counts(cfg)
        assert embedding + 3 * layer + head == sum(p.numel() for p in GPT(cfg).parameters())


def test_memory_check_leaves_offloaded_states_out_where_they_leave():
    """The refusal estimate of an offloaded run: host-offloaded states leave a GPU's count but stay in
    the CPU's (the same memory), swapped ones leave both."""
    from megazero.config.train_flags import config_from_args, parse_args
    from megazero.config.memory_estimate import estimate

    base = ["--zero-stage", "3", "--bf16"]
    plain = config_from_args(parse_args(base), 2)
    cpu = config_from_args(parse_args(base + ["--zero-offload-optimizer", "cpu", "--zero-offload-param", "cpu"]), 2)
    nvme = config_from_args(parse_args(base + ["--zero-offload-optimizer", "nvme", "--zero-nvme-path", "/tmp/s"]), 2)
    params = estimate(plain, 2).rank_parameters
    assert estimate(cpu, 2, "cpu").model_states == estimate(plain, 2).model_states
    # bf16 at stage 3 over 2 ranks: (2 + 4 + 12) / 2 per parameter; 12 / 2 and 2 / 2 leave the GPU
    assert estimate(cpu, 2, "cuda").model_states == pytest.approx(estimate(plain, 2).model_states - params * 7)
    assert estimate(nvme, 2, "cpu").model_states == pytest.approx(estimate(plain, 2).model_states - params * 6)


def test_memory_check_counts_the_experts_states():
    """The refusal estimate of a mixture of experts holds the experts' states too, as the planner's
    model states do (the experts are the most of such a model's parameters)."""
    from megazero.config.train_flags import config_from_args, parse_args
    from megazero.config.memory_estimate import MODEL_STATE_KINDS, estimate, plan_bytes

    for extra in ([], ["--expert-model-parallel-size", "2"]):
        cfg = config_from_args(parse_args(["--zero-stage", "1", "--bf16", "--num-experts", "4"] + extra), 2)
        plan = plan_bytes(cfg, 2)
        assert estimate(cfg, 2).model_states == pytest.approx(sum(plan[k] for k in MODEL_STATE_KINDS)), extra


@pytest.mark.parametrize(
    "argv,line",
    [
        (["--hidden-sise", "64"], "error: unrecognized flag --hidden-sise; did you mean --hidden-size?"),
        (
            ["--global-batch-size", "7", "--micro-batch-size", "2"],
            "error: --global-batch-size 7 is not divisible by --micro-batch-size 2 x data-parallel size 1 = 2",
        ),
    ],
)
def test_a_flag_mistake_is_reported_before_torch_loads(argv, line):
    """pretrain_gpt.py checks the flags (the parse and every check between them, under either
    answer to "is there a GPU") before the runtime imports torch: with torch made unimportable the
    mistake is still its one line and exit 2. (Planted: importing megazero.run.pretrain at the top of
    launch.py fails this with torch's import refused.) The time it saves is torch's and dynamo's
    import: measured at load ~3, 7.3-8.3 s before, 0.7-0.9 s after."""
    blocker = (
        "import sys, runpy\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch may not load before the flags are checked')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        f"sys.argv = ['pretrain_gpt.py', *{argv!r}]\n"
        f"runpy.run_path({str(REPO / 'pretrain_gpt.py')!r}, run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
