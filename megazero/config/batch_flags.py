"""The flags of the batch and the run's length (micro and global batch with a DeepSpeed config's
sizes, --train-iters / --train-samples, Megatron's sample counts) and the pipeline schedule's
checks, for megazero.config.train_flags. Each check raises a UsageError naming what the user wrote
(the flag, or the config file and key) and the fix."""

from __future__ import annotations

from megazero.config.deepspeed_blocks import DeepSpeedSettings
from megazero.core.errors import UsageError
from megazero.parallel.topology import Topology
from megazero.parallel.pipeline.zero_bubble import ZERO_BUBBLE_SCHEDULES, check_shape

DEFAULT_TRAIN_ITERS = 200


def positive(value: int, flag: str) -> int:
    if value is None or value < 1:
        raise UsageError(f"{flag} must be >= 1, got {value}")
    return value


def train_iters(args, glob: int, ramp=None) -> int:
    """--train-iters, or Megatron's --train-samples counted in global batches (with a batch ramp, in
    Megatron's way: the ramp's steps, then whole global batches)."""
    if args.train_samples is None:
        return positive(DEFAULT_TRAIN_ITERS if args.train_iters is None else args.train_iters, "--train-iters")
    if args.train_iters is not None:
        raise UsageError("--train-iters and --train-samples are both set; choose one")
    if ramp is not None:
        return positive(ramp.train_iters(args.train_samples), "--train-samples (in iterations)")
    if args.train_samples < glob:
        raise UsageError(
            f"--train-samples {args.train_samples} is less than one global batch ({glob} "
            f"samples); raise it or lower --global-batch-size"
        )
    return args.train_samples // glob


def in_iterations(samples: int | None, flag: str, glob: int) -> int | None:
    """Megatron's sample counts (--lr-decay-samples, ...) in optimizer steps of `glob` samples."""
    if samples is None:
        return None
    if samples and samples < glob:
        raise UsageError(
            f"{flag} {samples} is less than one global batch ({glob} samples); raise it or count in iterations"
        )
    return samples // glob


def batch_from(args, ds: DeepSpeedSettings | None) -> str | None:
    """The DeepSpeed config's flag and file when it set a batch size the flags did not."""
    keys = {
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size,
        "gradient_accumulation_steps": None,
    }
    if ds and any(name in ds.values and flag_value is None for name, flag_value in keys.items()):
        return f"{args.zero_config_flag} {args.zero_config}"
    return None


def global_batch(args, micro: int, glob: int | None, dp: int, ds: DeepSpeedSettings | None) -> int:
    """The global batch; a mismatch names each number as the user gave it (flag, or key and file)."""

    def named(name: str, flag: str, value) -> str:
        if flag and getattr(args, name, None) is not None or not (ds and name in ds.values):
            return f"{flag} {value}"
        return f"{ds.source(name)} = {value} ({args.zero_config})"

    if micro < 1:
        raise UsageError(f"{named('micro_batch_size', '--micro-batch-size', micro)}: must be >= 1")
    if glob is not None and glob < 1:
        raise UsageError(f"{named('global_batch_size', '--global-batch-size', glob)}: must be >= 1")
    accumulation = ds.get("gradient_accumulation_steps") if ds else None
    if glob is None:
        glob = micro * dp * (accumulation or 1)
    elif accumulation is not None and glob != micro * dp * accumulation:
        raise UsageError(
            f"{named('global_batch_size', '--global-batch-size', glob)} != "
            f"{named('micro_batch_size', '--micro-batch-size', micro)} x "
            f"{named('gradient_accumulation_steps', '', accumulation)} x data-parallel size {dp}; "
            f"DeepSpeed's rule: train_batch_size = micro batch x accumulation x data-parallel size"
        )
    if glob % (micro * dp):
        fits = [m for m in range(glob // dp, 0, -1) if (glob // dp) % m == 0][:3] if glob % dp == 0 else []
        fix = (
            f"; a micro batch of {' or '.join(map(str, fits))} fits it"
            if fits
            else f"; no micro batch fits it at this data-parallel size: choose a global batch divisible by {dp}"
        )
        raise UsageError(
            f"{named('global_batch_size', '--global-batch-size', glob)} is not divisible by "
            f"{named('micro_batch_size', '--micro-batch-size', micro)} x data-parallel size "
            f"{dp} = {micro * dp}{fix}"
        )
    return glob


def virtual_stages(args, topology: Topology) -> int:
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if not per_stage:
        return 1
    if topology.pp == 1:
        raise UsageError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if args.num_layers % (per_stage * topology.pp):
        raise UsageError(
            f"--num-layers {args.num_layers} is not divisible by "
            f"--num-layers-per-virtual-pipeline-stage {per_stage} x pipeline size {topology.pp}"
        )
    return args.num_layers // (per_stage * topology.pp)


def check_pipeline(args, topology: Topology, virtual: int, microbatches: int) -> None:
    schedule = args.pipeline_schedule
    if topology.pp == 1 and schedule in ("gpipe", "1f1b", "interleaved"):
        raise UsageError(f"--pipeline-schedule {schedule} needs --pipeline-model-parallel-size > 1")
    if schedule in ZERO_BUBBLE_SCHEDULES:
        check_zero_bubble(args, topology, virtual, microbatches)
        return
    if args.overlap_p2p_communication and topology.pp == 1:
        raise UsageError(
            "--overlap-p2p-communication overlaps pipeline transfers, and "
            "--pipeline-model-parallel-size 1 has none; remove it"
        )
    if args.overlap_p2p_communication and schedule == "gpipe":
        raise UsageError(
            "--overlap-p2p-communication works with the 1f1b and interleaved schedules, not "
            "gpipe; remove it or choose another --pipeline-schedule"
        )
    if virtual > 1 and schedule in ("gpipe", "1f1b"):
        raise UsageError(
            f"--pipeline-schedule {schedule} runs one model chunk per stage; drop "
            f"--num-layers-per-virtual-pipeline-stage or use 'interleaved'"
        )
    if virtual > 1 or schedule == "interleaved":
        if microbatches % topology.pp:
            raise UsageError(
                f"the interleaved schedule needs the number of microbatches ({microbatches} "
                f"= global batch / (micro batch x dp)) to be a multiple of the pipeline "
                f"size {topology.pp}; raise --global-batch-size"
            )


def check_zero_bubble(args, topology: Topology, virtual: int, microbatches: int) -> None:
    """The zero-bubble schedules' shapes (parallel/pipeline/zero_bubble.py), and what they do not
    combine with: their split backward is not traced by --compile, and they exchange their messages
    in their own batches (--overlap-p2p-communication is 1f1b's and interleaved's)."""
    schedule = args.pipeline_schedule
    check_shape(schedule, topology.pp, virtual, microbatches)
    if args.compile:
        raise UsageError(
            f"--pipeline-schedule {schedule} splits each backward in two, which torch.compile "
            f"does not trace; drop --compile or choose another --pipeline-schedule"
        )
    if args.overlap_p2p_communication:
        raise UsageError(
            f"--overlap-p2p-communication works with the 1f1b and interleaved schedules; "
            f"--pipeline-schedule {schedule} batches its transfers by its own timeline; remove it"
        )
