"""Checkpoints of a mixture-of-experts model: N steps straight equal N/2, save, load, N/2 more,
bitwise, at tp 2 ZeRO-2, dp 4 ZeRO-3 and ep 2 ZeRO-3; a tp 2 ZeRO-3 checkpoint continues at dp 4
ZeRO-1, and an ep 2 one at ep 1 and ep 4, on those layouts' own curves (rtol 1e-5).
Planted: the reader joining the expert-parallel ranks' experts in reverse -> the ep 2 resume fails."""
from tests.checkpoint.test_save_and_load import SAVE_AT, STEPS, _curve, ckpt_worker
from tests.layouts import assert_close, small_config

MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01,
           moe_z_loss_coeff=0.001, moe_shared_expert_intermediate_size=16, moe_layer_freq=[1, 0, 1, 1])


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
        moved = _curve(pool.run(ckpt_worker, _config(**layout), 4, str(tmp_path / what), None,
                                str(tmp_path / "plain")))
        steps = sorted(moved)
        assert steps == list(range(SAVE_AT + 1, STEPS + 1)), what
        assert_close([moved[k][0] for k in steps], [own[k][0] for k in steps], f"ep 2 zero 3 -> {what}")
