"""Overlapped pipeline point-to-point (`overlap_p2p_comm`) on real gloo ranks: 1F1B and interleaved
train bit for bit as without overlap (same ops in the same order, only waited later), ZeRO-2 on the
data-parallel axis included. The op order itself, against a transport that runs each stage's
batches in turn, is tests/parallel/pipeline/test_p2p_order.py's.
"""

import pytest
import torch

from tests.layouts import run_layouts, small_config, with_padded_vocab

STEPS = 2


def overlapped(cfg):
    cfg.parallel.overlap_p2p_comm = True
    return cfg


def test_overlapped_p2p_trains_bitwise_like_plain_p2p(dist_pool):
    pairs = {  # what -> (config maker, dp)
        "1F1B pp 2 x ZeRO-2 dp 2": (lambda: small_config(pp=2, stage=2, schedule="1f1b", steps=STEPS), 2),
        "interleaved pp 2 x v 2": (
            lambda: small_config(pp=2, virtual=2, schedule="interleaved", steps=STEPS, global_batch=8),
            1,
        ),
    }
    layouts = []
    for make, dp in pairs.values():
        layouts += [(make(), dp), (overlapped(make()), dp)]
    per_rank = dist_pool(4).run(run_layouts, layouts)
    for i, what in enumerate(pairs):
        plain = [r[2 * i] for r in per_rank]
        overlap = [r[2 * i + 1] for r in per_rank]
        for a, b in zip(plain, overlap):
            if a is None:
                continue
            assert a["losses"] == b["losses"], f"{what}: losses differ with overlap"
            assert a["norms"] == b["norms"], f"{what}: grad norms differ with overlap"
            for name, (value, _) in a["params"].items():
                assert torch.equal(value, b["params"][name][0]), f"{what}: {name} differs with overlap"
            sent = {k: v for k, v in a["comm"].items() if k[0] in ("send", "recv")}
            assert sent and sent == {k: v for k, v in b["comm"].items() if k[0] in ("send", "recv")}, (
                f"{what}: point-to-point bytes differ with overlap"
            )


def test_overlap_flag_reaches_the_schedule_and_refuses_what_it_cannot_overlap():
    from megazero.config.train_flags import config_from_args
    from megazero.core.errors import UsageError
    from megazero.config.flags import parse_args
    from megazero.parallel.process_groups import ProcessGroups
    from megazero.training.assembly import setup
    from megazero.training.loop import _job

    pipeline = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--overlap-p2p-communication"]
    assert config_from_args(parse_args(pipeline), world_size=2).parallel.overlap_p2p_comm
    state = setup(with_padded_vocab(overlapped(small_config(steps=1))), ProcessGroups.single())
    assert _job(state, []).overlap_p2p, "the training loop's pipeline job ignores overlap_p2p_comm"
    assert not config_from_args(parse_args(pipeline[:-1]), world_size=2).parallel.overlap_p2p_comm
    with pytest.raises(UsageError, match="not gpipe"):
        config_from_args(parse_args(pipeline + ["--pipeline-schedule", "gpipe"]), world_size=2)
    with pytest.raises(UsageError, match="--pipeline-model-parallel-size 1 has none"):
        config_from_args(parse_args(["--overlap-p2p-communication"]))
