"""The memory planner (tools/plan_memory.py, megazero.config.memory_estimate.plan_bytes) against the ZeRO
engine's own memory.report(), per category, and against the measured peak of each rank's process,
over a grid of layouts on 4 gloo ranks.

    python bench/plan_memory_table.py              # all three tables
    python bench/plan_memory_table.py --report     # the per-category table only

Each layout's config is built from pretrain_gpt.py's flags exactly as the planner builds it.

Report table: the engine is set up (parameters, gradients, master and Adam states allocated, offloaded
ones in host memory or swap files) and its report read on every rank; the table prints predicted /
reported for the largest rank of each category (the planner predicts the rank that runs out first).
tests/config/test_memory_estimate.py asserts 10 of the layouts within 10%.

Peak table: a larger model (model states well above the interpreter's own noise) trains two steps in
each layout; each rank measures its peak resident memory growth from just before setup (the kernel's
high-water mark, VmHWM, reset through /proc/self/clear_refs; glibc's allocator is set to return
every block of 64 KiB or more to the kernel when freed, so freed tensors do not stay resident and
the peak is the peak of live memory). On the CPU the device and host memory are one, so the planned
figure is the plan's device total plus its host-memory offload. Stage 3's peak is reached in the
second step, when gathers run ahead of use along the recorded trace.

Dry run table: the same measured peaks against tools/dry_run.py's simulation of the same flags on a
CPU (`--simulate-device cpu`: the CPU's kernels, gloo's copies, device and host as one memory; the
largest rank's process_peak); the partial offload (its ratio has no flag) is left out. docs/dry_run.md
has one run's ratios (the 15 dense layouts within 10%; the four MoE layouts 0.93-0.98, balanced routing).

Mixtures of experts (MOE_PEAK_GRID, MOE_PEAK_MODEL: 4 experts top-2 with a gated shared expert,
2 layers of hidden 256, 1024 tokens a microbatch, no dropout): the peak table gets four more rows,
ep 1 ZeRO-1, ep 2 all-to-all ZeRO-2, ep 4 all-gather ZeRO-3, ep 2 all-gather ZeRO-2
(tests/config/test_memory_estimate.py asserts them). One run (loaded 2-core CPU): 0.937, 1.003,
0.989, 1.054 (ranks of one layout differ by up to ~8%: routing is not balanced); planned as dense
layers (before config/moe_memory.py counted a MoE layer's saved rows, intermediates and dispatch
buffers) 0.754, 0.751, 0.600, 0.768, and without the dispatch buffers ep 4 all-gather 0.815. Stage 2's
staged gradient buckets fill during the backward as the activations drain: counted beside both the
activations and a layer's dispatch buffers the ep 2 all-gather ZeRO-2 row was 1.14, so the larger
of the buckets and the dispatch buffers counts. With the default dropout (0.1) the same model measured ~50 MB more: on the CPU,
scaled_dot_product_attention with dropout keeps the attention probabilities (heads x s^2 per
sequence), which the planner leaves out (see memory_estimate's activations note); the MoE model
sets dropout 0 so that the dense part's known gap does not hide the MoE terms.

Stage 3 keeps parameters of at most `param_persistence_threshold` elements whole (DeepSpeed's
default 1e5 would keep every parameter of this small model whole); the grid sets thresholds that
split the model both ways, and 0.

One run (2 CPU cores, quiet), after the output layer's term became the fused loss's chunk (it was
the whole logits): the report table, every category of every layout within 0.4%
(offloaded host_params, host/nvme master and optimizer states, nvme_params and the optimizer's host
staging exactly). The peak table (planned / measured, 13.6M-parameter model), layouts in GRID order:
0.989 0.976 0.966 1.012 0.951 0.979 0.938 0.717 0.895 0.946 0.893 0.954 0.986 1.015 0.922 1.012: 13 of
16 within 10%. Outside: pp 2 stage 2 fp32 (0.717, measured ~185 MB; found since: the previous
microbatch's whole-stage staging bucket and gloo's copy of it are still held while the next one is
reduced, config/staging_memory.py, and the row plans 191.7 MB, 1.03), and stage 3 in bf16
at pp 2 and with persistence 2000 (0.89: a rank stays ~10 MB more resident after the step than its
live tensors, memory outside torch's tensors that the planner cannot see). Reruns move single
layouts by up to ~5%.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import tempfile

from megazero.config.train_flags import config_from_args
from megazero.config.flags import build_parser
from megazero.models.config import padded_vocab_size
from megazero.config.memory_estimate import MODEL_STATE_KINDS, OFFLOAD_CATEGORIES, device_bytes, plan_bytes
from megazero.parallel.topology import Topology

WORLD = 4
MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "256",
    "--seq-length",
    "32",
    "--untie-embeddings-and-output-weights",
    "--micro-batch-size",
    "2",
]
PEAK_MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "512",
    "--num-attention-heads",
    "8",
    "--ffn-hidden-size",
    "2048",
    "--seq-length",
    "32",
    "--untie-embeddings-and-output-weights",
    "--micro-batch-size",
    "2",
]
# A small vocabulary (synthetic tokens) keeps every parameter small beside the model states: a
# tensor held a little longer on one rank (freed at the next garbage collection) moves its peak by
# at most that much.
PEAK_VOCAB = 1024
# (tp, pp, dp, ZeRO stage, bf16, MiCS shard size, stage-3 param_persistence_threshold, offload)
# offload: "" or "+"-joined "optimizer:<device>" / "param:<device>"
GRID = [
    (1, 1, 4, 0, False, -1, 0, ""),
    (1, 1, 4, 1, True, -1, 0, ""),
    (1, 1, 4, 2, True, -1, 0, ""),
    (1, 1, 4, 3, False, -1, 0, ""),
    (1, 1, 4, 3, True, 2, 0, ""),
    (2, 1, 2, 1, False, -1, 0, ""),
    (2, 1, 2, 3, True, -1, 0, ""),
    (1, 2, 2, 2, False, -1, 0, ""),
    (1, 2, 2, 3, True, -1, 0, ""),
    (2, 2, 1, 0, True, -1, 0, ""),
    (1, 1, 4, 3, True, -1, 2000, ""),
    (1, 2, 2, 3, False, -1, 16384, ""),
    (1, 1, 4, 2, True, -1, 0, "optimizer:cpu"),
    (1, 1, 4, 3, False, -1, 0, "param:cpu"),
    (1, 1, 4, 3, True, -1, 0, "optimizer:nvme+param:nvme"),
    (1, 1, 4, 3, False, -1, 0, "optimizer:cpu:0.5"),
]
SWAP_DIR = os.path.join(tempfile.gettempdir(), "megazero-plan-memory")
# Mixtures of experts: a layout with a 9th entry (expert-parallel size, dispatcher) makes every layer
# of the model a mixture of MOE_FLAGS' experts. Their peak model: the experts' dispatch buffers and
# activations (tokens x top-k rows) must be a good part of the peak, so more tokens per microbatch
# and a narrower model than PEAK_MODEL's.
MOE_FLAGS = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "512",
    "--moe-shared-expert-intermediate-size",
    "256",
    "--moe-shared-expert-gate",
]
MOE_PEAK_MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "1024",
    "--seq-length",
    "512",
    "--untie-embeddings-and-output-weights",
    "--micro-batch-size",
    "2",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]
MOE_PEAK_GRID = [
    (1, 1, 4, 1, False, -1, 0, "", (1, "alltoall")),
    (1, 1, 4, 2, False, -1, 0, "", (2, "alltoall")),
    (1, 1, 4, 3, False, -1, 0, "", (4, "allgather")),
    (1, 1, 4, 2, False, -1, 0, "", (2, "allgather")),
]


def layout_argv(layout, model=MODEL) -> tuple[list[str], float | None]:
    """pretrain_gpt.py's flags of `layout` (what flags say of it), with its partial-offload ratio."""
    tp, pp, dp, stage, bf16, mics, persistence, offload, *moe = layout
    for ep, dispatcher in moe:
        model = model + MOE_FLAGS + ["--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type", dispatcher]
    argv = model + [
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--zero-stage",
        str(stage),
        "--global-batch-size",
        str(2 * dp * pp),
    ]
    ratio = None
    for part in filter(None, offload.split("+")):
        what, device, *rest = part.split(":")  # "optimizer:cpu:0.5": partial offload, ratio 0.5
        ratio = float(rest[0]) if rest else ratio
        argv += [f"--zero-offload-{what}", device] + (["--zero-nvme-path", SWAP_DIR] if device == "nvme" else [])
    return argv + (["--bf16"] if bf16 else []), ratio


def layout_config(layout, model=MODEL, vocab: int | None = None):
    tp, pp, dp, stage, bf16, mics, persistence, offload, *moe = layout
    argv, ratio = layout_argv(layout, model)
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args, tp * pp * dp)
    if ratio is not None:  # sub-groups small enough for the ratio to split the partition
        cfg.zero.offload_optimizer.ratio, cfg.zero.sub_group_size = ratio, 4096
    cfg.zero.param_persistence_threshold = persistence
    cfg.zero.mics_shard_size = mics
    if vocab is not None:
        cfg.model.vocab_size = vocab
        cfg.model.padded_vocab_size = padded_vocab_size(vocab, args.make_vocab_size_divisible_by, tp)
    return cfg


def _groups(ctx, layout):
    tp, pp, dp, _, _, mics, _, _, *moe = layout
    ep = moe[0][0] if moe else 1
    return ctx.groups(Topology(world_size=tp * pp * dp, tp=tp, pp=pp, mics_shard_size=mics, ep=ep))


def engine_report_worker(ctx, layout):
    """Pool entry: the engine's memory.report() on this rank for `layout` (None outside it)."""
    from megazero.training import setup

    groups = _groups(ctx, layout)
    if groups is None:
        return None
    return setup(layout_config(layout), groups).engine.memory.report()


def compare(pool, layouts=GRID) -> list[tuple]:
    """[(layout, category, predicted bytes, largest reported bytes)] for every layout and category
    (offloaded ones where either side has bytes)."""
    rows = []
    for layout in layouts:
        reports = [r for r in pool.run(engine_report_worker, layout) if r is not None]
        tp, pp, dp = layout[:3]
        predicted = plan_bytes(layout_config(layout), tp * pp * dp)
        for kind in MODEL_STATE_KINDS + OFFLOAD_CATEGORIES:
            reported = max(r.get(kind, 0) for r in reports)
            if kind in MODEL_STATE_KINDS or predicted[kind] or reported:
                rows.append((layout, kind, predicted[kind], reported))
    return rows


def format_rows(rows) -> str:
    lines = [
        f"{'tp pp dp stage bf16 mics persist offload':<60}{'category':<22}{'predicted':>12}{'reported':>12}{'ratio':>8}"
    ]
    for layout, kind, predicted, reported in rows:
        ratio = f"{predicted / reported:8.3f}" if reported else ("       -" if not predicted else "     inf")
        lines.append(f"{_describe(layout):<60}{kind:<22}{predicted:12.0f}{reported:12d}{ratio}")
    return "\n".join(lines)


def _describe(layout) -> str:
    tp, pp, dp, stage, bf16, mics, persist, offload, *moe = layout
    experts = "".join(f" moe ep {ep} {dispatcher}" for ep, dispatcher in moe)
    return f"{tp:>2} {pp:>2} {dp:>2} {stage:>5} {str(bf16):>5} {mics:>4} {persist:>7}  {offload or '-'}{experts}"


# --- measured peak ------------------------------------------------------------------------------
def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}; the measured peak needs Linux")


def fresh_high_water_mark() -> int:
    """Makes freed memory leave the process and restarts the kernel's peak count; returns the
    resident bytes now (the baseline)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: blocks >= 64 KiB are mapped, unmapped on free
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD: give back the heap's free top at once
    gc.collect()
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    return status_bytes("VmRSS")


def _train(cfg, groups, steps: int) -> None:
    from megazero.data.synthetic import ArithmeticTokens
    from megazero.data.sampler import MicrobatchSource
    from megazero.training import setup, train_step

    state = setup(cfg, groups)
    source = MicrobatchSource(
        ArithmeticTokens(cfg.model.vocab_size, cfg.model.seq_length, seed=3),
        cfg.global_batch_size,
        cfg.micro_batch_size,
        groups.coords.dp,
        groups.topology.dp,
    )
    for it in range(steps):
        train_step(state, source.batch(it), 1e-4)


def measured_peak_worker(ctx, layout, model, vocab: int, steps: int = 2):
    """Pool entry: this rank's peak resident growth over setup and `steps` training steps. The
    layout first trains a step of the small model, so that what a process sets up once (imports,
    the math libraries' workspaces, the communicators' buffers) is not counted."""
    groups = _groups(ctx, layout)
    if groups is None:
        return None
    _train(layout_config(layout), groups, 1)
    base = fresh_high_water_mark()
    _train(layout_config(layout, model, vocab), groups, steps)
    peak = status_bytes("VmHWM") - base
    gc.collect()
    return peak


def planned_process_bytes(plan: dict[str, float]) -> float:
    """What the plan puts in a CPU run's process memory: the device and the host tiers."""
    return device_bytes(plan) + sum(v for k, v in plan.items() if k.startswith("host_"))


def compare_peaks(pool, layouts=GRID, model=PEAK_MODEL, vocab: int = PEAK_VOCAB, steps: int = 2) -> list[tuple]:
    """[(layout, planned process bytes, largest measured peak)] for every layout."""
    rows = []
    for layout in layouts:
        peaks = [p for p in pool.run(measured_peak_worker, layout, model, vocab, steps) if p is not None]
        tp, pp, dp = layout[:3]
        planned = planned_process_bytes(plan_bytes(layout_config(layout, model, vocab), tp * pp * dp))
        rows.append((layout, planned, max(peaks)))
    return rows


# --- the dry run's peak, simulating the CPU ------------------------------------------------------
def dry_run_argv(layout, model, vocab: int, steps: int, workdir: str) -> list[str]:
    """The flags under which tools/dry_run.py runs what measured_peak_worker trains: the layout's,
    the vocabulary, `steps` steps, and its MiCS size and persistence threshold in a DeepSpeed JSON."""
    tp, pp, dp, stage, bf16, mics, persistence, offload, *moe = layout
    argv, ratio = layout_argv(layout, model)
    if ratio is not None:
        raise ValueError("a partial offload's ratio has no pretrain_gpt.py flag; the dry run cannot take it")
    path = os.path.join(workdir, f"ds-{stage}-{mics}-{persistence}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "zero_optimization": {
                    "stage": stage,
                    "stage3_param_persistence_threshold": persistence,
                    "mics_shard_size": mics,
                }
            },
            f,
        )
    return argv + [
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(vocab),
        "--train-iters",
        str(steps),
        "--deepspeed_config",
        path,
    ]


def dry_run_peaks(layouts, model=PEAK_MODEL, vocab: int = PEAK_VOCAB, steps: int = 2, processes=None) -> list[tuple]:
    """[(layout, the dry run's largest process peak over its ranks)]: tools/dry_run.py's simulation
    of a CPU (megazero.dry_run.simulate, device_kind "cpu": the CPU's kernels, device and host bytes
    as one memory, plain bytes; no checkpoint save, which the measured run does not do)."""
    from megazero.dry_run.job import simulate

    rows = []
    with tempfile.TemporaryDirectory(prefix="megazero-plan-dry-") as workdir:
        for layout in layouts:
            world = layout[0] * layout[1] * layout[2]
            runs = simulate(
                dry_run_argv(layout, model, vocab, steps, workdir),
                world,
                processes=processes,
                device_kind="cpu",
                save=False,
            )
            errors = [f"rank {r.rank}: {r.error}" for r in runs if r.error]
            if errors:
                raise RuntimeError(f"dry run of {_describe(layout)} stopped: " + "; ".join(errors))
            rows.append((layout, max(r.memory["process_peak"] for r in runs)))
    return rows


def format_dry_peaks(rows, dry) -> str:
    lines = [f"{'tp pp dp stage bf16 mics persist offload':<60}{'dry run MB':>12}{'measured MB':>13}{'ratio':>8}"]
    for (layout, _, measured), (_, simulated) in zip(rows, dry):
        lines.append(f"{_describe(layout):<60}{simulated / 1e6:12.1f}{measured / 1e6:13.1f}{simulated / measured:8.3f}")
    return "\n".join(lines)


def format_peaks(rows) -> str:
    lines = [f"{'tp pp dp stage bf16 mics persist offload':<60}{'planned MB':>12}{'measured MB':>13}{'ratio':>8}"]
    for layout, planned, measured in rows:
        lines.append(f"{_describe(layout):<60}{planned / 1e6:12.1f}{measured / 1e6:13.1f}{planned / measured:8.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import shutil

    from megazero.testing import DistributedPool

    argv = sys.argv[1:] if argv is None else argv
    pool = DistributedPool(WORLD)
    try:
        print(format_rows(compare(pool)))
        if "--report" not in argv:
            print()
            dense, moe = compare_peaks(pool), compare_peaks(pool, MOE_PEAK_GRID, MOE_PEAK_MODEL)
            print(format_peaks(dense + moe))
            print()
            # the dry run simulating the CPU against the same measured peaks (a partial offload's
            # ratio has no flag: that layout is left out)
            dense = [row for row in dense if ":0." not in row[0][7]]
            print(
                format_dry_peaks(
                    dense + moe,
                    dry_run_peaks([row[0] for row in dense]) + dry_run_peaks([row[0] for row in moe], MOE_PEAK_MODEL),
                )
            )
    finally:
        pool.close()
        shutil.rmtree(SWAP_DIR, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
