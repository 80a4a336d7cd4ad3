"""Checkpoints of a Muon run (its momentum in the slot of Adam's first moment): 6 steps straight equal
3, save, load, 3 more, bitwise (losses and final parameters) at tp 2 ZeRO-3; a tp 2 ZeRO-3 checkpoint
continues at dp 4 ZeRO-1 on that layout's own curve (rtol 1e-5); an Adam checkpoint loaded by a Muon
run (or the reverse) is refused in one line unless --no-load-optim.
Planted: the loader leaving exp_avg (Muon's momentum) out -> the bitwise resume fails."""

import pytest
import torch

from megazero.checkpoint.resume import check_resume
from megazero.config.train_config import CheckpointConfig
from megazero.core.errors import UsageError
from megazero.ops.muon_config import MuonConfig
from tests.checkpoint.test_save_and_load import SAVE_AT, STEPS, _curve, ckpt_worker
from tests.layouts import assert_close, small_config

MUON = MuonConfig(nesterov=True, matmul_precision="high")


def _config(muon=True, **layout):
    cfg = small_config(steps=STEPS, layers=2, lr=1e-2, **layout)
    cfg.optimizer.muon = MUON if muon else None
    return cfg


def test_muon_resumes_bitwise_and_reshards(dist_pool, tmp_path):
    pool = dist_pool(4)
    directory = tmp_path / "tp2"
    straight = pool.run(ckpt_worker, _config(stage=3, tp=2), 2, str(directory), SAVE_AT, None, True)
    resumed = pool.run(ckpt_worker, _config(stage=3, tp=2), 2, str(tmp_path / "unused"), None, str(directory), True)
    assert _curve(resumed) == {k: v for k, v in _curve(straight).items() if k > SAVE_AT}
    for a, b in zip(straight, resumed):
        for name, (value, _) in a["params"].items():
            assert torch.equal(value, b["params"][name][0]), f"{name} after the resume"
    own = _curve(pool.run(ckpt_worker, _config(stage=1), 4, str(tmp_path / "own")))
    moved = _curve(pool.run(ckpt_worker, _config(stage=1), 4, str(tmp_path / "moved"), None, str(directory)))
    steps = sorted(moved)
    assert steps == list(range(SAVE_AT + 1, STEPS + 1))
    assert_close([moved[k][0] for k in steps], [own[k][0] for k in steps], "tp 2 zero 3 -> dp 4 zero 1")

    adam = _config(muon=False)
    for load_optim, refused in ((True, True), (False, False)):
        ck = CheckpointConfig(load=str(directory), load_optim=load_optim)
        if refused:
            with pytest.raises(UsageError, match="the checkpoint's optimizer is muon, this run's adam"):
                check_resume(ck, adam.model, adam.global_batch_size, adam.optimizer)
        else:
            check_resume(ck, adam.model, adam.global_batch_size, adam.optimizer)
