"""Command-line flags (Megatron-LM's names) -> a validated TrainConfig. The only place argv is read.

Every check that can fail on the flags alone runs here, before any process group exists or any file
is written, and fails with a UsageError whose one line names what the user wrote (the flag, or the
config file and key) and the fix. Settings that a DeepSpeed config (--zero-config) may also carry
default to None in the parser, so that a flag and a JSON key that disagree are reported instead of
one silently winning. Launcher and Megatron-LM spellings (--deepspeed_config, --train-samples,
--use-distributed-optimizer, ...) are mapped here onto megazero's own settings. Checks against the
machine and the files (paths, data, memory) are megazero.config.machine_checks's.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from megazero.config.deepspeed_json import load_deepspeed_config
from megazero.config.data_flags import (DEFAULT_SPLIT, data_notes, infer_tokenizer_type, per_split_paths,
                                        tokenizer_vocab_size)
from megazero.config.deepspeed_blocks import DeepSpeedSettings, flags_from_config
from megazero.config.flags import FLAG_RANGES, MERGED, MERGED_RANGES, range_problem
from megazero.config.flags import parse_args  # noqa: F401  (the launch and the tests take the pair from here)
from megazero.config import batch_flags
from megazero.config.checkpoint_flags import checkpoint_config
from megazero.config.model_flags import check_attention_precision, compile_backend, model_config, offloaded_layers
from megazero.config.moe_flags import expert_parallel_size
from megazero.config.muon_flags import check_muon, muon_config
from megazero.config.monitor_flags import monitor_config
from megazero.config.optimizer_state_flags import optimizer_state_dtypes
from megazero.config.run_flags import batch_ramp, run_options
from megazero.config.train_config import DataConfig, OptimizerConfig, ParallelConfig, TrainConfig
from megazero.zero.config import PrecisionConfig
from megazero.config.zero_flags import check_zero_layout, zero_config
from megazero.core.errors import UsageError
from megazero.models.config import GPTConfig
from megazero.ops.adam_config import AdamConfig
from megazero.parallel.topology import (Topology, validate_context_parallel, validate_expert_parallel,
                                        validate_model_fits)
from megazero.zero.config import as_json, stage_notes

SWITCHES = {"bf16", "fp16", "reduce_dtype"}       # flags that take no value
# Settings whose DeepSpeed key is about DeepSpeed's console, not the training: a flag that says
# otherwise wins, with a note (a key that changes the math or the layout refuses the contradiction).
COSMETIC = {"log_interval": "DeepSpeed's console cadence"}
# Settings only a DeepSpeed config gives: name -> default.
JSON_ONLY = {"grad_accum_dtype": "fp32", "consecutive_hysteresis": False, "wall_clock_breakdown": False,
             "decoupled_weight_decay": True}


def _merge(args, ds: DeepSpeedSettings | None, config_path: str | None) -> dict:
    merged = {}
    for name, (flag, default) in MERGED.items():
        from_flag = getattr(args, name, None)
        from_json = ds.get(name) if ds else None
        if from_flag is not None and from_json is not None and from_flag != from_json:
            shown = flag if name in SWITCHES else f"{flag} {from_flag}"
            if name in COSMETIC:
                ds.notes.append(f"{shown} wins over {ds.source(name)} = {as_json(from_json)} in {config_path} "
                                f"({COSMETIC[name]})")
                from_json = None
            else:
                raise UsageError(f"{shown} contradicts {ds.source(name)} = {as_json(from_json)} in "
                                 f"{config_path}; remove one")
        merged[name] = from_flag if from_flag is not None else from_json if from_json is not None else default
    for name, default in JSON_ONLY.items():
        merged[name] = ds.get(name, default) if ds else default
    merged["initial_scale_power"] = _initial_scale_power(args, ds, config_path)
    return merged


def _initial_scale_power(args, ds: DeepSpeedSettings | None, config_path: str | None) -> int:
    from_json = ds.get("initial_scale_power") if ds else None
    if args.initial_loss_scale is None:
        return 16 if from_json is None else from_json
    scale = args.initial_loss_scale
    if not scale >= 1:
        raise UsageError(f"--initial-loss-scale must be a power of two >= 1, got {scale:g}")
    power = max(0, int(scale).bit_length() - 1)
    if scale != 2.0 ** power:
        raise UsageError(f"--initial-loss-scale {scale:g} must be a power of two (the dynamic scale "
                         f"moves in factors of 2); use {2 ** power} or {2 ** (power + 1)}")
    if from_json is not None and from_json != power:
        raise UsageError(f"--initial-loss-scale {scale:g} contradicts fp16.initial_scale_power = "
                         f"{from_json} in {config_path}; remove one")
    return power


def _config_path(args) -> str | None:
    """--zero-config, or the same file under Megatron-DeepSpeed's --deepspeed_config."""
    if args.zero_config and args.deepspeed_config and args.zero_config != args.deepspeed_config:
        raise UsageError(f"--zero-config {args.zero_config} contradicts --deepspeed_config "
                         f"{args.deepspeed_config}; give the DeepSpeed config once")
    flag = "--zero-config" if args.zero_config else "--deepspeed_config"
    args.zero_config_flag = flag       # how the user named the file, for its errors
    args.zero_config = args.zero_config or args.deepspeed_config
    if args.zero_config and not Path(args.zero_config).is_file():
        what = "is a directory" if Path(args.zero_config).is_dir() else "no such file"
        raise UsageError(f"{flag} {args.zero_config}: {what}; give a DeepSpeed JSON config file")
    if args.zero_config and not os.access(args.zero_config, os.R_OK):
        raise UsageError(f"{flag} {args.zero_config} cannot be read (permission denied); fix its permissions")
    return args.zero_config


def config_from_args(args: argparse.Namespace, world_size: int = 1, local_world_size: int = 0, *,
                     cuda_available: bool | None = None) -> TrainConfig:
    """Validates the flags against each other and the world; raises UsageError on the first problem.
    `cuda_available`: whether this machine has CUDA (None: torch.cuda says, importing torch); it
    picks the default backend, and a few checks depend on it (fused attention, --compile)."""
    # Read by _uses_cuda wherever the device matters below (args already carries the run's values).
    args.cuda_available = torch_cuda_available() if cuda_available is None else cuda_available
    config_path = _config_path(args)
    infer_tokenizer_type(args)
    ds = load_deepspeed_config(config_path, args.zero_config_flag) if config_path else None
    merged = _merge(args, ds, config_path)
    if ds:      # keys standing for flags outside MERGED (schedule, recomputation, monitors) act as those flags
        for attr, value in flags_from_config(ds, vars(args), merged["lr"], config_path).items():
            setattr(args, attr, value)
    _check_ranges(args, ds, merged)
    zero, zero_notes = zero_config(args, ds)
    precision, notes = _precision_config(args, ds, merged)
    if ds:
        notes = ds.notes + stage_notes(zero, f"{config_path}: zero_optimization") + notes
    notes += zero_notes

    cp, cp_comm_type = _context_parallel(args)
    topology = Topology(world_size=world_size, tp=args.tensor_model_parallel_size,
                        pp=args.pipeline_model_parallel_size, mics_shard_size=zero.mics_shard_size,
                        ranks_per_node=args.ranks_per_node or local_world_size or world_size, cp=cp,
                        ep=expert_parallel_size(args), etp=args.expert_tensor_parallel_size or 0)
    check_zero_layout(zero, topology)
    model = _model_config(args, topology, notes)
    check_attention_precision(model, precision.bf16 or precision.fp16, _uses_cuda(args))
    virtual = batch_flags.virtual_stages(args, topology)
    validate_model_fits(topology, num_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
                        num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size,
                        virtual_stages=virtual, layer_split=args.pipeline_layer_split)
    micro, glob = merged["micro_batch_size"], merged["global_batch_size"]
    glob = batch_flags.global_batch(args, micro, glob, topology.dp, ds)
    microbatches = glob // (micro * topology.dp)
    batch_flags.check_pipeline(args, topology, virtual, microbatches)
    if args.sequence_parallel and topology.tp == 1:
        notes.append("--sequence-parallel has no effect at --tensor-model-parallel-size 1: it splits the "
                     "sequence over the tensor-parallel ranks (Megatron-LM turns it off there too)")
    if args.sequence_parallel and args.seq_length % topology.tp:
        raise UsageError(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
                         f"--tensor-model-parallel-size {topology.tp}")
    validate_context_parallel(topology, seq_length=model.seq_length, num_attention_heads=model.num_attention_heads,
                              num_query_groups=model.num_query_groups, comm_type=cp_comm_type,
                              sequence_parallel=args.sequence_parallel and topology.tp > 1,
                              attention_dropout=model.attention_dropout)
    validate_expert_parallel(topology, num_experts=model.num_experts,
                             mics=topology.mics_shard_size != topology.dp_cp,
                             capacity=model.moe_expert_capacity_factor is not None,
                             dispatcher=args.moe_token_dispatcher_type, seq_length=model.seq_length)

    from megazero.data.gpt_dataset import parse_split
    split = args.split or DEFAULT_SPLIT
    parse_split(split)
    data = DataConfig(data_path=args.data_path, split=split, tokenizer_model=args.tokenizer_model,
                      tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, vocab_size=args.vocab_size,
                      cache_dir=args.data_cache_path, mock_data=args.mock_data,
                      mmap_bin_files=not args.no_mmap_bin_files, tiktoken_pattern=args.tiktoken_pattern,
                      reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
                      eod_mask_loss=args.eod_mask_loss,
                      split_paths=per_split_paths(args), builder_threads=args.num_dataset_builder_threads)
    notes += data_notes(args)
    ramp = batch_ramp(args, glob, micro, topology.dp)
    if ramp is not None and (virtual > 1 or args.pipeline_schedule == "interleaved"):
        batch_flags.check_pipeline(args, topology, virtual, ramp.start // (micro * topology.dp))
    train_iters = batch_flags.train_iters(args, glob, ramp)
    if ramp is not None and args.train_samples is None:
        notes.append("--rampup-batch-size with --train-iters: Megatron-LM asks for --train-samples; megazero "
                     "runs the iterations with the ramp's batches and counts the lr schedule in samples "
                     "(iteration flags x --global-batch-size)")
    optimizer = _optimizer_config(args, ds, merged, train_iters, glob, ramp is not None)
    warmup_steps = optimizer.warmup_iters // (glob if optimizer.in_samples else 1)
    if "warmup_iters" not in optimizer.from_train_iters and warmup_steps > train_iters:
        # refused by nobody (a recipe's smoke test with few --train-iters is normal), but never silent
        notes.append(f"the lr warmup ({warmup_steps} iterations) is longer than the run (--train-iters "
                     f"{train_iters}): the rate never reaches --lr {optimizer.lr}")
    if zero.zenflow is not None and "bf16" in (precision.exp_avg_dtype, precision.exp_avg_sq_dtype):
        raise UsageError("bf16 Adam moments with zero_optimization.zenflow are not supported yet (ZenFlow's "
                         "CPU Adam keeps fp32 moments): drop --exp-avg-dtype / --exp-avg-sq-dtype bf16 "
                         "(or bf16.bf16_optimizer_states) or zenflow")
    notes += check_muon(optimizer.muon, zero, topology.tp, args.muon_tp_mode)
    if optimizer.muon is not None and "bf16" in (precision.exp_avg_dtype, precision.exp_avg_sq_dtype):
        raise UsageError("bf16 optimizer states (bf16.bf16_optimizer_states, --exp-avg-dtype) are Adam's "
                         "(Megatron-LM's precision-aware optimizer); Muon keeps its momentum in fp32: drop one")
    if optimizer.decoupled_lr is not None and zero.zenflow is not None:
        raise UsageError("--decoupled-lr with zero_optimization.zenflow is not supported yet (ZenFlow's "
                         "CPU Adam steps one learning rate): drop one of them")
    accumulation = glob // (micro * topology.dp)
    if zero.zenflow is not None and accumulation > 1:
        notes.append(f"zenflow with {accumulation} microbatches per step: megazero's ZenFlow steps once per "
                     f"global batch (its device step, and its update_interval counted in global batches); "
                     f"DeepSpeed's steps every microbatch and replaces the accumulation by update_interval. "
                     f"For DeepSpeed's arithmetic set --global-batch-size to micro batch x data-parallel size")
    run_opts = run_options(args, world_size, notes)
    # this rank's draw; rank 0's becomes the run's (megazero.run.run_folder): unique per run, not per second
    run_dir = args.run_dir or time.strftime("runs/gpt-%Y%m%d-%H%M%S-") + os.urandom(3).hex()
    backend = args.distributed_backend or ("nccl" if args.cuda_available else "gloo")
    compile_layers = compile_backend(args, _uses_cuda(args))
    if args.deepspeed:
        notes.append("--deepspeed has no effect: megazero's own ZeRO engine always runs (its settings "
                     "come from --deepspeed_config / --zero-config)")
    chunk_layers = min(args.pipeline_layer_split or [model.num_layers // (topology.pp * virtual)])
    return TrainConfig(
        model=model, zero=zero, optimizer=optimizer, data=data,
        parallel=ParallelConfig(tensor_parallel=topology.tp, pipeline_parallel=topology.pp,
                                sequence_parallel=args.sequence_parallel and topology.tp > 1,
                                context_parallel=cp, cp_comm_type=cp_comm_type, expert_parallel=topology.ep,
                                expert_tensor_parallel=topology.etp,
                                moe_dispatcher=args.moe_token_dispatcher_type, virtual_stages=virtual, layer_split=args.pipeline_layer_split,
                                cpu_offloading_num_layers=offloaded_layers(args, chunk_layers),
                                schedule=args.pipeline_schedule, ranks_per_node=topology.ranks_per_node,
                                distributed_backend=backend, overlap_p2p_comm=args.overlap_p2p_communication,
                                timeout_minutes=args.distributed_timeout_minutes,
                                heartbeat_minutes=_heartbeat_minutes(args)),
        precision=precision,
        micro_batch_size=micro, global_batch_size=glob, train_iters=train_iters,
        batch_from=batch_flags.batch_from(args, ds),
        eval_interval=batch_flags.positive(args.eval_interval, "--eval-interval"), eval_iters=args.eval_iters,
        log_interval=batch_flags.positive(merged["log_interval"], "--log-interval"), seed=merged["seed"],
        run_dir=run_dir, default_run_dir=args.run_dir is None,
        metrics_file=args.metrics_file or str(Path(run_dir) / "metrics.jsonl"),
        wall_clock_breakdown=merged["wall_clock_breakdown"] or args.log_timers_to_tensorboard,
        compile_backend=compile_layers, notes=notes, checkpoint=checkpoint_config(args),
        monitor=monitor_config(args, run_dir), rampup=ramp, run=run_opts)


def _context_parallel(args) -> tuple[int, str]:
    """(cp size, comm type) from --context-parallel-size / --cp-comm-type, or Megatron-DeepSpeed's
    --ds-sequence-parallel-size N (Ulysses: cp N with a2a)."""
    cp, comm_type, ulysses = args.context_parallel_size, args.cp_comm_type, args.ds_sequence_parallel_size
    if ulysses is None:
        return cp, comm_type
    if cp not in (1, ulysses) or (cp > 1 and comm_type != "a2a"):
        raise UsageError(f"--ds-sequence-parallel-size {ulysses} (Ulysses: context parallel with a2a) "
                         f"contradicts --context-parallel-size {cp} --cp-comm-type {comm_type}; give one")
    return ulysses, "a2a"


def torch_cuda_available() -> bool:
    import torch            # here, not at the top: the flags are checked before torch loads
    return torch.cuda.is_available()


def _uses_cuda(args) -> bool:
    """Whether the run's device will be a GPU (the launch's rule: gloo runs on CPU)."""
    return (args.distributed_backend or ("nccl" if args.cuda_available else "gloo")) == "nccl"


def flag_error(argv: list[str], world_size: int = 1, local_world_size: int = 0) -> str | None:
    """The flags' first mistake, found without torch: parse and check as config_from_args does, once
    assuming this machine has CUDA and once that it has not. A mistake found both ways is one
    whatever the machine has (None otherwise: the full check, with torch, decides)."""
    found = []
    for cuda in (False, True):
        try:
            config_from_args(parse_args(argv), world_size, local_world_size, cuda_available=cuda)
            return None
        except UsageError as err:
            found.append(str(err))
    return found[0]


def _heartbeat_minutes(args) -> float:
    """--heartbeat-timeout-minutes, by default half the backend's timeout; refused at or above it,
    where NCCL's watchdog would abort the job first, naming no rank."""
    backend = args.distributed_timeout_minutes
    if args.heartbeat_timeout_minutes is None:
        return backend / 2
    if args.heartbeat_timeout_minutes >= backend:
        raise UsageError(f"--heartbeat-timeout-minutes {args.heartbeat_timeout_minutes:g} must be below "
                         f"--distributed-timeout-minutes {backend:g}: at the backend's timeout NCCL aborts the "
                         f"job naming no rank; lower it, or raise --distributed-timeout-minutes (0 turns it off)")
    return args.heartbeat_timeout_minutes


def _origin(args, ds: DeepSpeedSettings | None, name: str, flag: str | None, attr: str = "",
            with_file: bool = True) -> str | None:
    """Where a setting came from: its flag, else its DeepSpeed key (and file); None when neither set it."""
    if flag and getattr(args, attr or name, None) is not None:
        return flag
    if ds and name in ds.values:
        return f"{ds.source(name)} in {args.zero_config}" if with_file else ds.source(name)
    return None


def _check_ranges(args, ds: DeepSpeedSettings | None, merged: dict) -> None:
    """Numbers out of their range, named as the user wrote them (flag, or key and file)."""
    for name, bounds in MERGED_RANGES.items():
        problem = range_problem(merged[name], bounds)
        if problem:
            origin = _origin(args, ds, name, MERGED[name][0])
            hint = "; 0 turns clipping off" if name == "clip_grad" else ""
            raise UsageError(f"{origin} {problem}, got {merged[name]}{hint}")
    for name, bounds in FLAG_RANGES.items():
        value = getattr(args, name)
        problem = None if value is None else range_problem(value, bounds)
        if problem:
            raise UsageError(f"--{name.replace('_', '-')} {problem}, got {value}")
    for split in args.pipeline_layer_split or ():
        if split < 1:
            raise UsageError(f"--pipeline-layer-split takes layer counts >= 1, got {split}")


# fp16 loss-scaling settings: name -> (flag, args attribute).
LOSS_SCALING = {"loss_scale": ("--loss-scale", ""), "initial_scale_power": ("--initial-loss-scale",
                "initial_loss_scale"), "loss_scale_window": ("--loss-scale-window", ""),
                "hysteresis": ("--hysteresis", ""), "min_loss_scale": ("--min-loss-scale", ""),
                "consecutive_hysteresis": (None, "")}


def _precision_config(args, ds: DeepSpeedSettings | None, merged: dict) -> tuple[PrecisionConfig, list[str]]:
    """The precision settings and notes on the loss-scaling ones that cannot act in this run."""
    if merged["bf16"] and merged["fp16"]:
        raise UsageError(f"{_origin(args, ds, 'bf16', '--bf16')} and {_origin(args, ds, 'fp16', '--fp16')} "
                         f"are both set; choose one")
    run = "bf16" if merged["bf16"] else "fp16" if merged["fp16"] else "fp32"
    states = optimizer_state_dtypes(args, ds, run, merged)      # and --main-grads-dtype into merged
    for name in ("grad_accum_dtype", "reduce_dtype"):
        value = merged[name]
        if value != "fp32" and value != run:
            origin = _origin(args, ds, name, "--grad-reduce-in-bf16" if name == "reduce_dtype" else None)
            undo = "drop it" if origin.startswith("--") else "set it to \"fp32\""
            raise UsageError(f"{origin} asks for {value} but the parameters are {run}; {undo}, or train "
                             f"in {value} (--{value})")
    for name in ("loss_scale_window", "hysteresis"):
        if merged[name] < 1:
            raise UsageError(f"{_origin(args, ds, name, LOSS_SCALING[name][0])} must be >= 1, got {merged[name]}")
    given = [origin for name, (flag, attr) in LOSS_SCALING.items()
             if (origin := _origin(args, ds, name, flag, attr, with_file=False))
             and (run != "fp16" or name != "loss_scale")]
    why = "the run is not fp16" if run != "fp16" else \
        f"the loss scale is static ({merged['loss_scale']:g})" if merged["loss_scale"] > 0 else None
    notes = []
    if given and why:
        where = f" ({args.zero_config})" if any(not g.startswith("--") for g in given) else ""
        notes.append(f"{', '.join(given)}{where} {'has' if len(given) == 1 else 'have'} no effect: {why}")
    precision = PrecisionConfig(
        bf16=merged["bf16"], fp16=merged["fp16"], loss_scale=merged["loss_scale"],
        initial_scale_power=merged["initial_scale_power"], loss_scale_window=merged["loss_scale_window"],
        hysteresis=merged["hysteresis"], min_loss_scale=merged["min_loss_scale"],
        consecutive_hysteresis=merged["consecutive_hysteresis"], grad_accum_dtype=merged["grad_accum_dtype"],
        reduce_dtype=merged["reduce_dtype"], gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        **states)
    return precision, notes


def _model_config(args, topology: Topology, notes: list[str]) -> GPTConfig:
    vocab = tokenizer_vocab_size(args)
    if args.max_position_embeddings and args.max_position_embeddings < args.seq_length:
        raise UsageError(f"--max-position-embeddings {args.max_position_embeddings} is smaller than "
                         f"--seq-length {args.seq_length}")
    config, model_notes = model_config(args, vocab, topology.tp, topology.pp, _uses_cuda(args))
    notes += model_notes
    return config


def _optimizer_config(args, ds: DeepSpeedSettings | None, merged: dict, train_iters: int,
                      glob: int, in_samples: bool = False) -> OptimizerConfig:
    """The schedule and Adam settings. With a batch ramp (`in_samples`) the schedule counts samples,
    as Megatron's does: sample flags as given, iteration flags times the global batch."""
    warmups = [flag for flag in ("--lr-warmup-iters", "--lr-warmup-fraction", "--lr-warmup-samples")
               if getattr(args, flag[2:].replace("-", "_")) is not None]
    if len(warmups) > 1:
        raise UsageError(f"{' and '.join(warmups)} are {'both' if len(warmups) == 2 else 'all'} set; choose one")
    if args.lr_decay_iters is not None and args.lr_decay_samples is not None:
        raise UsageError("--lr-decay-iters and --lr-decay-samples are both set; choose one")
    unit = 1 if not in_samples else glob           # schedule steps per iteration flag's unit
    if in_samples:
        decay_iters = (args.lr_decay_iters * glob if args.lr_decay_iters else args.lr_decay_samples
                       or (args.train_samples or train_iters * glob))
    else:
        decay_iters = (args.lr_decay_iters
                       or batch_flags.in_iterations(args.lr_decay_samples, "--lr-decay-samples", glob)
                       or train_iters)
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay_iters)
    elif args.lr_warmup_samples is not None:
        warmup = (args.lr_warmup_samples if in_samples
                  else batch_flags.in_iterations(args.lr_warmup_samples, "--lr-warmup-samples", glob))
    else:
        warmup = (args.lr_warmup_iters if args.lr_warmup_iters is not None else min(20, train_iters // 10)) * unit
    lr = merged["lr"]
    min_lr = args.min_lr if args.min_lr is not None else lr / 10
    if min_lr > lr:
        origin = _origin(args, ds, "lr", "--lr") or "--lr (default)"
        raise UsageError(f"--min-lr {min_lr} is larger than {origin} {lr}; the rate decays from lr to min-lr")
    adam = AdamConfig(lr=lr, beta1=merged["adam_beta1"], beta2=merged["adam_beta2"], eps=merged["adam_eps"],
                      weight_decay=merged["weight_decay"],
                      decoupled_weight_decay=merged["decoupled_weight_decay"])
    decoupled_min = args.decoupled_min_lr
    if decoupled_min is not None and args.decoupled_lr is None:
        raise UsageError("--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's peak rate)")
    if args.decoupled_lr is not None and (decoupled_min if decoupled_min is not None else min_lr) > args.decoupled_lr:
        raise UsageError(f"--decoupled-lr {args.decoupled_lr} is below its minimum "
                         f"{decoupled_min if decoupled_min is not None else min_lr} (--decoupled-min-lr, else "
                         f"--min-lr); the rate decays from the peak to the minimum")
    derived = (("warmup_iters",) if not warmups else ()) + \
        (("decay_iters",) if args.lr_decay_iters is None and args.lr_decay_samples is None else ())
    return OptimizerConfig(lr=lr, min_lr=min_lr, warmup_iters=warmup, decay_iters=decay_iters,
                           from_train_iters=derived,
                           decay_style=args.lr_decay_style, adam=adam, clip_grad=merged["clip_grad"],
                           decoupled_lr=args.decoupled_lr, decoupled_min_lr=decoupled_min, in_samples=in_samples,
                           muon=muon_config(args, ds, merged))
