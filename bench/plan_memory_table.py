"""The memory planner (tools/plan_memory.py, megazero.memory_estimate.plan_bytes) against the ZeRO
engine's own memory_report, per category, over a grid of layouts on 4 gloo ranks.

    python bench/plan_memory_table.py

Each layout's config is built from pretrain_gpt.py's flags exactly as the planner builds it; the
engine is set up (parameters, gradients, master and Adam states allocated) and its report read on
every rank; the table prints predicted / reported for the largest rank of each category (the planner
predicts the rank that runs out first). tests/test_plan_memory.py asserts the same grid within 10%.

Stage 3 keeps parameters of at most `param_persistence_threshold` elements whole (DeepSpeed's
default 1e5 would keep every parameter of this small model whole); the grid sets thresholds that
split the model both ways, and 0.
"""
from __future__ import annotations

import sys

from megazero.arguments import config_from_args
from megazero.flags import build_parser
from megazero.memory_estimate import MODEL_STATE_KINDS, plan_bytes
from megazero.parallel.topology import Topology

WORLD = 4
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "32", "--untie-embeddings-and-output-weights", "--micro-batch-size", "2"]
# (tp, pp, dp, ZeRO stage, bf16, MiCS shard size, stage-3 param_persistence_threshold)
GRID = [(1, 1, 4, 0, False, -1, 0), (1, 1, 4, 1, True, -1, 0), (1, 1, 4, 2, True, -1, 0),
        (1, 1, 4, 3, False, -1, 0), (1, 1, 4, 3, True, 2, 0), (2, 1, 2, 1, False, -1, 0),
        (2, 1, 2, 3, True, -1, 0), (1, 2, 2, 2, False, -1, 0), (1, 2, 2, 3, True, -1, 0),
        (2, 2, 1, 0, True, -1, 0), (1, 1, 4, 3, True, -1, 2000), (1, 2, 2, 3, False, -1, 16384)]


def layout_config(layout):
    tp, pp, dp, stage, bf16, mics, persistence = layout
    argv = MODEL + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                    "--zero-stage", str(stage), "--global-batch-size", str(2 * dp * pp)]
    args = build_parser().parse_args(argv + (["--bf16"] if bf16 else []))
    cfg = config_from_args(args, tp * pp * dp)
    cfg.zero.param_persistence_threshold = persistence
    cfg.zero.mics_shard_size = mics
    return cfg


def engine_report_worker(ctx, layout):
    """Pool entry: the engine's memory_report on this rank for `layout` (None outside it)."""
    from megazero.training import setup
    tp, pp, dp, _, _, mics, _ = layout
    groups = ctx.groups(Topology(world_size=tp * pp * dp, tp=tp, pp=pp, mics_shard_size=mics))
    if groups is None:
        return None
    return setup(layout_config(layout), groups).engine.memory_report()


def compare(pool, layouts=GRID) -> list[tuple]:
    """[(layout, category, predicted bytes, largest reported bytes)] for every layout and category."""
    rows = []
    for layout in layouts:
        reports = [r for r in pool.run(engine_report_worker, layout) if r is not None]
        tp, pp, dp = layout[:3]
        predicted = plan_bytes(layout_config(layout), tp * pp * dp)
        for kind in MODEL_STATE_KINDS:
            rows.append((layout, kind, predicted[kind], max(r[kind] for r in reports)))
    return rows


def format_rows(rows) -> str:
    lines = [f"{'tp pp dp stage bf16 mics persist':<34}{'category':<18}{'predicted':>12}{'reported':>12}{'ratio':>8}"]
    for (tp, pp, dp, stage, bf16, mics, persist), kind, predicted, reported in rows:
        ratio = f"{predicted / reported:8.3f}" if reported else ("       -" if not predicted else "     inf")
        lines.append(f"{tp:>2} {pp:>2} {dp:>2} {stage:>5} {str(bf16):>5} {mics:>4} {persist:>7}   {kind:<18}"
                     f"{predicted:12.0f}{reported:12d}{ratio}")
    return "\n".join(lines)


def main() -> int:
    from megazero.testing import DistributedPool
    pool = DistributedPool(WORLD)
    try:
        print(format_rows(compare(pool)))
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
