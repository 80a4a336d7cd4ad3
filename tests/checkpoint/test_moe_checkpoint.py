"""Checkpoints of a mixture-of-experts model: N steps straight equal N/2, save, load, N/2 more,
bitwise, at tp 2 ZeRO-2, dp 4 ZeRO-3 and ep 2 ZeRO-3; a tp 2 ZeRO-3 checkpoint continues at dp 4
ZeRO-1, and an ep 2 one at ep 1 and ep 4, on those layouts' own curves (rtol 1e-5).
The routers' expert biases (DeepSeek-V3's, updated outside the optimizer) resume bitwise at ep 2 and
carry over ep 2 -> 1 -> 4 (the curves and the final biases equal the unbroken ep 2 run's), and the
consolidated model holds them (a strict state-dict load); export to Mixtral refuses them in one line.
Planted: the reader joining the expert-parallel ranks' experts in reverse -> the ep 2 resume fails;
the saver leaving the biases out -> the biased resume fails."""

import pytest
from safetensors.torch import load_file

from tests.checkpoint.test_save_and_load import SAVE_AT, STEPS, _curve, ckpt_worker
from tests.layouts import assert_close, small_config
from megazero.checkpoint.consolidate import consolidate
from megazero.checkpoint.reader import CheckpointReader
from megazero.core.errors import UsageError
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT
from tools.convert_checkpoint import export_hf

MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_aux_loss_coeff=0.01,
    moe_z_loss_coeff=0.001,
    moe_shared_expert_intermediate_size=16,
    moe_layer_freq=[1, 0, 1, 1],
)


def _config(dropout=0.0, **layout):
    """Dropout on for the bitwise resumes (its RNG states carry over); off where layouts are compared
    (each layout draws its own masks)."""
    return small_config(steps=STEPS, model_extra=dict(MOE, hidden_dropout=dropout), **layout)


def test_moe_resume_is_bitwise_and_loads_at_another_layout(dist_pool, tmp_path):
    pool = dist_pool(4)
    for what, layout, dp in (("tp 2 zero 2", dict(stage=2, tp=2), 2), ("dp 4 zero 3", dict(stage=3), 4)):
        directory = tmp_path / what.replace(" ", "_")
        straight = _curve(pool.run(ckpt_worker, _config(0.1, **layout), dp, str(directory), SAVE_AT))
        resumed = _curve(pool.run(ckpt_worker, _config(0.1, **layout), dp, str(directory), None, str(directory)))
        assert resumed == {k: v for k, v in straight.items() if k > SAVE_AT}, what
    source = tmp_path / "source"
    pool.run(ckpt_worker, _config(stage=3, tp=2), 2, str(source), SAVE_AT, stop_after=SAVE_AT)
    own = _curve(pool.run(ckpt_worker, _config(stage=1), 4, str(tmp_path / "own")))
    moved = _curve(pool.run(ckpt_worker, _config(stage=1), 4, str(tmp_path / "moved"), None, str(source)))
    steps = sorted(moved)
    assert steps == list(range(SAVE_AT + 1, STEPS + 1))
    assert_close([moved[k][0] for k in steps], [own[k][0] for k in steps], "tp 2 zero 3 -> dp 4 zero 1")


def test_expert_parallel_checkpoints_resume_and_reshard_between_ep_sizes(dist_pool, tmp_path):
    """Saved at ep 2 (ZeRO-3, dp 4: experts of two ranks, each sharded over two): resumes bitwise,
    and continues at ep 1 (ZeRO-1) and at ep 4 (ZeRO-2) on those layouts' own curves."""
    pool = dist_pool(4)
    source = tmp_path / "ep2"
    straight = _curve(pool.run(ckpt_worker, _config(0.1, stage=3, ep=2), 4, str(source), SAVE_AT))
    resumed = _curve(pool.run(ckpt_worker, _config(0.1, stage=3, ep=2), 4, str(source), None, str(source)))
    assert resumed == {k: v for k, v in straight.items() if k > SAVE_AT}, "ep 2 resume"
    pool.run(ckpt_worker, _config(stage=3, ep=2), 4, str(tmp_path / "plain"), SAVE_AT, stop_after=SAVE_AT)
    for what, layout in (("ep 1 zero 1", dict(stage=1)), ("ep 4 zero 2", dict(stage=2, ep=4))):
        own = _curve(pool.run(ckpt_worker, _config(**layout), 4, str(tmp_path / f"own {what}")))
        moved = _curve(pool.run(ckpt_worker, _config(**layout), 4, str(tmp_path / what), None, str(tmp_path / "plain")))
        steps = sorted(moved)
        assert steps == list(range(SAVE_AT + 1, STEPS + 1)), what
        assert_close([moved[k][0] for k in steps], [own[k][0] for k in steps], f"ep 2 zero 3 -> {what}")


# sigmoid routing with the expert bias, at a rate that changes the routing within a few steps
BIASED = dict(
    MOE, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01
)


def _biased(**layout):
    return small_config(steps=STEPS, model_extra=BIASED, **layout)


def _biases(results) -> dict:
    biases = [r["biases"] for r in results if r is not None]
    assert all(b == biases[0] for b in biases), "ranks disagree on the expert biases"
    return biases[0]


def test_expert_bias_resumes_bitwise_reshards_and_consolidates(dist_pool, tmp_path):
    pool = dist_pool(4)
    source, one = tmp_path / "ep2", tmp_path / "ep1"
    straight = pool.run(ckpt_worker, _biased(stage=3, ep=2), 4, str(source), SAVE_AT)
    final = _biases(straight)
    saved = CheckpointReader(source).buffers
    assert len(final) == 3 and len(saved) == 3 and any(any(v != 0 for v in b) for b in final.values()), final
    assert all(CheckpointReader(source).buffer(n).abs().sum() > 0 for n in saved)
    resumed = pool.run(ckpt_worker, _biased(stage=3, ep=2), 4, str(source), None, str(source))
    assert _curve(resumed) == {k: v for k, v in _curve(straight).items() if k > SAVE_AT}, "ep 2 resume"
    assert _biases(resumed) == final, "ep 2 resume: biases"
    # ep 2 -> ep 1 (ZeRO-1, saving one step later) -> ep 4 (ZeRO-2)
    moved = pool.run(ckpt_worker, _biased(stage=1), 4, str(one), SAVE_AT + 1, str(source))
    again = pool.run(ckpt_worker, _biased(stage=2, ep=4), 4, str(tmp_path / "ep4"), None, str(one))
    for what, run, start in (("ep 2 -> 1", moved, SAVE_AT), ("ep 2 -> 1 -> 4", again, SAVE_AT + 1)):
        got, want = _curve(run), _curve(straight)
        assert sorted(got) == list(range(start + 1, STEPS + 1)), what
        assert_close([got[k][0] for k in sorted(got)], [want[k][0] for k in sorted(got)], what)
        assert _biases(run) == final, f"{what}: biases"
    config = GPTConfig(**CheckpointReader(source).metadata["model"])
    written = consolidate(source, tmp_path / "full")
    state = load_file(str(tmp_path / "full" / "model.safetensors"))
    model = GPT(config)
    model.load_state_dict(state, strict=True)
    names = [n for n, _ in model.named_buffers()]
    assert names and all(n in state for n in names) and written["model.safetensors"] == len(state)
    assert all(state[n].abs().sum() > 0 for n in names)
    with pytest.raises(UsageError) as err:
        export_hf(source, tmp_path / "hf", "mixtral")
    assert "\n" not in str(err.value)
