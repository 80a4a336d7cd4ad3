"""Command-line flags (Megatron-LM's names) -> a validated TrainConfig. The only place argv is read.

Every check that can fail on the flags alone runs here, before any process group exists or any file
is written, and fails with a UsageError whose one line names what the user wrote (the flag, or the
config file and key) and the fix. Settings that a DeepSpeed config (--zero-config) may also carry
default to None in the parser, so that a flag and a JSON key that disagree are reported instead of
one silently winning. Launcher and Megatron-LM spellings (--deepspeed_config, --train-samples,
--use-distributed-optimizer, ...) are mapped here onto megazero's own settings. The flags are read
against a `Machine` (megazero.config.machine: the ranks, whether there is CUDA); each flag area's
meaning is its own *_flags module's. Checks against the machine and the files (paths, data, memory)
are megazero.config.machine_checks's.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from megazero.config.deepspeed_json import load_deepspeed_config
from megazero.config.data_flags import (
    DEFAULT_SPLIT,
    data_notes,
    infer_tokenizer_type,
    per_split_paths,
    tokenizer_vocab_size,
)
from megazero.config.deepspeed_blocks import DeepSpeedSettings, flags_from_config, setting_origin
from megazero.config.flags import FLAG_RANGES, MERGED, MERGED_RANGES, range_problem
from megazero.config.flags import parse_args  # noqa: F401  (the launch and the tests take the pair from here)
from megazero.config import batch_flags
from megazero.config.checkpoint_flags import checkpoint_config
from megazero.config.machine import Machine
from megazero.config.model_flags import check_attention_precision, compile_backend, model_config, offloaded_layers
from megazero.config.moe_flags import expert_parallel_size
from megazero.config.monitor_flags import monitor_config
from megazero.config.optimizer_flags import optimizer_config, optimizer_notes
from megazero.config.precision_flags import initial_scale_power, precision_config
from megazero.config.run_flags import batch_ramp, run_options
from megazero.config.train_config import DataConfig, ParallelConfig, TrainConfig
from megazero.config.zero_flags import check_zero_layout, zero_config
from megazero.core.errors import UsageError
from megazero.models.config import GPTConfig
from megazero.parallel.topology import (
    Topology,
    validate_context_parallel,
    validate_expert_parallel,
    validate_model_fits,
)
from megazero.zero.config import as_json, stage_notes

SWITCHES = {"bf16", "fp16", "reduce_dtype"}  # flags that take no value
# Settings whose DeepSpeed key is about DeepSpeed's console, not the training: a flag that says
# otherwise wins, with a note (a key that changes the math or the layout refuses the contradiction).
COSMETIC = {"log_interval": "DeepSpeed's console cadence"}
# Settings only a DeepSpeed config gives: name -> default.
JSON_ONLY = {
    "grad_accum_dtype": "fp32",
    "consecutive_hysteresis": False,
    "wall_clock_breakdown": False,
    "decoupled_weight_decay": True,
}


def config_from_args(
    args: argparse.Namespace, world_size: int = 1, local_world_size: int = 0, *, cuda_available: bool | None = None
) -> TrainConfig:
    """Validates the flags against each other and the world; raises UsageError on the first problem.
    `cuda_available`: whether this machine has CUDA (None: torch.cuda says, importing torch); it
    picks the default backend, and a few checks depend on it (fused attention, --compile). `args`
    is left as parsed (what the DeepSpeed config gives for flags is read into a copy)."""
    machine = Machine.of(world_size, local_world_size, cuda_available)
    args, ds, merged = _settings(args)
    zero, precision, notes = _zero_and_precision(args, ds, merged)
    topology, cp_comm_type = _topology(args, machine, zero)
    model = _model_config(args, topology, notes, machine)
    check_attention_precision(model, precision.bf16 or precision.fp16, machine.uses_cuda(args.distributed_backend))
    virtual = batch_flags.virtual_stages(args, topology)
    validate_model_fits(
        topology,
        num_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        virtual_stages=virtual,
        layer_split=args.pipeline_layer_split,
    )
    micro, glob = merged["micro_batch_size"], merged["global_batch_size"]
    glob = batch_flags.global_batch(args, micro, glob, topology.dp, ds)
    batch_flags.check_pipeline(args, topology, virtual, glob // (micro * topology.dp))
    _check_sequence_splits(args, topology, model, cp_comm_type, notes)
    data = _data_config(args)
    notes += data_notes(args)
    ramp = batch_ramp(args, glob, micro, topology.dp)
    if ramp is not None and (virtual > 1 or args.pipeline_schedule == "interleaved"):
        batch_flags.check_pipeline(args, topology, virtual, ramp.start // (micro * topology.dp))
    train_iters = batch_flags.train_iters(args, glob, ramp)
    if ramp is not None and args.train_samples is None:
        notes.append(
            "--rampup-batch-size with --train-iters: Megatron-LM asks for --train-samples; megazero "
            "runs the iterations with the ramp's batches and counts the lr schedule in samples "
            "(iteration flags x --global-batch-size)"
        )
    optimizer = optimizer_config(args, ds, merged, train_iters, glob, ramp is not None)
    notes += optimizer_notes(
        args, optimizer, precision, zero, topology.tp, train_iters, glob, glob // (micro * topology.dp)
    )
    run_opts = run_options(args, world_size, notes)
    # this rank's draw; rank 0's becomes the run's (megazero.run.run_folder): unique per run, not per second
    run_dir = args.run_dir or time.strftime("runs/gpt-%Y%m%d-%H%M%S-") + os.urandom(3).hex()
    compile_layers = compile_backend(args, machine.uses_cuda(args.distributed_backend))
    if args.deepspeed:
        notes.append(
            "--deepspeed has no effect: megazero's own ZeRO engine always runs (its settings "
            "come from --deepspeed_config / --zero-config)"
        )
    return TrainConfig(
        model=model,
        zero=zero,
        optimizer=optimizer,
        data=data,
        parallel=_parallel_config(args, machine, topology, cp_comm_type, virtual, model),
        precision=precision,
        micro_batch_size=micro,
        global_batch_size=glob,
        train_iters=train_iters,
        batch_from=batch_flags.batch_from(args, ds),
        eval_interval=batch_flags.positive(args.eval_interval, "--eval-interval"),
        eval_iters=args.eval_iters,
        log_interval=batch_flags.positive(merged["log_interval"], "--log-interval"),
        seed=merged["seed"],
        run_dir=run_dir,
        default_run_dir=args.run_dir is None,
        metrics_file=args.metrics_file or str(Path(run_dir) / "metrics.jsonl"),
        wall_clock_breakdown=merged["wall_clock_breakdown"] or args.log_timers_to_tensorboard,
        compile_backend=compile_layers,
        notes=notes,
        checkpoint=checkpoint_config(args),
        monitor=monitor_config(args, run_dir),
        rampup=ramp,
        run=run_opts,
    )


def _zero_and_precision(args, ds: DeepSpeedSettings | None, merged: dict) -> tuple:
    """The ZeroConfig and PrecisionConfig the flags and the DeepSpeed config give, and the notes so far:
    the config's own, its stage's, the precision flags', then the ZeRO flags'."""
    zero, zero_notes = zero_config(args, ds)
    precision, notes = precision_config(args, ds, merged)
    if ds:
        notes = ds.notes + stage_notes(zero, f"{args.zero_config}: zero_optimization") + notes
    return zero, precision, notes + zero_notes


def _settings(parsed: argparse.Namespace) -> tuple[argparse.Namespace, DeepSpeedSettings | None, dict]:
    """(the flags, the DeepSpeed config, the merged settings): the flags as a copy of `parsed` with
    the config's path under one name (--zero-config or --deepspeed_config), the tokenizer a GPT-3
    line implies, and what the config's blocks give for flags outside MERGED; each number in range."""
    args = argparse.Namespace(**vars(parsed))
    config_path = _config_path(args)
    infer_tokenizer_type(args)
    ds = load_deepspeed_config(config_path, args.zero_config_flag) if config_path else None
    merged = _merge(args, ds, config_path)
    if ds:  # keys standing for flags outside MERGED (schedule, recomputation, monitors) act as those flags
        for attr, value in flags_from_config(ds, vars(args), merged["lr"], config_path).items():
            setattr(args, attr, value)
    _check_ranges(args, ds, merged)
    return args, ds, merged


def _merge(args, ds: DeepSpeedSettings | None, config_path: str | None) -> dict:
    merged = {}
    for name, (flag, default) in MERGED.items():
        from_flag = getattr(args, name, None)
        from_json = ds.get(name) if ds else None
        if from_flag is not None and from_json is not None and from_flag != from_json:
            shown = flag if name in SWITCHES else f"{flag} {from_flag}"
            if name in COSMETIC:
                ds.notes.append(
                    f"{shown} wins over {ds.source(name)} = {as_json(from_json)} in {config_path} ({COSMETIC[name]})"
                )
                from_json = None
            else:
                raise UsageError(
                    f"{shown} contradicts {ds.source(name)} = {as_json(from_json)} in {config_path}; remove one"
                )
        merged[name] = from_flag if from_flag is not None else from_json if from_json is not None else default
    for name, default in JSON_ONLY.items():
        merged[name] = ds.get(name, default) if ds else default
    merged["initial_scale_power"] = initial_scale_power(args, ds, config_path)
    return merged


def _config_path(args) -> str | None:
    """--zero-config, or the same file under Megatron-DeepSpeed's --deepspeed_config."""
    if args.zero_config and args.deepspeed_config and args.zero_config != args.deepspeed_config:
        raise UsageError(
            f"--zero-config {args.zero_config} contradicts --deepspeed_config "
            f"{args.deepspeed_config}; give the DeepSpeed config once"
        )
    flag = "--zero-config" if args.zero_config else "--deepspeed_config"
    args.zero_config_flag = flag  # how the user named the file, for its errors
    args.zero_config = args.zero_config or args.deepspeed_config
    if args.zero_config and not Path(args.zero_config).is_file():
        what = "is a directory" if Path(args.zero_config).is_dir() else "no such file"
        raise UsageError(f"{flag} {args.zero_config}: {what}; give a DeepSpeed JSON config file")
    if args.zero_config and not os.access(args.zero_config, os.R_OK):
        raise UsageError(f"{flag} {args.zero_config} cannot be read (permission denied); fix its permissions")
    return args.zero_config


def _topology(args, machine: Machine, zero) -> tuple[Topology, str]:
    """The rank grid the flags ask for on the machine's ranks, and the context-parallel comm type."""
    cp, cp_comm_type = _context_parallel(args)
    topology = Topology(
        world_size=machine.world_size,
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        mics_shard_size=zero.mics_shard_size,
        ranks_per_node=args.ranks_per_node or machine.local_world_size or machine.world_size,
        cp=cp,
        ep=expert_parallel_size(args),
        etp=args.expert_tensor_parallel_size or 0,
    )
    check_zero_layout(zero, topology)
    return topology, cp_comm_type


def _context_parallel(args) -> tuple[int, str]:
    """(cp size, comm type) from --context-parallel-size / --cp-comm-type, or Megatron-DeepSpeed's
    --ds-sequence-parallel-size N (Ulysses: cp N with a2a)."""
    cp, comm_type, ulysses = args.context_parallel_size, args.cp_comm_type, args.ds_sequence_parallel_size
    if ulysses is None:
        return cp, comm_type
    if cp not in (1, ulysses) or (cp > 1 and comm_type != "a2a"):
        raise UsageError(
            f"--ds-sequence-parallel-size {ulysses} (Ulysses: context parallel with a2a) "
            f"contradicts --context-parallel-size {cp} --cp-comm-type {comm_type}; give one"
        )
    return ulysses, "a2a"


def _check_sequence_splits(args, topology: Topology, model: GPTConfig, cp_comm_type: str, notes: list[str]) -> None:
    """Sequence parallelism, context parallelism and expert parallelism against the model's shape."""
    if args.sequence_parallel and topology.tp == 1:
        notes.append(
            "--sequence-parallel has no effect at --tensor-model-parallel-size 1: it splits the "
            "sequence over the tensor-parallel ranks (Megatron-LM turns it off there too)"
        )
    if args.sequence_parallel and args.seq_length % topology.tp:
        raise UsageError(
            f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
            f"--tensor-model-parallel-size {topology.tp}"
        )
    validate_context_parallel(
        topology,
        seq_length=model.seq_length,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        comm_type=cp_comm_type,
        sequence_parallel=args.sequence_parallel and topology.tp > 1,
        attention_dropout=model.attention_dropout,
    )
    validate_expert_parallel(
        topology,
        num_experts=model.num_experts,
        mics=topology.mics_shard_size != topology.dp_cp,
        capacity=model.moe_expert_capacity_factor is not None,
        dispatcher=args.moe_token_dispatcher_type,
        seq_length=model.seq_length,
    )


def _data_config(args) -> DataConfig:
    from megazero.data.gpt_dataset import parse_split

    split = args.split or DEFAULT_SPLIT
    parse_split(split)
    return DataConfig(
        data_path=args.data_path,
        split=split,
        tokenizer_model=args.tokenizer_model,
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        cache_dir=args.data_cache_path,
        mock_data=args.mock_data,
        mmap_bin_files=not args.no_mmap_bin_files,
        tiktoken_pattern=args.tiktoken_pattern,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        split_paths=per_split_paths(args),
        builder_threads=args.num_dataset_builder_threads,
    )


def _parallel_config(
    args, machine: Machine, topology: Topology, cp_comm_type: str, virtual: int, model: GPTConfig
) -> ParallelConfig:
    chunk_layers = min(args.pipeline_layer_split or [model.num_layers // (topology.pp * virtual)])
    return ParallelConfig(
        tensor_parallel=topology.tp,
        pipeline_parallel=topology.pp,
        sequence_parallel=args.sequence_parallel and topology.tp > 1,
        context_parallel=topology.cp,
        cp_comm_type=cp_comm_type,
        expert_parallel=topology.ep,
        expert_tensor_parallel=topology.etp,
        moe_dispatcher=args.moe_token_dispatcher_type,
        virtual_stages=virtual,
        layer_split=args.pipeline_layer_split,
        cpu_offloading_num_layers=offloaded_layers(args, chunk_layers),
        schedule=args.pipeline_schedule,
        ranks_per_node=topology.ranks_per_node,
        distributed_backend=machine.backend(args.distributed_backend),
        overlap_p2p_comm=args.overlap_p2p_communication,
        timeout_minutes=args.distributed_timeout_minutes,
        heartbeat_minutes=_heartbeat_minutes(args),
    )


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
        raise UsageError(
            f"--heartbeat-timeout-minutes {args.heartbeat_timeout_minutes:g} must be below "
            f"--distributed-timeout-minutes {backend:g}: at the backend's timeout NCCL aborts the "
            f"job naming no rank; lower it, or raise --distributed-timeout-minutes (0 turns it off)"
        )
    return args.heartbeat_timeout_minutes


def _check_ranges(args, ds: DeepSpeedSettings | None, merged: dict) -> None:
    """Numbers out of their range, named as the user wrote them (flag, or key and file)."""
    for name, bounds in MERGED_RANGES.items():
        problem = range_problem(merged[name], bounds)
        if problem:
            origin = setting_origin(args, ds, name, MERGED[name][0])
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


def _model_config(args, topology: Topology, notes: list[str], machine: Machine) -> GPTConfig:
    vocab = tokenizer_vocab_size(args)
    if args.max_position_embeddings and args.max_position_embeddings < args.seq_length:
        raise UsageError(
            f"--max-position-embeddings {args.max_position_embeddings} is smaller than --seq-length {args.seq_length}"
        )
    config, model_notes = model_config(
        args, vocab, topology.tp, topology.pp, machine.uses_cuda(args.distributed_backend)
    )
    notes += model_notes
    return config
