"""bench/published_tables.py: its copy of Narayanan et al. 2021's Table 1 agrees with the paper's own
arithmetic (each row's parameter count from the paper's parameter formula, its aggregate PFLOP/s
and % of the A100's peak from its per-GPU TFLOP/s), the paper's FLOP formula equals a GEMM-by-GEMM
count and megazero's own FLOP count (megazero.training.flops, full attention plus full
recomputation) on the 1T row, the paper's 84-day estimate for the 1T model follows from it, and
every row's flags parse to the layout it names. Simulates nothing."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import published_tables as pt  # noqa: E402


def test_table1_parses_and_its_columns_agree():
    table = pt.parse_table1()
    assert len(table) == 10
    for r in table:
        assert r["tp"] * r["pp"] * r["dp"] == r["gpus"] and r["batch"] % r["dp"] == 0, r
        # the paper rounds parameters to 0.1 billion, TFLOP/s to 1, PFLOP/s to 0.1 from unrounded rates
        assert pt.paper_params(r["layers"], r["hidden"]) / 1e9 == pytest.approx(r["params_b"], abs=0.051), r
        assert r["tflops"] * r["gpus"] / 1e3 == pytest.approx(r["pflops"], rel=0.01), r
        assert 100 * r["tflops"] / pt.A100_PEAK_TFLOPS == pytest.approx(r["percent"], abs=1.0), r
    trillion = table[-1]
    assert (trillion["gpus"], trillion["pflops"], trillion["percent"]) == (3072, 502.0, 52)


def _hand_count(batch, layers, hidden, seq=pt.SEQ, vocab=pt.VOCAB, forwards=4):
    """Per layer forward: q, k, v and output projections 8 B s h^2, MLP (4h) 16 B s h^2, scores and
    attention x V 4 B s^2 h (in full); the logits 2 B s h V. A step: the layers' forward `forwards`
    times (forward, recomputation, backward as two), the logits three times (never recomputed)."""
    layer = 24 * batch * seq * hidden**2 + 4 * batch * seq**2 * hidden
    return forwards * layers * layer + 3 * 2 * batch * seq * hidden * vocab


def test_paper_formula_equals_the_gemm_count_and_megazeros_count():
    r = pt.parse_table1()[-1]
    b, l, h = r["batch"], r["layers"], r["hidden"]
    assert pt.paper_flops(b, l, h) == pytest.approx(_hand_count(b, l, h), rel=1e-12)
    assert pt.executed_flops(b, l, h) == pytest.approx(_hand_count(b, l, h, forwards=3), rel=1e-12)
    from megazero.dry_run.job import job_config
    from megazero.training.flops import recompute_flops, step_flops

    row = next(x for x in pt.rows() if x.name == "1008B")
    argv = list(row.argv) + [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ]
    model = job_config(argv, row.world, 8).model
    tokens = b * pt.SEQ
    ours = step_flops(model, tokens, causal_at_half=False) + recompute_flops(
        model, tokens, [2] * 64, causal_at_half=False
    )
    assert ours == pytest.approx(pt.paper_flops(b, l, h), rel=1e-9)


def test_the_papers_1t_training_time_follows_from_its_formula():
    # Section 5.1: 1T parameters, 450B tokens, 3072 GPUs at 163 TFLOP/s: about 84 days (via 8TP/nX,
    # which the full formula exceeds by its small s/6h and V/16lh terms)
    r = pt.parse_table1()[-1]
    per_token = pt.paper_flops(1, r["layers"], r["hidden"]) / pt.SEQ
    days = per_token * 450e9 / (3072 * 163e12) / 86400
    assert days == pytest.approx(84, rel=0.03)


def test_every_rows_flags_parse_to_its_layout():
    from megazero.config.train_config import topology_of
    from megazero.dry_run.job import job_config

    for row in pt.rows():
        cfg = job_config(list(row.argv), row.world, 8)
        topo = topology_of(cfg, row.world)
        assert (topo.tp, topo.pp, topo.dp) == (row.tp, row.pp, row.dp), row.name
        assert cfg.global_batch_size == row.batch and cfg.model.num_layers == row.layers, row.name
        assert pt.pipeline_ranks(row) == [topo.rank_of(0, 0, s) for s in range(row.pp)], row.name
