"""Resumes that would change the model or the run without a word (megazero.checkpoint.resume, reader,
loader): a learned position table of another size is refused unless --extend-position-embeddings
grows it by its stated rule; an iteration edited in metadata.json is refused; a different --seed is
accepted with a line. One tiny run saves the checkpoint they all read; the checks run in-process."""

import json
import shutil

import pytest
import torch

from tests.driver import TINY
from tests.driver import run_main as _main
from megazero.checkpoint import CheckpointError, CheckpointReader
from megazero.checkpoint.loader import _fit
from megazero.checkpoint.resume import check_resume
from megazero.config.train_flags import config_from_args, parse_args
from megazero.run import launch

RUN = TINY + ["--train-iters", "2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-iteration run's --save folder (learned positions, --seq-length 64)."""
    root = tmp_path_factory.mktemp("resume")
    assert launch.main(RUN + ["--save", str(root / "ck"), "--run-dir", str(root / "run")]) == 0
    return root / "ck"


def _check(argv):
    cfg = config_from_args(parse_args(argv))
    return check_resume(cfg.checkpoint, cfg.model, cfg.global_batch_size, cfg.optimizer, cfg.train_iters, seed=cfg.seed)


def test_another_position_table_is_refused_unless_extended_by_its_rule(saved, tmp_path, capsys, monkeypatch):
    """--seq-length 128 against the checkpoint's 64 learned positions: refused in one line naming both
    and the two ways on; --seq-length 32 names --max-position-embeddings 64, which is then accepted;
    --extend-position-embeddings grows the table (row p from row p mod 64, Adam moments alike) and
    trains. (Planted: _fit zero-filling any tensor whose first dimension grew, as before, loads the
    table unchecked.)"""
    monkeypatch.chdir(tmp_path)
    code, out = _main(RUN + ["--load", str(saved), "--seq-length", "128"], capsys)
    assert code == 2 and out.err.count("\n") == 1, out.err
    assert (
        "the checkpoint's learned position table has 64 rows, this run's 128 (--max-position-embeddings, "
        "else --seq-length); pass --max-position-embeddings 64 with a --seq-length up to 64, or "
        "--extend-position-embeddings to grow the table (position p starts from the checkpoint's row p "
        "mod 64)"
    ) in out.err, out.err
    with pytest.raises(CheckpointError, match="this run's 32 .*; pass --max-position-embeddings 64 "):
        _check(RUN + ["--load", str(saved), "--seq-length", "32"])
    _check(RUN + ["--load", str(saved), "--seq-length", "32", "--max-position-embeddings", "64"])
    table = torch.arange(8.0).reshape(4, 2)
    with pytest.raises(CheckpointError, match="embedding.position.weight"):
        _fit(table, (6, 2), "embedding.position.weight", saved, extend_positions=False)
    assert _fit(table, (6, 2), "embedding.position.weight", saved, True).tolist() == table[[0, 1, 2, 3, 0, 1]].tolist()
    code, out = _main(
        RUN[:-1]
        + [
            "3",
            "--load",
            str(saved),
            "--seq-length",
            "128",
            "--extend-position-embeddings",
            "--override-opt_param-scheduler",
            "--save",
            "grown",
        ],
        capsys,
    )
    assert code == 0 and "loaded weights and optimizer" in out.out, out.err
    grown = CheckpointReader(tmp_path / "grown")
    assert grown.metadata["model"]["max_position_embeddings"] == 128 and grown.metadata["iteration"] == 3


def test_an_edited_iteration_is_refused(saved, tmp_path):
    """metadata.json's iteration must be its directory's and the optimizer's step count's: an edit
    (2 -> 3) is refused, and so is the edit with the directory renamed to match. (Planted: the reader
    not checking the iteration resumes "at iteration 3" from iteration 2's weights.)"""
    copy = tmp_path / "ck" / "iter_0000002"
    shutil.copytree(saved / "iter_0000002", copy)
    metadata = json.loads((copy / "metadata.json").read_text())
    (copy / "metadata.json").write_text(json.dumps({**metadata, "iteration": 3}))
    with pytest.raises(CheckpointError, match=r"metadata.json: iteration 3, but its directory is iter_0000002; "):
        CheckpointReader(copy)
    renamed = copy.rename(copy.with_name("iter_0000003"))
    with pytest.raises(
        CheckpointError,
        match=r"iteration 3 does not match the optimizer's 2 steps and 0 skipped "
        r"since iteration 0; the metadata was edited",
    ):
        CheckpointReader(renamed)


def test_a_different_seed_is_accepted_with_a_line(saved):
    """As Megatron-LM, a resume may change --seed; unlike it, the run says what that changes.
    (Planted: no seed notice.)"""
    assert CheckpointReader(saved).metadata["seed"] == 1234
    assert not [n for n in _check(RUN + ["--load", str(saved)]).notices if "--seed" in n]
    notices = [n for n in _check(RUN + ["--load", str(saved), "--seed", "7"]).notices if "--seed" in n]
    assert notices == [
        "--seed 7 differs from the checkpoint's 1234 (accepted, as Megatron-LM does): the samples "
        "from here on come in the order --seed 7 gives, the RNG states (dropout) come from the "
        "checkpoint where the layout allows; pass --seed 1234 to keep its order"
    ], notices
