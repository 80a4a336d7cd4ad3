"""Per-rank memory of a training run before running it, and the cheapest layout that fits.

    python tools/plan_memory.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --world-size 8 --tensor-model-parallel-size 2 --zero-stage 3 --bf16
    python tools/plan_memory.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --world-size 8 --bf16 --fit-gib 20

Takes pretrain_gpt.py's own flags (megazero.config.flags.build_parser) plus --world-size and --fit-gib, builds
the run's config the way the driver does, and prints one rank's bytes by category from
megazero.config.memory_estimate: the same formulas as the ZeRO engine's memory report for the model states
(parameters, gradients, fp32 master, optimizer states), plus the activation and communication-buffer
estimates. For the largest pipeline stage, the rank that runs out first.

With offload flags (--zero-offload-optimizer, --zero-offload-param) the offloaded master, optimizer
states and parameters are printed apart, as host memory or disk bytes, with the optimizer's host
staging; the device total leaves them out.

--fit-gib X searches every layout of --world-size ranks (tensor and pipeline sizes the model divides
into, ZeRO stages 0-3, full recomputation off/on; the given micro and global batch) and prints the
cheapest whose device total fits in X GiB. "Cheapest" orders by what each choice costs in time, largest first:
recomputation (a third more compute), then model-parallel degree tp x pp (per-layer all-reduces,
the pipeline bubble), then pipeline over tensor size, then ZeRO stage (stage 3 moves 1.5x the bytes of
0-2; 1 and 2 cost no more than 0).
"""

from __future__ import annotations

import argparse
import copy
import sys

from megazero.config.train_flags import config_from_args
from megazero.core.errors import UsageError
from megazero.config.flags import build_parser
from megazero.config.memory_estimate import (
    DEVICE_CATEGORIES,
    GIB,
    OFFLOAD_CATEGORIES,
    device_bytes,
    plan_bytes,
    rank_layout,
)

LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "master": "fp32 master",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "comm_buffers": "buffers (comm, transient)",
    "host_params": "parameters",
    "nvme_params": "parameters",
    "host_master": "fp32 master",
    "host_optimizer_states": "optimizer states",
    "nvme_master": "fp32 master",
    "nvme_optimizer_states": "optimizer states",
    "host_offload_buffers": "offload staging",
    "host_activations": "activations (offload)",
}


def _parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "plan_memory.py"
    p.description = "Per-rank memory of a megazero run by category; --fit-gib finds a layout that fits."
    g = p.add_argument_group("planner")
    g.add_argument("--world-size", type=int, default=1, help="ranks in the run (default: 1)")
    g.add_argument(
        "--fit-gib",
        type=float,
        default=None,
        help="find the cheapest layout of --world-size ranks within this many GiB per rank",
    )
    return p


def parse(argv) -> argparse.Namespace:
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        raise UsageError(f"unrecognized argument {extras[0]}; python tools/plan_memory.py --help lists every flag")
    if args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {args.world_size}")
    if args.fit_gib is not None and args.fit_gib <= 0:
        raise UsageError(f"--fit-gib must be > 0, got {args.fit_gib:g}")
    return args


def describe_layout(cfg, world_size: int) -> str:
    par = cfg.parallel
    dp = world_size // (par.tensor_parallel * par.pipeline_parallel)
    return (
        f"tp {par.tensor_parallel} x pp {par.pipeline_parallel} x dp {dp}, ZeRO stage {cfg.zero.stage}, "
        f"micro batch {cfg.micro_batch_size}, recompute {_recompute_text(cfg.model)}"
    )


def _recompute_text(model) -> str:
    if model.recompute_granularity == "full":
        return f"full ({model.recompute_method}, {model.recompute_num_layers} layers)"
    return "selective" if model.recompute_granularity == "selective" else "off"


def format_plan(cfg, world_size: int) -> str:
    found = plan_bytes(cfg, world_size)
    r = rank_layout(cfg, world_size)
    lines = [
        f"layout: {describe_layout(cfg, world_size)}",
        f"model: {r.parameters / 1e6:.2f}M parameters, {r.rank_parameters / 1e6:.2f}M on the largest "
        f"rank before ZeRO, {r.shards} ZeRO shard(s)",
    ]
    for key in DEVICE_CATEGORIES:
        lines.append(f"  {LABELS[key]:<22} {found[key] / GIB:10.3f} GiB")
    lines.append(f"  {'total':<22} {device_bytes(found) / GIB:10.3f} GiB per rank on the device")
    for where, prefix in (("host memory", "host_"), ("disk (nvme_path)", "nvme_")):
        keys = [key for key in OFFLOAD_CATEGORIES if key.startswith(prefix) and found[key]]
        if keys:
            lines.append(f"offloaded to {where}:")
            lines += [f"  {LABELS[key]:<22} {found[key] / GIB:10.3f} GiB" for key in keys]
            lines.append(f"  {'total':<22} {sum(found[k] for k in keys) / GIB:10.3f} GiB per rank")
    return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_configs(args: argparse.Namespace) -> list:
    """Every valid layout of args.world_size ranks, cheapest first (the order in the docstring)."""
    found = []
    for tp in _divisors(args.world_size):
        for pp in _divisors(args.world_size // tp):
            for stage in range(4):
                for recompute in (False, True):
                    trial = copy.copy(args)
                    trial.tensor_model_parallel_size, trial.pipeline_model_parallel_size = tp, pp
                    trial.zero_stage, trial.recompute_activations = stage, False
                    # on: every layer recomputed whole, the most memory recomputation saves
                    trial.recompute_granularity, trial.recompute_method, trial.recompute_num_layers = (
                        ("full", "uniform", 1) if recompute else (None, None, None)
                    )
                    try:
                        cfg = config_from_args(trial, args.world_size)
                    except UsageError:
                        continue  # the model or batch does not divide this way
                    found.append(((recompute, tp * pp, pp, stage), cfg))
    return [cfg for _, cfg in sorted(found, key=lambda item: item[0])]


def fit(args: argparse.Namespace) -> tuple[object | None, list]:
    """(the cheapest config within args.fit_gib, every candidate with its total), or None first."""
    limit = args.fit_gib * GIB
    totals = [(cfg, device_bytes(plan_bytes(cfg, args.world_size))) for cfg in candidate_configs(args)]
    if not totals:
        raise UsageError(
            f"no layout of --world-size {args.world_size} divides this model and batch; "
            f"change --world-size or --global-batch-size"
        )
    return next((cfg for cfg, total in totals if total <= limit), None), totals


def main(argv=None) -> int:
    try:
        args = parse(argv)
        if args.fit_gib is None:
            print(format_plan(config_from_args(args, args.world_size), args.world_size))
            return 0
        best, totals = fit(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if best is None:
        cfg, total = min(totals, key=lambda item: item[1])
        print(
            f"no layout of {args.world_size} rank(s) fits in {args.fit_gib:g} GiB; the smallest needs "
            f"{total / GIB:.3f} GiB per rank ({describe_layout(cfg, args.world_size)})"
        )
        return 1
    print(f"cheapest layout within {args.fit_gib:g} GiB per rank ({len(totals)} considered):")
    print(format_plan(best, args.world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
