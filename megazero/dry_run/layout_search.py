"""Which layout of a model on N ranks of a named device runs fastest (tools/search_layouts.py).

    search(argv, world=8, device="h100", top_k=3) -> {"considered", "valid", "fitting", "dropped", "rows"}

Three passes, cheapest first: every layout (tp, pp, virtual stages, cp, dp, ZeRO stage, recomputation,
micro batch) that megazero's own flag checks accept (megazero.config.train_flags.config_from_args:
the rules are its, not restated here); of those, the ones whose planner total
(megazero.config.memory_estimate, the same formulas as tools/plan_memory.py) fits the device's memory;
those ranked by a closed-form estimate of the step (`first_estimate`), and the best `top_k` run
through the dry run and its timeline (megazero.dry_run.speed) and ordered by the predicted step.
Owns the enumeration and the first estimate; touches no simulation, no timeline, no flag rule.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

from megazero.core.errors import UsageError

# The flags a layout sets: the search chooses them, so the user's argv must leave them out.
LAYOUT_FLAGS = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--context-parallel-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--zero-stage",
    "--micro-batch-size",
    "--recompute-activations",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--sequence-parallel",
    "--data-parallel-size",
)
RECOMPUTE = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int  # model chunks per pipeline stage (1: no interleaving)
    cp: int
    dp: int
    zero: int
    recompute: str  # none, selective (core attention) or full (every layer, uniform groups of 1)
    mbs: int

    def flags(self, num_layers: int) -> list[str]:
        """pretrain_gpt.py's flags for this layout; sequence parallelism rides with tp > 1 (it only
        saves memory and turns each all-reduce into a reduce-scatter plus an all-gather)."""
        out = [
            "--tensor-model-parallel-size",
            str(self.tp),
            "--pipeline-model-parallel-size",
            str(self.pp),
            "--context-parallel-size",
            str(self.cp),
            "--zero-stage",
            str(self.zero),
            "--micro-batch-size",
            str(self.mbs),
        ]
        if self.vpp > 1:
            out += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (self.pp * self.vpp))]
        if self.tp > 1:
            out.append("--sequence-parallel")
        if self.recompute == "selective":
            out.append("--recompute-activations")
        elif self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        return out

    def text(self) -> str:
        v = f" (vpp {self.vpp})" if self.vpp > 1 else ""
        return (
            f"tp {self.tp} pp {self.pp}{v} cp {self.cp} dp {self.dp}, ZeRO-{self.zero}, "
            f"recompute {self.recompute}, micro batch {self.mbs}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def base_args(argv: list[str], world: int):
    """The user's flags parsed once (as a dry run reads them); a layout flag among them is refused."""
    from megazero.dry_run.job import dry_argv
    from megazero.config.train_flags import parse_args

    given = [f for f in argv if f.split("=")[0] in LAYOUT_FLAGS]
    if given:
        raise UsageError(f"{given[0]}: the search chooses the layout; drop {', '.join(given)} from the flags")
    if world < 1:
        raise UsageError(f"--world-size must be >= 1, got {world}")
    return parse_args(dry_argv(argv, "/nonexistent", save=False))


def enumerate_layouts(
    args,
    world: int,
    local_world: int,
    zero_stages=(0, 1, 2, 3),
    recompute=RECOMPUTE,
    micro_batches=(1, 2, 4, 8),
    virtual=(1, 2, 4),
) -> list[tuple[Layout, object]]:
    """Every (Layout, TrainConfig) of `world` ranks that config_from_args accepts, from the parsed
    base `args`. `virtual`: model chunks per stage tried (interleaving needs pp > 1 and the stage's
    layers to divide)."""
    from megazero.config.train_flags import config_from_args

    layers = args.num_layers
    found = []
    for tp, pp, cp in itertools.product(_divisors(world), repeat=3):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        for vpp, zero, how, mbs in itertools.product(virtual, zero_stages, recompute, micro_batches):
            if vpp > 1 and (pp == 1 or layers % (pp * vpp)):
                continue  # no interleaving to ask for: the flag could not name it
            layout = Layout(tp, pp, vpp, cp, dp, zero, how, mbs)
            trial = copy.copy(args)
            trial.tensor_model_parallel_size, trial.pipeline_model_parallel_size = tp, pp
            trial.context_parallel_size, trial.zero_stage, trial.micro_batch_size = cp, zero, mbs
            trial.num_layers_per_virtual_pipeline_stage = layers // (pp * vpp) if vpp > 1 else 0
            trial.sequence_parallel = tp > 1
            trial.recompute_activations = how == "selective"
            trial.recompute_granularity, trial.recompute_method, trial.recompute_num_layers = (
                ("full", "uniform", 1) if how == "full" else (None, None, None)
            )
            try:
                cfg = config_from_args(trial, world, local_world, cuda_available=True)
            except UsageError:
                continue  # megazero refuses it: the model, batch or world does not divide so
            found.append((layout, cfg))
    return found


def capacity_bytes(device, world: int) -> float:
    """What one rank may hold: a GPU's memory; the CPU's memory shared by the job's ranks."""
    total = device.memory_gb * 1e9
    return total / world if device.kind == "cpu" else total


def planner_total(cfg, world: int) -> float:
    from megazero.config.memory_estimate import device_bytes, plan_bytes

    return device_bytes(plan_bytes(cfg, world))


def split_by_fit(valid, world: int, capacity: float) -> tuple[list, list]:
    """(fitting, dropped): each (layout, cfg, planner total) of `valid`, by whether the planner's
    device total fits in `capacity` bytes."""
    fitting, dropped = [], []
    for layout, cfg in valid:
        total = planner_total(cfg, world)
        (fitting if total <= capacity else dropped).append((layout, cfg, total))
    return fitting, dropped


def first_estimate(layout: Layout, cfg, world: int, device) -> float:
    """A closed-form step time (seconds) to rank layouts before any dry run: the rank's model FLOPs
    with what recomputation adds (megazero.training.flops) at the device's GEMM rate for the layer's GEMM
    shape, the attention core apart: a fused kernel's FLOPs at the rate of its (rows, sequence, head
    dim) shape, ring attention's (cp > 1, --cp-comm-type p2p) by `ring_attention_seconds`; stretched by the pipeline bubble (pp - 1) / (microbatches x chunks); plus, counted exposed, the
    tensor-parallel collectives (4 a layer a microbatch, 6 recomputed), context parallelism's key and
    value gathers, and the data-parallel gradient reduction (ZeRO-3: with two parameter gathers a
    microbatch). Only an order: the dry run's timeline is the prediction."""
    from megazero.training.flops import attention_flops_per_token, recompute_flops, step_flops
    from megazero.dry_run.speed import _dtype

    m = cfg.model
    dtype = _dtype(cfg)
    width = 2 if dtype in ("bf16", "fp16") else 4
    tokens = cfg.global_batch_size * m.seq_length
    chunks = [m.num_layers // (layout.pp * layout.vpp)] * (layout.pp * layout.vpp)
    flops = (step_flops(m, tokens) + recompute_flops(m, tokens, chunks)) / world
    rows = layout.mbs * m.seq_length // layout.cp
    micro = cfg.global_batch_size // (layout.mbs * layout.dp)
    forwards = 1 if layout.recompute == "none" else 2  # both recomputations run the core again
    core_flops = (2 + forwards) * m.num_layers * attention_flops_per_token(m) * tokens / world
    if layout.cp > 1 and cfg.parallel.cp_comm_type == "p2p":
        core = micro * (m.num_layers // layout.pp) * ring_attention_seconds(cfg, layout, device, forwards)
    else:  # a fused (flash) kernel, which the timeline rates by its smallest dim: the head's
        core = device.matmul_seconds(core_flops, 0.0, dtype, (rows, m.seq_length, m.head_dim))
    compute = device.matmul_seconds(flops - core_flops, 0.0, dtype, (rows, m.hidden_size // layout.tp, m.hidden_size))
    compute += core
    compute *= 1 + (layout.pp - 1) / (micro * layout.vpp)
    layers = m.num_layers // layout.pp
    activation = rows * m.hidden_size * width
    comm = 0.0
    if layout.tp > 1:
        calls = 6 if layout.recompute == "full" else 4
        comm += micro * layers * calls * device.collective_seconds("all_reduce", activation, range(layout.tp))
    if layout.cp > 1:
        heads = m.num_query_groups or m.num_attention_heads
        kv = 2 * rows * heads * (m.kv_channels or m.hidden_size // m.num_attention_heads) * width
        comm += micro * layers * 3 * device.collective_seconds("all_gather", kv * layout.cp, range(layout.cp))
    if layout.dp > 1:
        from megazero.config.memory_estimate import rank_layout

        grads = rank_layout(cfg, world).rank_parameters * width
        group = range(layout.dp)
        comm += device.collective_seconds("all_reduce" if layout.zero == 0 else "reduce_scatter", grads, group)
        if layout.zero in (1, 2):
            comm += device.collective_seconds("all_gather", grads, group)
        if layout.zero == 3:
            comm += 2 * micro * device.collective_seconds("all_gather", grads, group)
    return compute + comm


# Ring attention's block kernel (parallel/ring_attention.py) is the attention math written out in
# fp32 (no fused kernel on any device): per block of E scores (batch x heads x query rows x key
# columns) the forward runs two fp32 bmm, 4 d E FLOPs, and streams the fp32 scores 7 times (x scale
# 2, logsumexp 1, minus the LSE 2, exp 2); the backward five bmm, 10 d E, and 11 passes (x scale 2,
# minus the LSE 2, exp 2, minus delta 2, times the probabilities 3). Counted from the code: what it
# leaves out (the diagonal block's mask, GQA's K/V copies) is under 20% of the passes and under 5%
# of the core's time (tests/dry_run/test_layout_search.py times the code's own kernels against it).
RING_FORWARD = (4, 7)  # (FLOPs / (d E), fp32 passes over E)
RING_BACKWARD = (10, 11)


def ring_attention_seconds(cfg, layout: Layout, device, forwards: int = 1) -> float:
    """One layer's ring attention core on one rank for one microbatch: `forwards` forwards (2 with
    recomputation) and one backward. With N = cp and c = seq / 2N, the rank's step 0 is its 2c x 2c
    diagonal block (masked, computed whole) and each of the N - 1 later steps half a block, 2c x c:
    E = micro x heads / tp x 2c^2 (N + 1). The bmm at the device's fp32 rate for a (2c, c, d) GEMM."""
    m = cfg.model
    n, chunk, d = layout.cp, m.seq_length // (2 * layout.cp), m.head_dim
    scores = layout.mbs * (m.num_attention_heads // layout.tp) * 2 * chunk * chunk * (n + 1)

    def part(flops_per, passes):
        return device.matmul_seconds(
            flops_per * d * scores, 0.0, "fp32", (2 * chunk, chunk, d)
        ) + device.memory_seconds(passes * 4 * scores)

    return forwards * part(*RING_FORWARD) + part(*RING_BACKWARD)


def ranked(fitting, world: int, device) -> list:
    """`fitting` by the first estimate, the least memory first among equal estimates, and of those
    only that one: layouts the estimate cannot tell apart (a ZeRO stage at dp 1, selective
    recomputation where attention is cheap) would spend the dry runs on one answer."""
    keyed = sorted(
        ((first_estimate(layout, cfg, world, device), total, i) for i, (layout, cfg, total) in enumerate(fitting))
    )
    out, seen = [], set()
    for estimate, _, i in keyed:
        if round(estimate, 12) not in seen:
            seen.add(round(estimate, 12))
            out.append(fitting[i])
    return out


def predicted(argv: list[str], world: int, device, local_world: int, processes: int | None = None) -> dict:
    """The dry run of `argv` and its timeline on `device` (megazero.dry_run.speed.timeline_of), with
    the fullest simulated rank's reserved peak (the caching allocator's; the CPU: its peak)."""
    from megazero.dry_run.job import job_config, simulate
    from megazero.dry_run.speed import timeline_of

    runs = simulate(
        argv,
        world,
        None,
        local_world=local_world,
        processes=processes,
        device_kind="cpu" if device.kind == "cpu" else "cuda",
        save=False,
    )
    failed = [f"rank {r.rank}: {r.error}" for r in runs if r.error is not None]
    if failed:
        return {"error": "the dry run failed: " + "; ".join(failed)}
    timeline = timeline_of(runs, job_config(argv, world, local_world), world, device)
    peak = max((r.memory.get("reserved_peak") or r.memory["peak"]) for r in runs if r.memory)
    return {"error": timeline["note"], "timeline": timeline, "peak": peak}


def search(
    argv: list[str],
    world: int,
    device,
    top_k: int = 3,
    local_world: int | None = None,
    processes: int | None = None,
    **space,
) -> dict:
    """The fastest layouts of pretrain_gpt.py's model flags `argv` on `world` ranks of `device` (a
    --gpu name or a devices.Device); `space`: enumerate_layouts's choices. Rows: the `top_k` best by
    the first estimate, ordered by their predicted step time, each {"layout", "flags", "estimate_s",
    "planner_bytes", "capacity", "step_s", "tokens_per_s_per_device", "mfu", "peak", "error"}."""
    from megazero.dry_run import devices

    if isinstance(device, str):
        device = devices.device(device)
    if top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {top_k}")
    local = local_world or (min(world, device.gpus_per_node) if device.kind == "gpu" else world)
    args = base_args(argv, world)
    valid = enumerate_layouts(args, world, local, **space)
    if not valid:
        raise UsageError(
            f"no layout of {world} ranks divides this model and batch (--num-layers, "
            f"--num-attention-heads, --seq-length, --global-batch-size); change one or --world-size"
        )
    capacity = capacity_bytes(device, world)
    fitting, dropped = split_by_fit(valid, world, capacity)
    rows = []
    for layout, cfg, total in ranked(fitting, world, device)[:top_k]:
        flags = list(argv) + layout.flags(args.num_layers)
        found = predicted(flags, world, device, local, processes)
        tl = found.get("timeline") or {}
        ranks = tl.get("ranks") or []
        rows.append(
            {
                "layout": layout,
                "flags": layout.flags(args.num_layers),
                "estimate_s": first_estimate(layout, cfg, world, device),
                "planner_bytes": total,
                "capacity": capacity,
                "step_s": tl.get("step_s"),
                "tokens_per_s_per_device": tl.get("tokens_per_s_per_device"),
                "mfu": min((r["mfu"] for r in ranks if r["mfu"] is not None), default=None),
                "peak": found.get("peak"),
                "error": found.get("error"),
            }
        )
    # a layout whose dry-run peak exceeds the device (the planner let it through) goes after those that fit
    rows.sort(key=lambda row: (row["step_s"] is None, _over(row), row["step_s"] or 0.0))
    return {
        "device": device.key,
        "device_name": device.name,
        "world": world,
        "considered": len(valid),
        "fitting": len(fitting),
        "dropped": [(layout, total) for layout, _, total in dropped],
        "rows": rows,
    }


def _over(row: dict) -> bool:
    return row.get("peak") is not None and row["peak"] > row["capacity"]


def search_text(result: dict) -> str:
    """The lines tools/search_layouts.py prints."""
    GiB = 2**30
    if not result["rows"]:
        layout, total = min(result["dropped"], key=lambda item: item[1])
        return (
            f"none of the {result['considered']} valid layouts of {result['world']} ranks fits the "
            f"{result['device_name']} by the planner; the smallest needs {total / GiB:,.2f} GiB a rank "
            f"({layout.text()}): more ranks, or a device with more memory"
        )
    lines = [
        f"{result['considered']} valid layouts of {result['world']} ranks, {result['fitting']} fit the "
        f"{result['device_name']} by the planner; the best {len(result['rows'])} by the first estimate, "
        f"timed by the dry run, fastest first:"
    ]
    for i, row in enumerate(result["rows"], 1):
        if row["step_s"] is None:
            lines.append(f"{i}. {row['layout'].text()}: no prediction ({row['error']})")
            continue
        peak = f"{row['peak'] / GiB:,.2f}" if row["peak"] is not None else "-"
        lines.append(
            f"{i}. {row['layout'].text()}: step {1000 * row['step_s']:,.1f} ms, "
            f"{row['tokens_per_s_per_device']:,.0f} tokens/s/device, MFU {row['mfu']:.1%}, "
            f"peak {peak} of {row['capacity'] / GiB:,.2f} GiB (planner {row['planner_bytes'] / GiB:,.2f}); "
            f"first estimate {1000 * row['estimate_s']:,.1f} ms"
            + ("; does NOT fit: the dry run's peak exceeds the device" if _over(row) else "")
        )
        lines.append("   " + " ".join(row["flags"]))
    return "\n".join(lines)
