"""The precision flags: --bf16 / --fp16 (a DeepSpeed config's bf16 and fp16 blocks may set them
instead), fp16's loss scaling (--loss-scale, --initial-loss-scale, --min-loss-scale,
--loss-scale-window, --hysteresis), what a non-finite loss or gradient does, and the gradients'
reduce and accumulation dtypes, turned into the PrecisionConfig record (megazero.zero.config).

Owns these flags' parser entries and the rules between them: one of bf16 and fp16; a reduce or
accumulation dtype other than fp32 must be the run's; the loss-scaling settings that cannot act in
this run (not fp16, or a static scale) are noted. Part of the edge: each problem is one UsageError
before any process group. The optimizer-state dtypes are megazero.config.optimizer_state_flags'.
"""

from __future__ import annotations

from megazero.config.deepspeed_blocks import DeepSpeedSettings, setting_origin as origin
from megazero.config.optimizer_state_flags import optimizer_state_dtypes
from megazero.core.errors import UsageError
from megazero.zero.config import PrecisionConfig

# fp16 loss-scaling settings: name -> (flag, args attribute).
LOSS_SCALING = {
    "loss_scale": ("--loss-scale", ""),
    "initial_scale_power": ("--initial-loss-scale", "initial_loss_scale"),
    "loss_scale_window": ("--loss-scale-window", ""),
    "hysteresis": ("--hysteresis", ""),
    "min_loss_scale": ("--min-loss-scale", ""),
    "consecutive_hysteresis": (None, ""),
}


def add_precision_flags(g, add, merged) -> None:
    """The flags of this module, added to argument group `g` with `add` (flags._add) and `merged`
    (flags._merged, for the settings a DeepSpeed config may give instead)."""
    merged(g, "bf16", "compute in bf16 with fp32 master weights", action="store_true", default=None)
    merged(g, "fp16", "compute in fp16 with fp32 master weights and loss scaling", action="store_true", default=None)
    merged(g, "loss_scale", "fp16 static loss scale; 0: dynamic", type=float)
    add(
        g,
        "--initial-loss-scale",
        type=float,
        default=None,
        help="fp16 dynamic scale to start from, a power of 2",
        shown="2^16",
    )
    merged(g, "min_loss_scale", "fp16 dynamic scale floor", type=float)
    merged(g, "loss_scale_window", "fp16 steps without overflow before the scale doubles", type=int)
    merged(g, "hysteresis", "fp16 overflows tolerated before the scale halves", type=int)
    add(
        g,
        "--check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_true",
        default=True,
        help="end the run (exit 3) at a non-finite loss, or a non-finite gradient no fp16 "
        "dynamic loss scale accounts for (Megatron-LM's check)",
        shown="on",
    )
    add(
        g,
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="skip such steps instead (the step is not applied)",
        shown="off",
    )
    add(
        g,
        "--max-consecutive-skipped-steps",
        type=int,
        default=50,
        help="end the run (exit 3) when this many steps in a row were skipped for non-finite gradients; "
        "0: never (the most an fp16 dynamic scale skips in a row, from 2^32 down to 1, is 33)",
    )
    merged(
        g,
        "reduce_dtype",
        "reduce gradients in bf16 (needs --bf16)",
        dest="reduce_dtype",
        action="store_const",
        const="bf16",
        default=None,
    )
    add(
        g,
        "--no-gradient-accumulation-fusion",
        dest="gradient_accumulation_fusion",
        action="store_false",
        default=True,
        help="with 16-bit weights, let autograd round each weight gradient to 16 bits "
        "before it is accumulated in fp32 (default: the layers sum weight gradients "
        "in fp32, Megatron's gradient-accumulation fusion)",
        shown="off",
    )


def initial_scale_power(args, ds: DeepSpeedSettings | None, config_path: str | None) -> int:
    """fp16's initial dynamic scale as a power of 2: --initial-loss-scale, else the config's
    fp16.initial_scale_power, else 16."""
    from_json = ds.get("initial_scale_power") if ds else None
    if args.initial_loss_scale is None:
        return 16 if from_json is None else from_json
    scale = args.initial_loss_scale
    if not scale >= 1:
        raise UsageError(f"--initial-loss-scale must be a power of two >= 1, got {scale:g}")
    power = max(0, int(scale).bit_length() - 1)
    if scale != 2.0**power:
        raise UsageError(
            f"--initial-loss-scale {scale:g} must be a power of two (the dynamic scale "
            f"moves in factors of 2); use {2**power} or {2 ** (power + 1)}"
        )
    if from_json is not None and from_json != power:
        raise UsageError(
            f"--initial-loss-scale {scale:g} contradicts fp16.initial_scale_power = "
            f"{from_json} in {config_path}; remove one"
        )
    return power


def precision_config(args, ds: DeepSpeedSettings | None, merged: dict) -> tuple[PrecisionConfig, list[str]]:
    """The precision settings and notes on the loss-scaling ones that cannot act in this run."""
    if merged["bf16"] and merged["fp16"]:
        raise UsageError(
            f"{origin(args, ds, 'bf16', '--bf16')} and {origin(args, ds, 'fp16', '--fp16')} are both set; choose one"
        )
    run = "bf16" if merged["bf16"] else "fp16" if merged["fp16"] else "fp32"
    states = optimizer_state_dtypes(args, ds, run, merged)  # and --main-grads-dtype into merged
    for name in ("grad_accum_dtype", "reduce_dtype"):
        value = merged[name]
        if value != "fp32" and value != run:
            given = origin(args, ds, name, "--grad-reduce-in-bf16" if name == "reduce_dtype" else None)
            undo = "drop it" if given.startswith("--") else 'set it to "fp32"'
            raise UsageError(
                f"{given} asks for {value} but the parameters are {run}; {undo}, or train in {value} (--{value})"
            )
    for name in ("loss_scale_window", "hysteresis"):
        if merged[name] < 1:
            raise UsageError(f"{origin(args, ds, name, LOSS_SCALING[name][0])} must be >= 1, got {merged[name]}")
    given = [
        said
        for name, (flag, attr) in LOSS_SCALING.items()
        if (said := origin(args, ds, name, flag, attr, with_file=False)) and (run != "fp16" or name != "loss_scale")
    ]
    why = (
        "the run is not fp16"
        if run != "fp16"
        else f"the loss scale is static ({merged['loss_scale']:g})"
        if merged["loss_scale"] > 0
        else None
    )
    notes = []
    if given and why:
        where = f" ({args.zero_config})" if any(not g.startswith("--") for g in given) else ""
        notes.append(f"{', '.join(given)}{where} {'has' if len(given) == 1 else 'have'} no effect: {why}")
    precision = PrecisionConfig(
        bf16=merged["bf16"],
        fp16=merged["fp16"],
        loss_scale=merged["loss_scale"],
        initial_scale_power=merged["initial_scale_power"],
        loss_scale_window=merged["loss_scale_window"],
        hysteresis=merged["hysteresis"],
        min_loss_scale=merged["min_loss_scale"],
        consecutive_hysteresis=merged["consecutive_hysteresis"],
        grad_accum_dtype=merged["grad_accum_dtype"],
        reduce_dtype=merged["reduce_dtype"],
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        **states,
    )
    return precision, notes
