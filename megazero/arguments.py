"""Command-line flags (Megatron-LM's names) -> a validated TrainConfig. The only place argv is read.

Every check that can fail on user input runs here, before any process group exists or any file is
written, and fails with a UsageError whose one line names the flag and the fix. Settings that a
DeepSpeed config (--zero-config) may also carry default to None here, so that a flag and a JSON key
that disagree are reported instead of one silently winning.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from megazero.config import (DataConfig, OptimizerConfig, ParallelConfig, PrecisionConfig,
                             TrainConfig)
from megazero.ds_config import DeepSpeedSettings, load_deepspeed_config
from megazero.errors import UsageError
from megazero.models.config import GPTConfig, padded_vocab_size
from megazero.parallel.topology import Topology, validate_model_fits
from megazero.zero.adam import AdamConfig
from megazero.zero.config import ZeroConfig, as_json, stage_notes

NOT_SUPPORTED_YET = ("save", "load", "wandb_project")


class _Parser(argparse.ArgumentParser):
    def error(self, message):          # one line, no usage block
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="Train a GPT with TP x PP x ZeRO data parallelism.")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=0, help="grouped-query attention (0: MHA)")
    g.add_argument("--ffn-hidden-size", type=int, default=0)
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--max-position-embeddings", type=int, default=0)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--recompute-activations", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=0)
    g.add_argument("--pipeline-schedule", choices=["auto", "1f1b", "gpipe", "interleaved"], default="auto")
    g.add_argument("--pipeline-layer-split", type=int, nargs="+", default=None,
                   help="layers per pipeline chunk, for uneven splits")
    g.add_argument("--ranks-per-node", type=int, default=0, help="default: LOCAL_WORLD_SIZE")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3])
    g.add_argument("--zero-config", default=None, help="DeepSpeed JSON (whole config or zero_optimization)")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=200)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--adam-beta1", type=float, default=None)
    g.add_argument("--adam-beta2", type=float, default=None)
    g.add_argument("--adam-eps", type=float, default=None)
    g.add_argument("--clip-grad", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--bf16", action="store_true", default=None)
    g.add_argument("--fp16", action="store_true", default=None)
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=None)
    g.add_argument("--min-loss-scale", type=float, default=None)
    g.add_argument("--loss-scale-window", type=int, default=None)
    g.add_argument("--hysteresis", type=int, default=None)
    g.add_argument("--grad-reduce-in-bf16", dest="reduce_dtype", action="store_const", const="bf16",
                   default=None, help="reduce gradients in bf16 (needs --bf16; default fp32)")
    g = p.add_argument_group("data and logging")
    g.add_argument("--data-path", nargs="+", default=None)
    g.add_argument("--split", default="949,50,1")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--tokenizer-type", choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer"],
                   default="SentencePieceTokenizer")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--log-interval", type=int, default=None)
    g.add_argument("--run-dir", default=None, help="default: runs/gpt-<date>-<time>")
    g.add_argument("--metrics-file", default=None, help="default: <run-dir>/metrics.jsonl")
    g = p.add_argument_group("not supported yet (rejected)")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--wandb-project", default=None)
    return p


# Settings that a flag or a DeepSpeed key may give: name -> (flag, default when neither does).
MERGED = {
    "micro_batch_size": ("--micro-batch-size", 8), "global_batch_size": ("--global-batch-size", None),
    "clip_grad": ("--clip-grad", 1.0), "lr": ("--lr", 1e-3), "weight_decay": ("--weight-decay", 0.01),
    "adam_beta1": ("--adam-beta1", 0.9), "adam_beta2": ("--adam-beta2", 0.95),
    "adam_eps": ("--adam-eps", 1e-8), "bf16": ("--bf16", False), "fp16": ("--fp16", False),
    "loss_scale": ("--loss-scale", 0.0), "min_loss_scale": ("--min-loss-scale", 1.0),
    "loss_scale_window": ("--loss-scale-window", 1000), "hysteresis": ("--hysteresis", 2),
    "log_interval": ("--log-interval", 10), "seed": ("--seed", 1234),
    "reduce_dtype": ("--grad-reduce-in-bf16", "fp32"),
}
SWITCHES = {"bf16", "fp16", "reduce_dtype"}       # flags that take no value
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
    power = max(0, int(scale).bit_length() - 1)
    if scale != 2.0 ** power:
        raise UsageError(f"--initial-loss-scale {scale:g} must be a power of two (the dynamic scale "
                         f"moves in factors of 2); use {2 ** power} or {2 ** (power + 1)}")
    if from_json is not None and from_json != power:
        raise UsageError(f"--initial-loss-scale {scale:g} contradicts fp16.initial_scale_power = "
                         f"{from_json} in {config_path}; remove one")
    return power


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def config_from_args(args: argparse.Namespace, world_size: int = 1, local_world_size: int = 0) -> TrainConfig:
    """Validates the flags against each other and the world; raises UsageError on the first problem."""
    for name in NOT_SUPPORTED_YET:
        if getattr(args, name) is not None:
            raise UsageError(f"--{name.replace('_', '-')} is not supported yet; remove it")
    ds = load_deepspeed_config(args.zero_config) if args.zero_config else None
    merged = _merge(args, ds, args.zero_config)
    zero = _zero_config(args, ds)
    precision, notes = _precision_config(args, ds, merged)
    if ds:
        notes = ds.notes + stage_notes(zero, f"{args.zero_config}: zero_optimization") + notes

    topology = Topology(world_size=world_size, tp=args.tensor_model_parallel_size,
                        pp=args.pipeline_model_parallel_size, mics_shard_size=zero.mics_shard_size,
                        ranks_per_node=args.ranks_per_node or local_world_size or world_size)
    model = _model_config(args, topology)
    virtual = _virtual_stages(args, topology)
    validate_model_fits(topology, num_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
                        num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size,
                        virtual_stages=1 if args.pipeline_layer_split else virtual)
    micro, glob = merged["micro_batch_size"], merged["global_batch_size"]
    glob = _global_batch(micro, glob, topology.dp, ds)
    microbatches = glob // (micro * topology.dp)
    _check_pipeline(args, topology, virtual, microbatches)
    if args.sequence_parallel and args.seq_length % topology.tp:
        raise UsageError(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
                         f"--tensor-model-parallel-size {topology.tp}")

    data = DataConfig(data_path=args.data_path, split=args.split, tokenizer_model=args.tokenizer_model,
                      cache_dir=args.data_cache_path)
    optimizer = _optimizer_config(args, merged)
    run_dir = args.run_dir or time.strftime("runs/gpt-%Y%m%d-%H%M%S")
    backend = args.distributed_backend or ("nccl" if _cuda_available() else "gloo")
    return TrainConfig(
        model=model, zero=zero, optimizer=optimizer, data=data,
        parallel=ParallelConfig(tensor_parallel=topology.tp, pipeline_parallel=topology.pp,
                                sequence_parallel=args.sequence_parallel and topology.tp > 1,
                                virtual_stages=virtual, layer_split=args.pipeline_layer_split,
                                schedule=args.pipeline_schedule, ranks_per_node=topology.ranks_per_node,
                                distributed_backend=backend),
        precision=precision,
        micro_batch_size=micro, global_batch_size=glob, train_iters=_positive(args.train_iters, "--train-iters"),
        eval_interval=_positive(args.eval_interval, "--eval-interval"), eval_iters=max(0, args.eval_iters),
        log_interval=_positive(merged["log_interval"], "--log-interval"), seed=merged["seed"],
        run_dir=run_dir, metrics_file=args.metrics_file or str(Path(run_dir) / "metrics.jsonl"),
        wall_clock_breakdown=merged["wall_clock_breakdown"], notes=notes)


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _positive(value: int, flag: str) -> int:
    if value is None or value < 1:
        raise UsageError(f"{flag} must be >= 1, got {value}")
    return value


def _origin(args, ds: DeepSpeedSettings | None, name: str, flag: str | None, attr: str = "",
            with_file: bool = True) -> str | None:
    """Where a setting came from: its flag, else its DeepSpeed key (and file); None when neither set it."""
    if flag and getattr(args, attr or name, None) is not None:
        return flag
    if ds and name in ds.values:
        return f"{ds.source(name)} in {args.zero_config}" if with_file else ds.source(name)
    return None


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
    for name in ("grad_accum_dtype", "reduce_dtype"):
        value = merged[name]
        if value != "fp32" and value != run:
            origin = _origin(args, ds, name, "--grad-reduce-in-bf16" if name == "reduce_dtype" else None)
            undo = "drop it" if origin.startswith("--") else f"set it to \"fp32\""
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
        reduce_dtype=merged["reduce_dtype"])
    return precision, notes


def _zero_config(args, ds: DeepSpeedSettings | None) -> ZeroConfig:
    zero = ds.zero if ds else ZeroConfig()
    if args.zero_stage is not None:
        if ds and "stage" in zero.model_fields_set and zero.stage != args.zero_stage:
            raise UsageError(f"--zero-stage {args.zero_stage} contradicts zero_optimization.stage = "
                             f"{zero.stage} in {args.zero_config}; remove one")
        zero = zero.model_copy(update={"stage": args.zero_stage})
    return zero


def _model_config(args, topology: Topology) -> GPTConfig:
    from megazero.data.default_data import DEFAULT_VOCAB_SIZE
    if args.data_path is None:
        if args.tokenizer_model:
            raise UsageError("--tokenizer-model needs --data-path (the default corpus brings its own tokenizer)")
        vocab = DEFAULT_VOCAB_SIZE
    else:
        from megazero.data.builders import parse_data_path
        from megazero.data.tokenizer import load_tokenizer
        parse_data_path(args.data_path)
        if not args.tokenizer_model:
            raise UsageError("--data-path needs --tokenizer-model (the sentencepiece model the data was "
                             "tokenized with)")
        vocab = load_tokenizer(args.tokenizer_model).vocab_size
    if args.max_position_embeddings and args.max_position_embeddings < args.seq_length:
        raise UsageError(f"--max-position-embeddings {args.max_position_embeddings} is smaller than "
                         f"--seq-length {args.seq_length}")
    try:
        return GPTConfig(
            vocab_size=vocab, hidden_size=args.hidden_size, num_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
            ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
            max_position_embeddings=args.max_position_embeddings,
            padded_vocab_size=padded_vocab_size(vocab, args.make_vocab_size_divisible_by, topology.tp),
            position_embedding="rope" if args.position_embedding_type == "rope" else "learned",
            rotary_base=args.rotary_base, activation="swiglu" if args.swiglu else "gelu",
            normalization="rmsnorm" if args.normalization == "RMSNorm" else "layernorm",
            norm_epsilon=args.norm_epsilon, tie_embeddings=not args.untie_embeddings_and_output_weights,
            add_bias_linear=not args.disable_bias_linear, hidden_dropout=args.hidden_dropout,
            attention_dropout=args.attention_dropout, recompute_activations=args.recompute_activations,
            init_method_std=args.init_method_std)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _virtual_stages(args, topology: Topology) -> int:
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if not per_stage:
        return 1
    if topology.pp == 1:
        raise UsageError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if args.num_layers % (per_stage * topology.pp):
        raise UsageError(f"--num-layers {args.num_layers} is not divisible by "
                         f"--num-layers-per-virtual-pipeline-stage {per_stage} x pipeline size {topology.pp}")
    return args.num_layers // (per_stage * topology.pp)


def _global_batch(micro: int, glob: int | None, dp: int, ds: DeepSpeedSettings | None) -> int:
    if micro < 1:
        raise UsageError(f"--micro-batch-size must be >= 1, got {micro}")
    accumulation = ds.get("gradient_accumulation_steps") if ds else None
    if glob is None:
        glob = micro * dp * (accumulation or 1)
    elif accumulation is not None and glob != micro * dp * accumulation:
        raise UsageError(f"train_batch_size/--global-batch-size {glob} != micro batch {micro} x "
                         f"gradient_accumulation_steps {accumulation} x data-parallel size {dp}")
    if glob % (micro * dp):
        raise UsageError(f"--global-batch-size {glob} is not divisible by --micro-batch-size {micro} x "
                         f"data-parallel size {dp} = {micro * dp}")
    return glob


def _check_pipeline(args, topology: Topology, virtual: int, microbatches: int) -> None:
    schedule = args.pipeline_schedule
    if topology.pp == 1 and schedule in ("gpipe", "1f1b", "interleaved"):
        raise UsageError(f"--pipeline-schedule {schedule} needs --pipeline-model-parallel-size > 1")
    if virtual > 1 and schedule in ("gpipe", "1f1b"):
        raise UsageError(f"--pipeline-schedule {schedule} runs one model chunk per stage; drop "
                         f"--num-layers-per-virtual-pipeline-stage or use 'interleaved'")
    if virtual > 1 or schedule == "interleaved":
        if microbatches % topology.pp:
            raise UsageError(f"the interleaved schedule needs the number of microbatches ({microbatches} "
                             f"= global batch / (micro batch x dp)) to be a multiple of the pipeline "
                             f"size {topology.pp}; raise --global-batch-size")


def _optimizer_config(args, merged: dict) -> OptimizerConfig:
    if args.lr_warmup_iters is not None and args.lr_warmup_fraction is not None:
        raise UsageError("--lr-warmup-iters and --lr-warmup-fraction are both set; choose one")
    decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay_iters)
    else:
        warmup = args.lr_warmup_iters if args.lr_warmup_iters is not None else min(20, args.train_iters // 10)
    lr = merged["lr"]
    min_lr = args.min_lr if args.min_lr is not None else lr / 10
    if min_lr > lr:
        raise UsageError(f"--min-lr {min_lr} is larger than --lr {lr}")
    adam = AdamConfig(lr=lr, beta1=merged["adam_beta1"], beta2=merged["adam_beta2"], eps=merged["adam_eps"],
                      weight_decay=merged["weight_decay"],
                      decoupled_weight_decay=merged["decoupled_weight_decay"])
    return OptimizerConfig(lr=lr, min_lr=min_lr, warmup_iters=warmup, decay_iters=decay_iters,
                           decay_style=args.lr_decay_style, adam=adam, clip_grad=merged["clip_grad"])
