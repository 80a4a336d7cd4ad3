"""Context parallelism (ring attention p2p, Ulysses a2a, allgather) against one process.

- The attention cores alone: each comm type's output and q/k/v gradients on this rank's two chunks
  equal full causal attention's (fp32, GQA) at cp 2 and 4.
- Training: the small GPT with RoPE and GQA, 10 steps with gradient accumulation and clipping, in
  each layout, matches the single-process loss curve, gradient norms and final parameters (rtol 1e-5).
  cp 2 x tp 2 x pp 2 ZeRO-3 runs on 8 ranks, in one pool call with the bf16 checks (iteration 1's
  gradient norm and loss within 1e-5 of a run without CP whose attention has the same numerics: see
  there).
- bench/bench_context_parallel.py end to end at tiny sizes, its numbers checked (losses equal cp 1's,
  the planner within its bound of the measured peak).

Mutations planted and seen failing (each by hand, then reverted):
- chunk order: `chunk_ids` returning (i, i + N) instead of (i, 2N-1-i) -> the positions, the data
  and ring attention's step plan disagree: core outputs and every training layout fail.
- LSE correction dropped in the ring merge (`_merge` adding block outputs without the exp(lse - merged)
  rescaling) -> the p2p core check and the p2p layouts fail; a2a and allgather still pass.
- dK/dV not sent back to their owner (the last `_pass_on` of the backward skipped) -> the p2p
  k/v gradient check fails.
- RoPE at local positions (Attention.positions left unset) -> the cp 2 p2p layout's grad norms differ.
"""

import sys
from pathlib import Path

import pytest
import torch

from tests.layouts import (
    ProcessGroups,
    assert_close,
    assert_matches_reference,
    last_stage_result,
    layout_worker,
    per_layout,
    reference_fixture,
    run_training,
    single_process_reference,
    small_config,
)
from megazero.models.attention import attention_reference
from megazero.parallel.context_parallel import ContextParallelAttention, local_chunks, local_positions, ring_positions
from megazero.parallel.topology import Topology

# The bench's pool worker is imported by module name in the workers: bench/ joins sys.path here, at
# collection, before any pool starts (as tests/config/test_memory_estimate.py does).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_context_parallel  # noqa: E402

# Small (the suite's time budget): 2 layers, 10 steps of 8 samples as for the other axes, with
# clipping, accumulation and Adam's moments at work; RoPE and GQA on.
SMALL = dict(steps=10, layers=2, global_batch=8, model_extra={"position_embedding": "rope", "num_query_groups": 2})


def test_layout_is_load_balanced_and_a_permutation():
    for cp in (1, 2, 4):
        order = ring_positions(16 // cp, cp)
        assert sorted(order.tolist()) == list(range(16))
    assert local_positions(8, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(8, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(16).view(1, 16)
    assert local_chunks(x, 1, 4).tolist() == [[2, 3, 12, 13]]


def _core_worker(ctx, cp, comm_type):
    # The 4-rank grids the training layouts use too (cp 2 x dp 2, cp 4): one pool, communicators made once.
    groups = ctx.groups(Topology(world_size=4, cp=cp))
    gen = torch.Generator().manual_seed(5)
    b, s, heads, query_groups, d = 2, 16, 4, 2, 8
    q = torch.randn(b, s, heads, d, generator=gen)
    k, v = (torch.randn(b, s, query_groups, d, generator=gen) for _ in range(2))
    dout = torch.randn(b, s, heads * d, generator=gen)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attention_reference(*full)
    expected.backward(dout)
    rank = groups.cp.rank
    local = [local_chunks(t, rank, cp).clone().requires_grad_() for t in (q, k, v)]
    out = ContextParallelAttention(groups.cp, comm_type, 0.0)(*local)
    out.backward(local_chunks(dout, rank, cp))
    checks = {"out": (out, local_chunks(expected, rank, cp))}
    for name, got, ref in zip("qkv", local, full):
        checks[f"d{name}"] = (got.grad, local_chunks(ref.grad, rank, cp))
    return {name: (a.detach(), e.detach()) for name, (a, e) in checks.items()}


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_cores_match_full_attention(dist_pool, cp):
    """Forward and backward of each comm type on this rank's chunks equal full causal attention."""
    for comm_type in ("p2p", "a2a", "allgather"):
        if comm_type == "a2a" and cp == 4:
            continue  # 2 query groups do not split over 4 ranks (checked at the edge)
        for rank, result in enumerate(dist_pool(4).run(_core_worker, cp, comm_type)):
            for name, (got, expected) in result.items():
                torch.testing.assert_close(
                    got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"cp {cp} {comm_type} rank {rank} {name}: {m}"
                )


reference = reference_fixture(**SMALL)


def check_layout(pool, reference, what, dp, **config):
    results = pool.run(layout_worker, small_config(**SMALL, **config), dp)
    assert_matches_reference(results, reference, what)
    return results


# The comm log's ops on the CP group per comm type (ring: K/V and dK/dV sends; Ulysses: all-to-alls;
# allgather: K/V gathered, their gradients reduce-scattered).
CP_OPS = {"p2p": {"send", "recv"}, "a2a": {"all_to_all"}, "allgather": {"all_gather", "reduce_scatter"}}


def test_context_parallel_comm_types_match_single_process(dist_pool, reference):
    pool = dist_pool(4)
    for comm_type in ("p2p", "a2a", "allgather"):
        results = check_layout(pool, reference, f"cp 2 {comm_type}", 1, cp=2, cp_comm_type=comm_type)
        cp_ops = {op for (op, group, _), nbytes in results[0]["comm"].items() if group == "cp" and nbytes}
        assert cp_ops == CP_OPS[comm_type], (comm_type, results[0]["comm"])
    check_layout(pool, reference, "cp 4 p2p", 1, cp=4)


def test_context_parallel_with_tp_pp_zero_matches_single_process(dist_pool, reference):
    pool = dist_pool(4)
    check_layout(pool, reference, "cp 2 tp 2 sequence parallel", 1, cp=2, tp=2, sequence_parallel=True)
    check_layout(pool, reference, "cp 2 dp 2 zero 3", 2, cp=2, stage=3)
    check_layout(pool, reference, "cp 2 pp 2 zero 1", 1, cp=2, pp=2, stage=1)


# bf16 layouts: one step each (iteration 1's gradient norm and loss), each against a run without CP
# whose attention has the same numerics, all to 1e-5. Ulysses calls the one-process kernel (SDPA) on
# whole sequences; the ring computes its blocks in fp32 (scores, probabilities, merge), so its
# references compute attention in fp32 too (`Fp32Attention`), where SDPA rounds the probabilities to
# bf16: that alone moves the one-process norm by 4.6e-4, and the ring is held to it at 1e-3.
# allgather runs SDPA on each rank's queries, whose backward rounds each rank's part of dK/dV to bf16
# before the parts are summed over CP: 2.4e-5 measured, held at 5e-5.
# Measured (gradient-accumulation fusion on): a2a 3.1e-7, p2p 2.5e-7 (cp 2) and 1.4e-7 (cp 4),
# cp2 tp2 against tp2 ~1e-7; losses 0 to 7e-9. Without the fusion (autograd rounding each weight
# gradient over the tokens one rank holds): a2a 8.6e-5, p2p 4.6e-4.
BF16 = dict(SMALL, steps=1, bf16=True)
BF16_GAP, BF16_ALLGATHER_GAP, BF16_RING_VS_SDPA_GAP = 1e-5, 5e-5, 1e-3


class Fp32Attention(torch.nn.Module):
    """Causal attention computed in fp32 on 16-bit q/k/v, rounded once: ring attention's numerics."""

    def forward(self, q, k, v, documents=None):  # the core's signature (packed documents unused here)
        assert documents is None
        return attention_reference(q.float(), k.float(), v.float()).to(q.dtype)


def fp32_attention(state):
    """run_training's on_setup: every layer's attention core becomes Fp32Attention."""
    for chunk in state.chunks:
        for layer in chunk.layers.values():
            core = layer.attention.core
            if hasattr(core, "inner"):  # TP's RNG-tracked wrapper
                core.inner = Fp32Attention()
            else:
                layer.attention.core = Fp32Attention()


def bf16_worker(ctx, layouts):
    """Pool entry: (config, dp, fp32 attention?) in turn; ranks outside a layout give None for it."""
    return [layout_worker(ctx, cfg, dp, fp32_attention if fp32 else None) for cfg, dp, fp32 in layouts]


BF16_LAYOUTS = {  # name -> (layout, dp, fp32 attention, reference: one process or a layout)
    "cp 2 a2a": (dict(cp=2, cp_comm_type="a2a"), 1, False, "sdpa"),
    "cp 2 p2p": (dict(cp=2), 1, False, "fp32 attention"),
    "cp 4 p2p": (dict(cp=4), 1, False, "fp32 attention"),
    "cp 2 allgather": (dict(cp=2, cp_comm_type="allgather"), 1, False, "sdpa"),
    "cp 2 tp 2 sequence parallel": (dict(cp=2, tp=2, sequence_parallel=True), 1, False, "tp 2"),
    "tp 2": (dict(tp=2, sequence_parallel=True), 1, True, None),
}


def _gap(got, ref, key):
    return abs(got[key][0] - ref[key][0]) / ref[key][0]


def test_cp2_tp2_pp2_zero3_on_8_ranks_and_bf16_first_gradient_norm(dist_pool, reference):
    """One 8-rank pool call: cp 2 x tp 2 x pp 2 with ZeRO-3 (sharded over dp x cp = 2) follows the
    single-process fp32 run (losses, norms, parameters; rtol 1e-5), and in bf16 each of
    BF16_LAYOUTS' iteration-1 gradient norm and loss are within 1e-5 of its reference (see there).

    The weight gradients are summed in fp32 (gradient-accumulation fusion, models/weight_grad.py):
    without it autograd rounds each one to bf16 over the tokens a rank holds, a different sum from
    one process's, and no layout comes within 1e-5. Planted: the fusion off (a2a 8.6e-5); the
    ring's LSE rescaling dropped (fails p2p by far more than 1e-5); the chunk order (i, i + N) for
    the 8-rank layout (its loss curve)."""
    layouts = [(small_config(**SMALL, cp=2, tp=2, pp=2, stage=3), 1, False)]
    layouts += [(small_config(**BF16, **layout), dp, fp32) for layout, dp, fp32, _ in BF16_LAYOUTS.values()]
    results = per_layout(dist_pool(8).run(bf16_worker, layouts))
    assert_matches_reference(results[0], reference, "cp 2 tp 2 pp 2 zero 3")
    got = {what: last_stage_result(r) for what, r in zip(BF16_LAYOUTS, results[1:])}
    one = {
        "sdpa": single_process_reference(**BF16)[0],
        "fp32 attention": run_training(small_config(**BF16), ProcessGroups.single(), fp32_attention),
    }
    for what, (_, _, _, against) in BF16_LAYOUTS.items():
        if against is None:
            continue
        ref = got[against] if against in got else one[against]
        bar = BF16_ALLGATHER_GAP if "allgather" in what else BF16_GAP
        for key in ("norms", "losses"):
            gap = _gap(got[what], ref, key)
            print(f"bf16 {what} against {against}: iteration-1 {key} {gap:.1e}")
            assert gap <= bar, (
                f"bf16 {what}: iteration-1 {key} {got[what][key][0]} vs {against} {ref[key][0]} ({gap:.1e})"
            )
    # The ring against one-process SDPA: SDPA's own rounding of the probabilities, not more.
    gap = _gap(got["cp 2 p2p"], one["sdpa"], "norms")
    assert gap <= BF16_RING_VS_SDPA_GAP, f"bf16 cp 2 p2p against one-process SDPA: norm {gap:.1e}"


def test_checkpoint_moves_between_cp2_and_cp1(dist_pool, reference, tmp_path):
    """Saved at cp 2 (ring attention, ZeRO-1 sharded over dp x cp) after 5 steps, loaded at cp 1: the
    remaining steps follow the single-process curve; and the reverse, cp 1 -> cp 2 ZeRO-3."""
    from tests.checkpoint.test_save_and_load import ckpt_worker

    ref, _ = reference
    pool = dist_pool(4)
    for what, source, target in (
        ("cp 2 -> cp 1", dict(cp=2, stage=1), dict(stage=1)),
        ("cp 1 -> cp 2", dict(stage=3), dict(cp=2, stage=3)),
    ):
        directory = tmp_path / what.replace(" ", "")
        pool.run(ckpt_worker, small_config(**SMALL, **source), 1, str(directory), save_at=5, stop_after=5)
        results = pool.run(
            ckpt_worker, small_config(**SMALL, **target), 1, str(tmp_path / "unused"), load=str(directory)
        )
        curve = results[0]["curve"]
        assert sorted(curve) == list(range(6, 11)), what
        assert_close([curve[i][0] for i in range(6, 11)], ref["losses"][5:], f"{what}: loss after loading")


def _config(*argv, world=1):
    from megazero.config.train_flags import config_from_args, parse_args

    return config_from_args(parse_args(list(argv)), world_size=world)


def test_flags_reach_the_config_and_bad_input_is_one_line():
    """Megatron's and Megatron-DeepSpeed's spellings; each mistake a UsageError naming the flag and
    the fix, raised while the flags are read (before any process group)."""
    from megazero.core.errors import UsageError

    base = (
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--seq-length",
        "64",
        "--attention-dropout",
        "0",
        "--micro-batch-size",
        "1",
    )
    cfg = _config(*base, "--context-parallel-size", "2", "--cp-comm-type", "allgather", world=4)
    assert (cfg.parallel.context_parallel, cfg.parallel.cp_comm_type, cfg.global_batch_size) == (2, "allgather", 2)
    cfg = _config(*base, "--ds-sequence-parallel-size", "2", world=2)
    assert (cfg.parallel.context_parallel, cfg.parallel.cp_comm_type) == (2, "a2a")
    mistakes = [
        (("--seq-length", "60", "--context-parallel-size", "4"), 4, "not divisible by 2 x --context-parallel-size 4"),
        (("--context-parallel-size", "4", "--cp-comm-type", "a2a"), 4, "--num-query-groups 2 is not divisible"),
        (
            (
                "--context-parallel-size",
                "2",
                "--cp-comm-type",
                "a2a",
                "--tensor-model-parallel-size",
                "2",
                "--num-attention-heads",
                "6",
                "--kv-channels",
                "16",
            ),
            4,
            "--num-attention-heads 6 is not divisible by cp 2 x tp 2",
        ),
        (
            (
                "--context-parallel-size",
                "3",
            ),
            4,
            "world size 4 is not divisible by tensor-parallel size 1 x context-parallel size 3",
        ),
        (("--context-parallel-size", "2", "--attention-dropout", "0.1"), 2, "--attention-dropout 0"),
        (("--ds-sequence-parallel-size", "2", "--context-parallel-size", "2"), 2, "contradicts"),
        (
            (
                "--context-parallel-size",
                "0",
            ),
            2,
            "--context-parallel-size",
        ),
    ]
    for extra, world, message in mistakes:
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("+", r"\+")) as err:
            _config(*base, *extra, world=world)
        assert "\n" not in str(err.value)


def test_planner_divides_activations_by_cp_and_adds_its_buffers():
    """Each rank keeps seq / cp tokens: the layers' activations fall by cp, plus the CP attention's
    own saved tensors (the ring's fp32 output and LSE, allgather's whole-sequence K/V and its one
    mask) and buffers."""
    from megazero.config.memory_estimate import cp_mask_bytes, cp_saved_per_layer, output_layer_bytes, plan_bytes

    base = dict(
        model_extra={"seq_length": 256, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2},
        micro=1,
        global_batch=2,
    )
    plans = {
        (cp, kind): plan_bytes(small_config(cp=cp, cp_comm_type=kind, **base), 2 * cp)
        for cp, kind in ((1, "p2p"), (2, "p2p"), (4, "p2p"), (2, "a2a"), (2, "allgather"))
    }
    one = plans[(1, "p2p")]
    model = small_config(**base).model
    for (cp, kind), plan in plans.items():
        if cp == 1:
            continue
        layers = small_config(**base).model.num_layers
        extra = layers * cp_saved_per_layer(256, 1, model, 1, cp, kind, 4) + cp_mask_bytes(256, cp, kind, 4)
        # the fused output layer's chunk of the rank's 256 / cp tokens (its terms:
        # tests/config/test_memory_estimate.py)
        logits = output_layer_bytes(256, model, 1, 4)
        expected = (one["activations"] - logits) / cp + output_layer_bytes(256 // cp, model, 1, 4) + extra
        assert plan["activations"] == pytest.approx(expected, rel=1e-9), (cp, kind)
        assert plan["comm_buffers"] > one["comm_buffers"], (cp, kind)
    assert plans[(4, "p2p")]["activations"] < plans[(2, "p2p")]["activations"]


def test_context_parallel_bench_runs_and_its_numbers_are_sane(dist_pool):
    """bench/bench_context_parallel.py end to end on the shared 4-rank pool: --tiny (seq 64, cp 1/2,
    every comm type; cp 4 is the same code) for the path, then one point whose step memory is well
    above the process's noise (seq 2048, cp 2 p2p: ~50 MB of the ring's fp32 score blocks) for the
    planner (the warm-up pass skipped: the pool's processes have run the other tests' steps). The bench's
    own checks must pass: every layout's losses equal cp 1's (1e-5), and where the measured peak is
    at least MIN_CHECKED_BYTES the planned figure within PLAN_BOUNDS of it (0.88-1.23 in bench/README.md's
    2k-8k run). Planted: the ring's score blocks left out of the planner's cp_transient_bytes (the
    2048 point's ratio falls below 0.5); the ring's LSE rescaling dropped (its losses leave cp 1's)."""
    bench = bench_context_parallel
    pool = dist_pool(4)
    tiny = bench.run(pool, bench.parse_args(["--tiny", "--cps", "1,2"]), warm_up=False)
    assert [(r["seq"], r["cp"], r["comm"]) for r in tiny] == [
        (64, 1, "-"),
        (64, 2, "p2p"),
        (64, 2, "a2a"),
        (64, 2, "allgather"),
    ]
    long = bench.run(
        pool, bench.parse_args(["--tiny", "--seqs", "2048", "--cps", "1,2", "--comm-types", "p2p"]), warm_up=False
    )
    ring = long[-1]
    assert ring["cp"] == 2 and ring["measured"] >= bench.MIN_CHECKED_BYTES, ring
    for r in tiny + long:
        assert r["ms"] > 0 and r["measured"] > 0 and r["planned"] > 0, r
    assert bench.check(tiny + long) == []
