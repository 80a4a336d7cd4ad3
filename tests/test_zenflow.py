"""ZenFlow (zero/zenflow.py), its two exact limits and its exact resume.

- `topk_ratio` 1.0 (every column selected, stepped on the device every step) follows the run with
  the device optimizer, and `topk_ratio` 0 with `update_interval` 1 and no overlap follows plain
  optimizer offload, both to rtol 1e-5, at stages 1, 2 and 3 on 2 ranks (the CPU Adam with overlap
  still runs beside the first one, its result overwritten by the device's). At stage 1 the first
  limit runs with `offload` (the selected moments in host memory, visiting the device each step).
- A run in the real shape (top 25%, windows of 2, overlap, re-selection, warm-up) saved
  mid-window with a pending CPU result resumes exactly: the same losses and parameters.

Planted: the device part stepped with step count t - 1 fails the first limit; the accumulator,
or the selected columns' device moments, left out of the checkpoint kinds fails the resume (its
parameters); under the stream checker (test_stream_check's grid has a ZenFlow layout) starting
the CPU Adam thread without the host synchronizing on the accumulation first is a read-after-write
race naming the accumulator. Not told apart here: the CPU Adam's step count (the global step's,
as DeepSpeed's) from the window count, equal at update_interval 1; and on a CPU device `offload`'s
copies of the moments to and from the device are no-ops (the same tensors), so only its memory
report is checked.
"""
from layouts import assemble_params, assert_close, assert_params_match, small_config
from test_offload_optimizer import many

STEPS = 4


def zenflow(**flow):
    return {"offload_optimizer": {"device": "cpu"}, "zenflow": flow} if flow else {}


def cfg(stage, extra, steps=STEPS):
    return small_config(stage=stage, steps=steps, layers=2, zero_extra=extra)


def test_zenflow_limits_and_resume(dist_pool, tmp_path):
    top1 = {"topk_ratio": 1.0, "update_interval": 2, "overlap_step": True}
    top0 = {"topk_ratio": 0.0, "update_interval": 1}
    real = {"topk_ratio": 0.25, "update_interval": 2, "overlap_step": True, "full_warm_up_rounds": 1,
            "select_strategy": "step", "select_interval": 4}
    ckpt = str(tmp_path / "ckpt")
    stages = (1, 2, 3)
    jobs = []
    for stage in stages:
        moments_home = {"offload": True} if stage == 1 else {}
        jobs += [(cfg(stage, {}), 2, {}), (cfg(stage, zenflow(**top1, **moments_home)), 2, {}),
                 (cfg(stage, {"offload_optimizer": {"device": "cpu"}}), 2, {}),
                 (cfg(stage, zenflow(**top0)), 2, {})]
    resumed = cfg(3, zenflow(**real), steps=8)
    jobs += [(resumed, 2, {"save": (ckpt, 6)}), (resumed, 2, {"load": ckpt})]
    ranks = [r for r in dist_pool(4).run(many, jobs) if r[0] is not None]
    by_job = list(zip(*ranks))         # per job: the working ranks' results
    for s, stage in enumerate(stages):
        device, top1_run, offload, top0_run = by_job[4 * s:4 * s + 4]
        for name, got, want in ((f"stage {stage} topk 1.0 vs device", top1_run, device),
                                (f"stage {stage} topk 0 vs offload", top0_run, offload)):
            assert_close(list(got[0]["curve"].values()), list(want[0]["curve"].values()), name)
            assert_params_match(assemble_params(got), assemble_params(want), name)
        # The memory report: every element's master on the device at topk 1 (and its moments with
        # two int64 indices; with offload the moments in host memory instead), none at topk 0.
        for r in top1_run:
            memory = r["memory"]
            assert 0.95 * memory["host_master"] <= memory["master"] <= memory["host_master"]   # padding
            if stage == 1:
                assert memory["optimizer_states"] == 4 * memory["master"]
                assert memory["host_optimizer_states"] == 2 * memory["host_master"] + 2 * memory["master"]
            else:
                assert memory["optimizer_states"] == 6 * memory["master"]
        assert all(r["memory"]["master"] == 0 for r in top0_run)
    straight, again = by_job[3 * 4], by_job[3 * 4 + 1]
    assert again[0]["curve"] == {k: v for k, v in straight[0]["curve"].items() if k > 6}
    want = assemble_params(straight)
    for name, value in assemble_params(again).items():
        assert (value == want[name]).all(), name


def test_column_sums_of_a_piece_match_the_matrix_reference():
    """A partition piece starts and ends mid-row: its column L1 norms equal those of the
    whole matrix with the elements outside the piece zeroed (planted: the head run placed at
    column 0 fails)."""
    import torch

    from megazero.zero.zenflow import column_abs_sums, top_columns
    torch.manual_seed(0)
    rows, columns = 7, 5
    matrix = torch.randn(rows * columns)
    for start, end in [(0, 35), (3, 35), (0, 12), (3, 4), (6, 29), (10, 15), (0, 0)]:
        masked = torch.zeros_like(matrix)
        masked[start:end] = matrix[start:end]
        want = masked.view(rows, columns).abs().sum(0)
        torch.testing.assert_close(column_abs_sums(matrix[start:end], start, columns), want)
    sums = torch.tensor([3.0, 9.0, 1.0, 7.0])
    assert sorted(top_columns(sums, 0.5).tolist()) == [1, 3]
    assert top_columns(sums, 0.01).tolist() == [1] and len(top_columns(sums, 0.0)) == 0
    assert len(top_columns(sums, 1.0)) == 4


def test_the_planner_counts_zenflow_as_the_engine_does():
    from layouts import with_padded_vocab

    from megazero.config.memory_estimate import plan_bytes
    plain = plan_bytes(with_padded_vocab(cfg(2, {"offload_optimizer": {"device": "cpu"}})), 2)
    flow = plan_bytes(with_padded_vocab(cfg(2, zenflow(topk_ratio=0.5, update_interval=2, overlap_step=True))), 2)
    assert plain["master"] == 0 and flow["host_master"] == plain["host_master"]
    assert flow["master"] == 0.5 * flow["host_master"] and flow["optimizer_states"] == 6 * flow["master"]
    # two fp32 accumulators and the fp32 gradients' copy: 12 bytes per element beside plain's staging
    assert flow["host_offload_buffers"] > plain["host_offload_buffers"] + 2 * flow["host_master"]
    # offload: the selected moments move to host memory, the indices stay
    away = plan_bytes(with_padded_vocab(cfg(2, zenflow(topk_ratio=0.5, update_interval=2, offload=True))), 2)
    assert away["optimizer_states"] == 4 * away["master"] == 4 * flow["master"]
    assert away["host_optimizer_states"] == plain["host_optimizer_states"] + 2 * flow["master"]
