"""Megatron's checkpoint flags as a `CheckpointConfig`, checked at the edge before any process group:
negative intervals, flags that need --save or --load, --exit-signal without its handler, and the two
lr-schedule flags of a resume given together. What the checkpoint holds is checked against the run
by megazero.checkpoint.resume.check_resume.
"""

from __future__ import annotations

from megazero.config.train_config import CheckpointConfig
from megazero.core.errors import UsageError


def add_checkpoint_flags(g, add) -> None:
    """The flags of this module, added to argument group `g` with `add` (flags._add)."""
    add(g, "--save", default=None, help="folder to save checkpoints into", shown="none")
    add(g, "--load", default=None, help="checkpoint folder (its latest) or iter_* directory to load", shown="none")
    add(
        g,
        "--save-interval",
        type=int,
        default=0,
        help="save every N iterations (and at the end)",
        shown="0: only at the end",
    )
    add(g, "--no-load-optim", action="store_true", help="load weights only; fresh Adam states")
    add(g, "--no-load-rng", action="store_true", help="do not restore RNG states")
    add(g, "--finetune", action="store_true", help="load weights only and start at iteration 0")
    add(
        g,
        "--exit-interval",
        type=int,
        default=0,
        help="stop after an iteration that is a multiple of N",
        shown="0: never",
    )
    add(
        g,
        "--exit-duration-in-mins",
        type=float,
        default=0.0,
        help="stop (and save) after this many minutes",
        shown="0: never",
    )
    add(
        g,
        "--exit-signal-handler",
        action="store_true",
        help="on --exit-signal (and Ctrl-C) finish the step, save and exit 0 (Slurm preemption)",
    )
    add(
        g,
        "--exit-signal",
        choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"],
        default="SIGTERM",
        help="the signal --exit-signal-handler acts on",
    )
    add(
        g,
        "--exit-on-save-failure",
        action="store_true",
        help="stop the run when a save fails (a full disk); otherwise it trains on and says so",
    )
    add(
        g,
        "--ckpt-keep-last",
        type=int,
        default=0,
        help="keep only the newest K checkpoints, and the newest whose loss was finite",
        shown="0: all",
    )
    add(
        g,
        "--extend-position-embeddings",
        action="store_true",
        help="load a checkpoint whose learned position table is smaller than this run's: position p "
        "starts from its row p mod its rows (weights and Adam moments)",
    )
    add(g, "--async-save", action="store_true", help="write checkpoints in the background")
    add(
        g,
        "--ckpt-format",
        choices=["torch", "torch_dist"],
        default=None,
        help="accepted: megazero writes its own sharded format (each rank its shard, loadable into any "
        "layout), which serves torch_dist's purpose",
        shown="megazero's sharded format",
    )


def checkpoint_config(args) -> CheckpointConfig:
    """The checkpoint flags as a CheckpointConfig; flags that need another, or exclude one, fail here."""
    for flag, value in (
        ("--save-interval", args.save_interval),
        ("--exit-interval", args.exit_interval),
        ("--ckpt-keep-last", args.ckpt_keep_last),
        ("--exit-duration-in-mins", args.exit_duration_in_mins),
    ):
        if value < 0:
            raise UsageError(f"{flag} {value} must be >= 0 (0 turns it off)")
    wants_save = args.save_interval or args.ckpt_keep_last or args.async_save
    if wants_save and args.save is None:
        raise UsageError("--save-interval, --ckpt-keep-last and --async-save need --save FOLDER")
    # --no-load-optim and --no-load-rng without --load skip nothing (Megatron-LM's recipes pass them so,
    # their --load commented out); --finetune asks for weights it would not get
    if args.extend_position_embeddings and args.load is None:
        raise UsageError("--extend-position-embeddings needs --load FOLDER (the checkpoint whose position table grows)")
    if args.finetune and args.load is None:
        raise UsageError("--finetune needs --load FOLDER (the weights to start from)")
    if args.exit_on_save_failure and args.save is None:
        raise UsageError("--exit-on-save-failure needs --save FOLDER")
    if args.exit_signal != "SIGTERM" and not args.exit_signal_handler:
        raise UsageError(
            f"--exit-signal {args.exit_signal} needs --exit-signal-handler (without it the "
            f"signal ends the run as usual)"
        )
    override, keep = args.override_opt_param_scheduler, args.use_checkpoint_opt_param_scheduler
    if override and keep:
        raise UsageError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are both "
            "set; choose one (the flags' lr schedule, or the checkpoint's)"
        )
    return CheckpointConfig(
        save=args.save,
        load=args.load,
        save_interval=args.save_interval,
        load_optim=not args.no_load_optim,
        load_rng=not args.no_load_rng,
        finetune=args.finetune,
        exit_interval=args.exit_interval,
        exit_duration_mins=args.exit_duration_in_mins,
        exit_signal_handler=args.exit_signal_handler,
        exit_signal=args.exit_signal,
        keep_last=args.ckpt_keep_last,
        async_save=args.async_save,
        exit_on_save_failure=args.exit_on_save_failure,
        extend_positions=args.extend_position_embeddings,
        scheduler_on_load="flags" if override else "checkpoint" if keep else "check",
    )
