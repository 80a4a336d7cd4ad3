"""Megatron-LM's housekeeping, logging, profiling and batch-ramp flags: their parser entries and
their meaning as RunOptions / BatchRamp, checked at the edge before any process group. Flags that
can mean nothing in megazero are accepted here with one note each saying why.

Megatron's rules kept: --manual-gc-interval counts only with --manual-gc; --profile traces the
steps [--profile-step-start, --profile-step-end) on --profile-ranks (default rank 0);
--rampup-batch-size START INCREMENT SAMPLES needs (global batch - START) to be a whole number of
INCREMENTs and every batch of the ramp to split into micro batch x data-parallel size.
"""

from __future__ import annotations

from megazero.config.batch_ramp import BatchRamp
from megazero.config.train_config import RunOptions
from megazero.core.errors import UsageError

# Accepted flags that change nothing here: flag -> why.
NOTED = {
    "use_mcore_models": "--use-mcore-models has no effect: megazero has one model code path",
    "no_masked_softmax_fusion": "--no-masked-softmax-fusion has no effect: megazero's attention uses no "
    "masked-softmax kernel (--attention-backend chooses the attention)",
    "no_create_attention_mask_in_dataloader": "--no-create-attention-mask-in-dataloader has no effect: "
    "megazero's data loader never builds attention masks (attention is causal)",
    "log_throughput": "--log-throughput has no effect: throughput (tokens/s, TFLOP/s per device) is always logged",
    "no_mmap_bin_files": None,  # its own note: it changes how .bin files are read, see data_notes
}


def add_run_flags(g, add) -> None:
    """The flags of this module, added to argument group `g` with `add` (flags._add)."""
    add(
        g,
        "--manual-gc",
        action="store_true",
        help="turn Python's automatic garbage collection off; collect at the same steps on every rank",
    )
    add(
        g,
        "--manual-gc-interval",
        type=int,
        default=0,
        help="with --manual-gc: collect every N steps; 0: only around evaluations",
    )
    add(
        g,
        "--empty-unused-memory-level",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="give the allocator's cached memory back after backward (1), and after the step too (2)",
    )
    add(g, "--log-params-norm", action="store_true", help="log the L2 norm of the parameters")
    add(g, "--log-num-zeros-in-grad", action="store_true", help="log the number of zero gradient elements")
    add(
        g,
        "--log-timers-to-tensorboard",
        action="store_true",
        help="time the phases of each step and send them to TensorBoard (turns wall_clock_breakdown on)",
    )
    add(g, "--log-throughput", action="store_true", help="accepted: throughput is always logged")
    add(
        g,
        "--profile",
        action="store_true",
        help="write a torch.profiler trace (<run-dir>/profile/rank<R>.pt.trace.json) of the chosen steps",
    )
    add(g, "--profile-step-start", type=int, default=10, help="first step traced (steps done before it)")
    add(g, "--profile-step-end", type=int, default=12, help="tracing stops before this step")
    add(g, "--profile-ranks", type=int, nargs="+", default=[0], help="global ranks that trace")
    add(
        g,
        "--straggler-threshold",
        type=float,
        default=0.2,
        help="at each log line name a rank whose forward + backward + step time over the interval is "
        "more than this fraction above the median rank's; 0: off",
    )
    add(g, "--use-mcore-models", action="store_true", help="accepted: megazero has one model code path")
    add(g, "--no-masked-softmax-fusion", action="store_true", help="accepted: no masked-softmax kernel here")
    add(
        g,
        "--rampup-batch-size",
        type=int,
        nargs=3,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START by INCREMENT over the first SAMPLES samples",
        shown="none",
    )


def run_options(args, world_size: int, notes: list[str]) -> RunOptions:
    """RunOptions from the flags; notes appended for the flags accepted without effect."""
    if args.manual_gc_interval < 0:
        raise UsageError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.manual_gc_interval and not args.manual_gc:
        raise UsageError("--manual-gc-interval needs --manual-gc (Python's automatic collector is on otherwise)")
    if args.profile:
        if not 0 <= args.profile_step_start < args.profile_step_end:
            raise UsageError(
                f"--profile-step-start {args.profile_step_start} must be >= 0 and before "
                f"--profile-step-end {args.profile_step_end}"
            )
        outside = [r for r in args.profile_ranks if not 0 <= r < world_size]
        if outside:
            raise UsageError(
                f"--profile-ranks {outside[0]} is not a rank of this {world_size}-rank run; "
                f"give ranks 0..{world_size - 1}"
            )
    if not 0 <= args.straggler_threshold < float("inf"):
        raise UsageError(
            f"--straggler-threshold must be a fraction >= 0 (0.2: 20% slower than the median; "
            f"0: off), got {args.straggler_threshold}"
        )
    if args.max_consecutive_skipped_steps < 0:
        raise UsageError(
            f"--max-consecutive-skipped-steps must be >= 0 (0: never stop for skipped steps), "
            f"got {args.max_consecutive_skipped_steps}"
        )
    if args.num_workers < 0:
        raise UsageError(f"--num-workers must be >= 0, got {args.num_workers}")
    for attr, note in NOTED.items():
        if note and getattr(args, attr, False):
            notes.append(note)
    return RunOptions(
        manual_gc=args.manual_gc,
        manual_gc_interval=args.manual_gc_interval,
        empty_unused_memory_level=args.empty_unused_memory_level,
        log_params_norm=args.log_params_norm,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        log_timers_to_tensorboard=args.log_timers_to_tensorboard,
        profile=args.profile,
        profile_step_start=args.profile_step_start,
        profile_step_end=args.profile_step_end,
        profile_ranks=list(args.profile_ranks),
        num_workers=args.num_workers,
        straggler_threshold=args.straggler_threshold,
        check_for_nan=args.check_for_nan_in_loss_and_grad,
        max_consecutive_skipped_steps=args.max_consecutive_skipped_steps,
    )


def batch_ramp(args, global_batch: int, micro: int, dp: int) -> BatchRamp | None:
    """--rampup-batch-size as a BatchRamp, or None without it."""
    if args.rampup_batch_size is None:
        return None
    start, increment, samples = args.rampup_batch_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if start < 1 or increment < 1 or samples < 1:
        raise UsageError(f"{flag}: START, INCREMENT and SAMPLES must be >= 1")
    if start >= global_batch:
        raise UsageError(
            f"{flag}: START must be below --global-batch-size {global_batch} (the batch it "
            f"ramps up to); remove the flag for a constant batch"
        )
    if (global_batch - start) % increment:
        raise UsageError(
            f"{flag}: --global-batch-size {global_batch} - START = {global_batch - start} is not "
            f"a multiple of INCREMENT {increment}"
        )
    for size in range(start, global_batch, increment):
        if size % (micro * dp):
            raise UsageError(
                f"{flag}: the ramp's batch {size} does not split into micro batch {micro} x "
                f"data-parallel size {dp} = {micro * dp}; choose START and INCREMENT multiples "
                f"of {micro * dp}"
            )
    return BatchRamp(start=start, increment=increment, samples=samples, global_batch=global_batch)
