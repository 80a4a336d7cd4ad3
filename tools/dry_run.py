"""Every rank of an N-GPU job on this CPU: do the ranks agree on their collectives, do their sends
meet receives, does every tensor sit on the device (docs/dry_run.md).

    python tools/dry_run.py --world-size 8 --num-layers 4 --hidden-size 256 --num-attention-heads 8 \\
        --seq-length 512 --micro-batch-size 1 --global-batch-size 16 --train-iters 2 \\
        --tensor-model-parallel-size 2 --zero-stage 3 --bf16
    python tools/dry_run.py --world-size 8 --ranks 0,7 --json report.json ...

Takes pretrain_gpt.py's flags plus --world-size (the job's ranks), --ranks (simulate only these;
default all up to 64 ranks, above that one rank per role: megazero.dry_run.roles), --ranks-per-node-sim (a node's GPUs; default 8), --processes (worker processes;
default the CPU count), --json PATH ('-': stdout), --force-overflow STEPS (the gradient norm reads
inf in these training steps, from 1: every rank walks the step-skip path), --no-stream-check (the
stream layer unchecked: about 40% less time), --every-microbatch (simulate every microbatch of the
step; by default a step of many microbatches is simulated at two small counts and its steady state
counted as often as the schedule repeats it: megazero.dry_run.steady_state), --simulate-device cuda|cpu (the device whose
kernels and memory the meta device stands for; default cuda, cpu under --gpu cpu) and
--gpu a100|h100|h200|cpu (after the table, whether each rank's reserved peak fits that GPU's memory,
and for the fullest rank by how much and the flags that lower it: megazero.dry_run.fits; then the
timeline of the last training step on that device: per rank the step time, MFU, compute / exposed
communication / bubble / host time and the most exposed ops with their call sites,
megazero.dry_run.speed; cpu: this CPU as bench/calibrate_cpu.py measured it). Each simulated rank runs the real
recipe with the meta device for its GPU, torch's fake process group for NCCL and the stream layer
in its checking mode (megazero.dry_run.job); mock data
is used unless --data-path is given, and a checkpoint is saved (its collectives only) at the end.
Under a zero-bubble --pipeline-schedule the table is followed by the schedule's list of actions per
stage, its ideal idle fraction and each stage's peak of held microbatches.

Exit 0: every check passed; 2: a flag mistake, a disagreement, a misplaced tensor or a stream race,
each one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path


ALL_RANKS_UP_TO = 64
GPUS = Path(__file__).resolve().parents[1] / "megazero" / "dry_run" / "gpus.toml"


def parser() -> argparse.ArgumentParser:
    # add_help=False: every flag it does not know is pretrain_gpt.py's; --help is answered in main
    ours = argparse.ArgumentParser(
        prog="tools/dry_run.py",
        add_help=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is pretrain_gpt.py's (python pretrain_gpt.py --help).",
    )
    ours.add_argument("--world-size", type=int, required=True)
    ours.add_argument("--ranks", default=None, help="comma-separated ranks to simulate (default: all)")
    ours.add_argument("--ranks-per-node-sim", type=int, default=8)
    ours.add_argument("--processes", type=int, default=None)
    ours.add_argument("--json", default=None)
    ours.add_argument("--no-stream-check", action="store_true")
    ours.add_argument(
        "--force-overflow", default=None, help="comma-separated training steps (from 1) whose gradient norm reads inf"
    )
    ours.add_argument("--simulate-device", choices=["cuda", "cpu"], default=None)
    ours.add_argument(
        "--every-microbatch",
        action="store_true",
        help="simulate every microbatch of the step (default: the steady state's once, counted "
        "as often as the schedule runs it: megazero.dry_run.steady_state)",
    )
    with GPUS.open("rb") as f:
        names = sorted(tomllib.load(f)) + ["cpu"]
    ours.add_argument(
        "--gpu",
        choices=names,
        default=None,
        help="after the table: does each rank's reserved peak fit this GPU's memory, and the "
        "step's timeline on it (cpu: this CPU's measured model)",
    )
    return ours


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(parser().format_help())
        return 0
    opts, train_argv = parser().parse_known_args(argv)
    from megazero.dry_run.job import check_flags, job_config, simulate
    from megazero.dry_run.roles import representatives
    from megazero.dry_run.cross_rank_checks import check_all
    from megazero.dry_run.report import report, schedule_text, table

    world, local = opts.world_size, min(opts.world_size, opts.ranks_per_node_sim)
    mistake = check_flags(train_argv, world, local)
    if mistake is None and opts.ranks is not None:
        try:
            ranks = sorted({int(r) for r in opts.ranks.split(",")})
        except ValueError:
            ranks = [-1]
        if any(r < 0 or r >= world for r in ranks):
            mistake = f"--ranks {opts.ranks}: give comma-separated ranks between 0 and {world - 1}"
    overflow = ()
    if mistake is None and opts.force_overflow is not None:
        try:
            overflow = tuple(sorted({int(s) for s in opts.force_overflow.split(",")}))
        except ValueError:
            overflow = (0,)
        if any(s < 1 for s in overflow):
            mistake = f"--force-overflow {opts.force_overflow}: give comma-separated training steps, from 1"
    simulated = opts.simulate_device or ("cpu" if opts.gpu == "cpu" else "cuda")
    if mistake is None and opts.gpu is not None and simulated != ("cpu" if opts.gpu == "cpu" else "cuda"):
        mistake = (
            f"--gpu {opts.gpu} with --simulate-device {opts.simulate_device}: the timeline needs the "
            f"device it times simulated (drop --simulate-device)"
        )
    device = None
    if mistake is None and opts.gpu is not None:
        from megazero.core.errors import UsageError
        from megazero.dry_run.devices import device as device_model

        try:
            device = device_model(opts.gpu)
        except UsageError as err:
            mistake = str(err)
    if mistake is not None:
        print(f"error: {mistake}", file=sys.stderr)
        return 2
    stands_for = None
    if opts.ranks is None and world > ALL_RANKS_UP_TO:  # one rank per role (megazero.dry_run.roles)
        stands_for = representatives(job_config(train_argv, world, local), world)
        ranks = sorted(stands_for)
    elif opts.ranks is None:
        ranks = None
    from megazero.dry_run.steady_state import Plan, plan

    cfg = job_config(train_argv, world, local)
    steps = plan(cfg, world, train_argv)
    if opts.every_microbatch:
        steps = Plan(
            steps.microbatches,
            steps.schedule,
            note=f"every one of its {steps.microbatches} microbatches a step simulated (--every-microbatch)",
        )
    started = time.perf_counter()
    runs = simulate(
        train_argv,
        world,
        ranks,
        local_world=local,
        processes=opts.processes,
        overflow_steps=overflow,
        stream_check=not opts.no_stream_check,
        device_kind=simulated,
        plan=steps,
    )
    problems = check_all(runs)
    result = report(runs, problems, world, time.perf_counter() - started, stands_for, steps.record())
    if opts.gpu is not None and opts.gpu != "cpu":
        from megazero.dry_run.fits import verdict

        result["gpu"] = verdict(result, opts.gpu, job_config(train_argv, world, local))
    if device is not None:
        from megazero.dry_run.speed import timeline_of

        result["timeline"] = timeline_of(runs, job_config(train_argv, world, local), world, device)
    if opts.json == "-":
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(table(result))
        if result["gpu"] is not None:
            from megazero.dry_run.fits import verdict_text

            print("\n" + verdict_text(result["gpu"]))
        if result.get("timeline") is not None:
            from megazero.dry_run.speed import timeline_text

            print("\n" + timeline_text(result["timeline"]))
        lists = schedule_text(job_config(train_argv, world, local), world)
        if lists is not None:
            print("\n" + lists)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(result, f, indent=1)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
