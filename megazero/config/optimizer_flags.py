"""The optimizer flags: the learning-rate schedule (--lr, --min-lr, the decoupled rates of the
embedding and output layer, warmup and decay in iterations, samples or a fraction) and Adam's
(--weight-decay, --adam-beta1/2, --adam-eps, --clip-grad; a DeepSpeed config may set those instead),
turned into the OptimizerConfig record (megazero.config.train_config), and the rules between the
optimizer and the rest of the run (ZenFlow, Muon, the optimizer states' dtypes).

Owns these flags' parser entries and their meaning, Megatron-LM's: one warmup flag and one decay
flag at most; with a batch ramp the schedule counts samples (iteration flags times the global
batch). Part of the edge: each problem is one UsageError before any process group. Muon's own flags
are megazero.config.muon_flags', the optimizer states' dtypes megazero.config.optimizer_state_flags'.
"""

from __future__ import annotations

from megazero.config import batch_flags
from megazero.config.deepspeed_blocks import DeepSpeedSettings, setting_origin
from megazero.config.muon_flags import check_muon, muon_config
from megazero.config.train_config import OptimizerConfig
from megazero.core.errors import UsageError
from megazero.ops.adam_config import AdamConfig


def add_optimizer_flags(g, add, merged) -> None:
    """The flags of this module, added to argument group `g` with `add` (flags._add) and `merged`
    (flags._merged, for the settings a DeepSpeed config may give instead)."""
    merged(g, "lr", "peak learning rate", type=float)
    add(g, "--min-lr", type=float, default=None, help="learning rate at the end of decay", shown="lr / 10")
    add(
        g,
        "--decoupled-lr",
        type=float,
        default=None,
        help="peak learning rate of the input embedding and the output layer (same schedule)",
        shown="--lr",
    )
    add(
        g,
        "--decoupled-min-lr",
        type=float,
        default=None,
        help="their learning rate at the end of decay, with --decoupled-lr",
        shown="--min-lr",
    )
    # the loss's normalisation, listed here as the help has always listed it (after the rates)
    add(
        g,
        "--calculate-per-token-loss",
        action="store_true",
        help="normalise the loss by the tokens of the whole global batch (megazero always does: every token counts)",
    )
    add(g, "--lr-warmup-iters", type=int, default=None, help="linear warmup steps", shown="min(20, train iters / 10)")
    add(
        g,
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="warmup as a fraction of the decay steps",
        shown="none",
    )
    add(g, "--lr-warmup-samples", type=int, default=None, help="warmup in samples", shown="none")
    add(
        g,
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root"],
        default="cosine",
        help="learning-rate decay after warmup",
    )
    add(g, "--lr-decay-iters", type=int, default=None, help="steps to decay over", shown="train iters")
    add(g, "--lr-decay-samples", type=int, default=None, help="samples to decay over", shown="none")
    add(
        g,
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        help="on --load, the flags' lr schedule replaces the checkpoint's",
    )
    add(
        g,
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="on --load, keep the checkpoint's lr schedule whatever the flags say",
    )
    merged(g, "weight_decay", "AdamW weight decay", type=float)
    merged(g, "adam_beta1", "Adam beta1, in [0, 1)", type=float)
    merged(g, "adam_beta2", "Adam beta2, in [0, 1)", type=float)
    merged(g, "adam_eps", "Adam epsilon, > 0", type=float)
    merged(g, "clip_grad", "clip the global gradient norm to this; 0: no clipping", type=float)


def optimizer_config(
    args, ds: DeepSpeedSettings | None, merged: dict, train_iters: int, glob: int, in_samples: bool = False
) -> OptimizerConfig:
    """The schedule and Adam settings. With a batch ramp (`in_samples`) the schedule counts samples,
    as Megatron's does: sample flags as given, iteration flags times the global batch."""
    warmups = [
        flag
        for flag in ("--lr-warmup-iters", "--lr-warmup-fraction", "--lr-warmup-samples")
        if getattr(args, flag[2:].replace("-", "_")) is not None
    ]
    if len(warmups) > 1:
        raise UsageError(f"{' and '.join(warmups)} are {'both' if len(warmups) == 2 else 'all'} set; choose one")
    if args.lr_decay_iters is not None and args.lr_decay_samples is not None:
        raise UsageError("--lr-decay-iters and --lr-decay-samples are both set; choose one")
    unit = 1 if not in_samples else glob  # schedule steps per iteration flag's unit
    if in_samples:
        decay_iters = (
            args.lr_decay_iters * glob
            if args.lr_decay_iters
            else args.lr_decay_samples or (args.train_samples or train_iters * glob)
        )
    else:
        decay_iters = (
            args.lr_decay_iters
            or batch_flags.in_iterations(args.lr_decay_samples, "--lr-decay-samples", glob)
            or train_iters
        )
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay_iters)
    elif args.lr_warmup_samples is not None:
        warmup = (
            args.lr_warmup_samples
            if in_samples
            else batch_flags.in_iterations(args.lr_warmup_samples, "--lr-warmup-samples", glob)
        )
    else:
        warmup = (args.lr_warmup_iters if args.lr_warmup_iters is not None else min(20, train_iters // 10)) * unit
    lr = merged["lr"]
    min_lr = args.min_lr if args.min_lr is not None else lr / 10
    if min_lr > lr:
        origin = setting_origin(args, ds, "lr", "--lr") or "--lr (default)"
        raise UsageError(f"--min-lr {min_lr} is larger than {origin} {lr}; the rate decays from lr to min-lr")
    adam = AdamConfig(
        lr=lr,
        beta1=merged["adam_beta1"],
        beta2=merged["adam_beta2"],
        eps=merged["adam_eps"],
        weight_decay=merged["weight_decay"],
        decoupled_weight_decay=merged["decoupled_weight_decay"],
    )
    decoupled_min = args.decoupled_min_lr
    if decoupled_min is not None and args.decoupled_lr is None:
        raise UsageError("--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's peak rate)")
    if args.decoupled_lr is not None and (decoupled_min if decoupled_min is not None else min_lr) > args.decoupled_lr:
        raise UsageError(
            f"--decoupled-lr {args.decoupled_lr} is below its minimum "
            f"{decoupled_min if decoupled_min is not None else min_lr} (--decoupled-min-lr, else "
            f"--min-lr); the rate decays from the peak to the minimum"
        )
    derived = (("warmup_iters",) if not warmups else ()) + (
        ("decay_iters",) if args.lr_decay_iters is None and args.lr_decay_samples is None else ()
    )
    return OptimizerConfig(
        lr=lr,
        min_lr=min_lr,
        warmup_iters=warmup,
        decay_iters=decay_iters,
        from_train_iters=derived,
        decay_style=args.lr_decay_style,
        adam=adam,
        clip_grad=merged["clip_grad"],
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=decoupled_min,
        in_samples=in_samples,
        muon=muon_config(args, ds, merged),
    )


def optimizer_notes(
    args, optimizer: OptimizerConfig, precision, zero, tp: int, train_iters: int, glob: int, accumulation: int
) -> list[str]:
    """The optimizer against the rest of the run: a warmup longer than the run (a note), what ZenFlow
    and Muon cannot do yet with the precision's optimizer states or a decoupled rate (a UsageError),
    Muon's checks (megazero.config.muon_flags), ZenFlow's step with accumulation (a note)."""
    notes = []
    warmup_steps = optimizer.warmup_iters // (glob if optimizer.in_samples else 1)
    if "warmup_iters" not in optimizer.from_train_iters and warmup_steps > train_iters:
        # refused by nobody (a recipe's smoke test with few --train-iters is normal), but never silent
        notes.append(
            f"the lr warmup ({warmup_steps} iterations) is longer than the run (--train-iters "
            f"{train_iters}): the rate never reaches --lr {optimizer.lr}"
        )
    bf16_states = "bf16" in (precision.exp_avg_dtype, precision.exp_avg_sq_dtype)
    if zero.zenflow is not None and bf16_states:
        raise UsageError(
            "bf16 Adam moments with zero_optimization.zenflow are not supported yet (ZenFlow's "
            "CPU Adam keeps fp32 moments): drop --exp-avg-dtype / --exp-avg-sq-dtype bf16 "
            "(or bf16.bf16_optimizer_states) or zenflow"
        )
    notes += check_muon(optimizer.muon, zero, tp, args.muon_tp_mode)
    if optimizer.muon is not None and bf16_states:
        raise UsageError(
            "bf16 optimizer states (bf16.bf16_optimizer_states, --exp-avg-dtype) are Adam's "
            "(Megatron-LM's precision-aware optimizer); Muon keeps its momentum in fp32: drop one"
        )
    if optimizer.decoupled_lr is not None and zero.zenflow is not None:
        raise UsageError(
            "--decoupled-lr with zero_optimization.zenflow is not supported yet (ZenFlow's "
            "CPU Adam steps one learning rate): drop one of them"
        )
    if zero.zenflow is not None and accumulation > 1:
        notes.append(
            f"zenflow with {accumulation} microbatches per step: megazero's ZenFlow steps once per "
            f"global batch (its device step, and its update_interval counted in global batches); "
            f"DeepSpeed's steps every microbatch and replaces the accumulation by update_interval. "
            f"For DeepSpeed's arithmetic set --global-batch-size to micro batch x data-parallel size"
        )
    return notes
