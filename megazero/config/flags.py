"""The command line's shape: every flag of pretrain_gpt.py with a one-line help that ends in its
default, the launcher flags other tools add (`--local_rank`, `--deepspeed_config`), and the parse.
The areas with a *_flags module of their own (precision, optimizer and its states, Muon, ZeRO, MoE,
checkpoints, monitors, housekeeping) add their flags here through `_add` and `_merged`, in the
order --help lists them.

The parse turns every argparse complaint into one UsageError line: a misspelled flag gets the
nearest real one, a Megatron-LM flag megazero lacks is named as such. What the flags mean together
is megazero.config.train_flags', which also checks the values against the ranges listed here.
"""
from __future__ import annotations

import argparse
import difflib
import functools
import math
from pathlib import Path

from megazero.core.errors import UsageError
from megazero.config.checkpoint_flags import add_checkpoint_flags
from megazero.config.moe_flags import add_moe_flags
from megazero.config.monitor_flags import add_monitor_flags
from megazero.config.optimizer_flags import add_optimizer_flags
from megazero.config.optimizer_state_flags import add_optimizer_state_flags
from megazero.config.muon_flags import add_muon_flags
from megazero.config.precision_flags import add_precision_flags
from megazero.config.run_flags import add_run_flags
from megazero.config.zero_flags import add_zero_flags

# Settings that a flag or a DeepSpeed key may give: name -> (flag, default when neither does). The
# parser's own default is None, so that a flag and a JSON key that disagree can be told apart.
MERGED = {
    "micro_batch_size": ("--micro-batch-size", 8), "global_batch_size": ("--global-batch-size", None),
    "clip_grad": ("--clip-grad", 1.0), "lr": ("--lr", 1e-3), "weight_decay": ("--weight-decay", 0.01),
    "adam_beta1": ("--adam-beta1", 0.9), "adam_beta2": ("--adam-beta2", 0.95),
    "adam_eps": ("--adam-eps", 1e-8), "bf16": ("--bf16", False), "fp16": ("--fp16", False),
    "loss_scale": ("--loss-scale", 0.0), "min_loss_scale": ("--min-loss-scale", 1.0),
    "loss_scale_window": ("--loss-scale-window", 1000), "hysteresis": ("--hysteresis", 2),
    "log_interval": ("--log-interval", 10), "seed": ("--seed", 1234),
    "reduce_dtype": ("--grad-reduce-in-bf16", "fp32"),
    "optimizer": ("--optimizer", "adam"), "muon_momentum": ("--muon-momentum", None),
}
# Megatron-LM's flags, by argument group (megatron_flags.txt, written from Megatron-LM's own parser by
# tools/megatron_flag_list.py): one megazero lacks is named as such instead of "did you mean".
MEGATRON_FLAGS_FILE = Path(__file__).with_name("megatron_flags.txt")


@functools.cache
def megatron_flag_groups() -> dict[str, tuple[str, ...]]:
    """{Megatron-LM argument group: (--flag, ...)}, as megatron_flags.txt lists them."""
    groups: dict[str, list[str]] = {}
    current: list[str] = []
    for line in MEGATRON_FLAGS_FILE.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            current = groups.setdefault(line[1:-1], [])
        elif line and not line.startswith("#"):
            current.append(line)
    return {title: tuple(flags) for title, flags in groups.items()}


def megatron_flags_megazero_lacks() -> set[str]:
    """Megatron-LM's flags that megazero's parser does not take."""
    taken = build_parser()._option_string_actions
    return {flag for flags in megatron_flag_groups().values() for flag in flags if flag not in taken}


# Ranges of settings that a flag or a DeepSpeed key may give: name -> (lowest, lowest allowed,
# highest or None, highest allowed).
MERGED_RANGES = {"lr": (0, True, None, False), "weight_decay": (0, True, None, False),
                 "adam_beta1": (0, True, 1, False), "adam_beta2": (0, True, 1, False),
                 "adam_eps": (0, False, None, False), "clip_grad": (0, True, None, False),
                 "loss_scale": (0, True, None, False), "min_loss_scale": (0, False, None, False)}
# Ranges of flags only the command line gives: args attribute -> (lowest, lowest allowed, highest, ...).
FLAG_RANGES = {"min_lr": (0, True, None, False), "decoupled_lr": (0, True, None, False),
               "decoupled_min_lr": (0, True, None, False), "rotary_base": (0, False, None, False),
               "norm_epsilon": (0, False, None, False), "init_method_std": (0, False, None, False),
               "lr_warmup_fraction": (0, True, 1, True), "lr_warmup_iters": (0, True, None, False),
               "lr_decay_iters": (1, True, None, False), "train_samples": (1, True, None, False),
               "lr_warmup_samples": (0, True, None, False), "lr_decay_samples": (1, True, None, False),
               "eval_iters": (0, True, None, False), "make_vocab_size_divisible_by": (1, True, None, False),
               "tensor_model_parallel_size": (1, True, None, False),
               "pipeline_model_parallel_size": (1, True, None, False),
               "context_parallel_size": (1, True, None, False), "ds_sequence_parallel_size": (1, True, None, False),
               "num_query_groups": (1, True, None, False), "ffn_hidden_size": (0, True, None, False),
               "kv_channels": (1, True, None, False), "rotary_percent": (0, False, 1, True),
               "recompute_num_layers": (1, True, None, False), "cpu_offloading_num_layers": (0, True, None, False),
               "max_position_embeddings": (0, True, None, False), "ranks_per_node": (0, True, None, False),
               "num_layers_per_virtual_pipeline_stage": (0, True, None, False),
               "zero_hpz_partition_size": (1, True, None, False), "zero_sub_group_size": (1, True, None, False),
               "cpu_optimizer_threads": (1, True, None, False),
               "distributed_timeout_minutes": (0, False, None, False),
               "heartbeat_timeout_minutes": (0, True, None, False),
               "num_dataset_builder_threads": (1, True, None, False)}


def range_text(bounds) -> str:
    low, low_in, high, high_in = bounds
    if high is None:
        return f"{'>=' if low_in else '>'} {low}"
    return f"in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


def range_problem(value, bounds) -> str | None:
    """Why `value` is outside `bounds` ("must be ..."), or None when it is inside."""
    if not math.isfinite(value):
        return f"must be finite ({range_text(bounds)})"
    return None if in_range(value, bounds) else f"must be {range_text(bounds)}"


def in_range(value, bounds) -> bool:
    low, low_in, high, high_in = bounds
    if not math.isfinite(value):
        return False
    above = value >= low if low_in else value > low
    below = high is None or (value <= high if high_in else value < high)
    return above and below


# The help's first screen: one line per flag group (argparse's group titles), then the flags.
GROUPS = {
    "model": "the transformer's shape: layers, width, heads, positions, MLP, norms, dropout, init",
    "parallelism": "tensor / pipeline / ZeRO data parallelism, the DeepSpeed config, offload, ZeRO++, timeouts",
    "training": "batch sizes, iterations, the lr schedule, Adam, clipping, seed, precision, loss scaling",
    "data and logging": "data, tokenizer, evaluation, log cadence, run folder and metrics file",
    "checkpoints": "save, load, resume, the schedule on resume, stopping, signals, failed saves",
    "monitoring": "wandb and TensorBoard (optional extras: .[wandb], .[tensorboard])",
}
USAGE = "python pretrain_gpt.py [FLAGS]   (torchrun --nproc-per-node N pretrain_gpt.py [FLAGS])"


class _Parser(argparse.ArgumentParser):
    def error(self, message):          # one line, no usage block
        raise UsageError(message)


def _description() -> str:
    width = max(len(name) for name in GROUPS) + 2
    lines = [f"  {name:<{width}}{what}" for name, what in GROUPS.items()]
    return ("Train a GPT with TP x PP x ZeRO data parallelism. Flags follow Megatron-LM's names.\n\n"
            "flag groups:\n" + "\n".join(lines))


class _Help(argparse.RawDescriptionHelpFormatter):
    """Flags and their help on one line where the terminal allows (argparse's column is narrow)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=38, width=120)


def _add(group, *names, help: str, shown=None, **kwargs) -> None:
    """A flag whose help ends in its default: `shown` when the parser's default (None) stands for
    "a DeepSpeed config or this value"."""
    default = kwargs.get("default")
    if shown is None:
        shown = "off" if kwargs.get("action") == "store_true" else default
    if kwargs.get("action") is None and "choices" not in kwargs and "metavar" not in kwargs:
        kwargs["metavar"] = {int: "N", float: "X"}.get(kwargs.get("type"), "VALUE")
    group.add_argument(*names, help=f"{help} (default: {shown})".replace("%", "%%"), **kwargs)


def _merged(group, name: str, help: str, **kwargs) -> None:
    flag, default = MERGED[name]
    shown = "off" if default is False else "micro batch x data-parallel size" if default is None else default
    if kwargs.get("action") is None:
        kwargs.setdefault("default", None)
    _add(group, flag, help=f"{help}; a DeepSpeed config may set it instead", shown=shown, **kwargs)


def _model_flags(p) -> None:
    g = p.add_argument_group("model")
    _add(g, "--num-layers", type=int, default=4, help="transformer layers")
    _add(g, "--hidden-size", type=int, default=256, help="model width")
    _add(g, "--num-attention-heads", type=int, default=4, help="attention heads")
    _add(g, "--group-query-attention", action="store_true",
         help="grouped-query attention with --num-query-groups key/value heads")
    _add(g, "--num-query-groups", type=int, default=None,
         help="key/value head groups of --group-query-attention (ignored without it, as in Megatron-LM)",
         shown="1 with --group-query-attention")
    _add(g, "--kv-channels", type=int, default=None, help="width of each attention head",
         shown="hidden size / attention heads")
    _add(g, "--ffn-hidden-size", type=int, default=0, help="MLP width; 0: 4 x hidden (8/3 x for SwiGLU)")
    _add(g, "--seq-length", type=int, default=256, help="tokens per sample")
    _add(g, "--max-position-embeddings", type=int, default=0, help="rows of the position table; 0: seq length")
    _add(g, "--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute",
         help="position encoding")
    _add(g, "--no-position-embedding", action="store_true", help="no learned position table (with rope)")
    _add(g, "--rotary-base", type=float, default=10000.0, help="RoPE frequency base")
    _add(g, "--rotary-percent", type=float, default=1.0,
         help="fraction of each head's dims RoPE rotates (the leading ones), in (0, 1]")
    _add(g, "--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"], default="auto",
         help="attention kernels: SDPA's choice, its flash or fused (cuDNN/memory-efficient) kernels, or the "
              "math written out (unfused, local)")
    _add(g, "--swiglu", action="store_true", help="SwiGLU MLP instead of GELU")
    _add(g, "--openai-gelu", action="store_true", help="tanh-approximated GELU (GPT-2's; the default)")
    _add(g, "--no-bias-gelu-fusion", action="store_true",
         help="exact (erf) GELU, as Megatron's unfused GELU, unless --openai-gelu")
    _add(g, "--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm", help="norm layers")
    _add(g, "--norm-epsilon", type=float, default=1e-5, help="epsilon of the norm layers")
    _add(g, "--apply-layernorm-1p", action="store_true",
         help="zero-centred norm scale: the norms multiply by weight + 1, weight starts at 0")
    _add(g, "--untie-embeddings-and-output-weights", action="store_true",
         help="separate output layer instead of the input embedding")
    _add(g, "--disable-bias-linear", action="store_true", help="no biases in linear layers")
    _add(g, "--add-qkv-bias", action="store_true", help="biases in the QKV projection, whatever --disable-bias-linear")
    _add(g, "--hidden-dropout", type=float, default=0.1, help="dropout on hidden states, in [0, 1)")
    _add(g, "--attention-dropout", type=float, default=0.1, help="dropout on attention weights, in [0, 1)")
    _add(g, "--recompute-activations", action="store_true",
         help="selective recomputation: each layer's core attention is recomputed in backward "
              "(= --recompute-granularity selective, as in Megatron-LM)")
    _add(g, "--recompute-granularity", choices=["full", "selective"], default=None,
         help="recompute whole layers (full) or the core attention (selective) in backward", shown="none")
    _add(g, "--recompute-method", choices=["uniform", "block"], default=None,
         help="full: checkpoint groups of --recompute-num-layers layers (uniform), or only the first "
              "--recompute-num-layers layers of each pipeline stage (block)", shown="none")
    _add(g, "--recompute-num-layers", type=int, default=None,
         help="full: layers per group (uniform) or layers recomputed per pipeline stage (block)", shown="none")
    _add(g, "--cpu-offloading", action="store_true",
         help="activation offload: the first --cpu-offloading-num-layers layers of each pipeline stage keep "
              "their saved activations in host memory between forward and backward (docs/flags.md)")
    _add(g, "--cpu-offloading-num-layers", type=int, default=None,
         help="activation offload of the first N layers of each pipeline stage (model chunk); N > 0 turns "
              "it on, as in Megatron-LM", shown="0, or all layers with --cpu-offloading")
    _add(g, "--cross-entropy-loss-fusion", action="store_true",
         help="accepted: the output layer and cross entropy always run fused, chunk by chunk")
    _add(g, "--compile", action="store_true", help="torch.compile each transformer layer")
    _add(g, "--compile-backend", default="inductor", help="torch.compile backend for --compile")
    _add(g, "--init-method-std", type=float, default=0.02, help="std of the normal weight init")
    _add(g, "--make-vocab-size-divisible-by", type=int, default=128,
         help="pad the vocabulary to a multiple of this x tensor-parallel size")


def _parallel_flags(p) -> None:
    g = p.add_argument_group("parallelism")
    _add(g, "--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks")
    _add(g, "--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages")
    _add(g, "--sequence-parallel", action="store_true", help="split norms and dropout along the sequence (tp > 1)")
    _add(g, "--context-parallel-size", type=int, default=1,
         help="context-parallel ranks: each holds 2 of 2N load-balanced chunks of every sequence")
    _add(g, "--cp-comm-type", choices=["p2p", "a2a", "allgather"], default="p2p",
         help="how attention sees the whole sequence under context parallelism: p2p ring attention, "
              "a2a (Ulysses) all-to-all over heads, allgather of keys and values")
    _add(g, "--ds-sequence-parallel-size", type=int, default=None,
         help="Megatron-DeepSpeed's Ulysses: --context-parallel-size N --cp-comm-type a2a", shown="off")
    _add(g, "--num-layers-per-virtual-pipeline-stage", type=int, default=0,
         help="layers per model chunk of the interleaved schedule; 0: one chunk per stage")
    _add(g, "--pipeline-schedule",
         choices=["auto", "1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "interleaved-zb", "dualpipev"],
         default="auto", help="pipeline schedule; zb-h1, zbv, interleaved-zb and dualpipev split each "
                              "backward and defer the weight gradients into the bubble")
    _add(g, "--pipeline-layer-split", type=int, nargs="+", default=None,
         help="layers per pipeline chunk, for uneven splits", shown="even")
    _add(g, "--overlap-p2p-communication", action="store_true",
         help="1f1b/interleaved: pipeline sends and receives move while the stage computes")
    _add(g, "--ranks-per-node", type=int, default=0, help="ranks per node; 0: LOCAL_WORLD_SIZE")
    _add(g, "--distributed-backend", choices=["gloo", "nccl"], default=None, help="process-group backend",
         shown="nccl when CUDA is available, else gloo")
    _add(g, "--distributed-timeout-minutes", type=float, default=10.0,
         help="how long a collective waits for a silent rank, and the ranks at start-up for each other, "
              "before the job ends naming it (fractions allowed)")
    _add(g, "--heartbeat-timeout-minutes", type=float, default=None,
         help="how long a rank may miss its heartbeats (stopped, killed, host lost) before the job ends "
              "naming it, whatever the backend; below --distributed-timeout-minutes (0: off)",
         shown="half of --distributed-timeout-minutes")
    _add(g, "--zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
         help="ZeRO stage: 1 optimizer states, 2 + gradients, 3 + parameters partitioned",
         shown="0, or the config's zero_optimization.stage")
    _add(g, "--zero-config", default=None, metavar="JSON",
         help="DeepSpeed JSON (whole config or zero_optimization)", shown="none")
    _add(g, "--deepspeed_config", "--deepspeed-config", default=None, metavar="JSON",
         help="Megatron-DeepSpeed's name for --zero-config", shown="none")
    _add(g, "--use-distributed-optimizer", action="store_true",
         help="Megatron-LM's name for ZeRO-1; stage 1 unless a stage is given")
    _add(g, "--overlap-grad-reduce", action="store_true",
         help="overlap gradient reduction with backward (zero_optimization.overlap_comm)",
         shown="on at every stage; a DeepSpeed config's overlap_comm: false turns it off")
    _add(g, "--overlap-param-gather", action="store_true",
         help="overlap parameter gathers with compute (stage 3 prefetch)")
    _add(g, "--deepspeed", action="store_true", help="accepted for Megatron-DeepSpeed launch lines; no effect")
    add_zero_flags(g, _add)
    _add(g, "--local-rank", "--local_rank", type=int, default=None,
         help="set by the deepspeed and torch.distributed.launch launchers", shown="LOCAL_RANK")


def _training_flags(p) -> None:
    g = p.add_argument_group("training")
    _merged(g, "micro_batch_size", "samples per microbatch per data-parallel rank", type=int)
    _merged(g, "global_batch_size", "samples per optimizer step", type=int)
    _add(g, "--train-iters", type=int, default=None, help="optimizer steps", shown=200)
    _add(g, "--train-samples", type=int, default=None, help="samples to train on (instead of --train-iters)",
         shown="none")
    add_optimizer_flags(g, _add, _merged)
    add_optimizer_state_flags(g, _add)
    add_muon_flags(g, _add)
    _merged(g, "seed", "random seed", type=int)
    add_precision_flags(g, _add, _merged)


def _data_flags(p) -> None:
    g = p.add_argument_group("data and logging")
    _add(g, "--data-path", nargs="+", default=None, help="prefix of a .bin/.idx pair, or 'weight prefix ...'",
         shown="the embedded standard-library corpus")
    _add(g, "--mock-data", action="store_true",
         help="train on random tokens of the tokenizer's vocabulary (no data files)")
    _add(g, "--split", default=None, help="train,valid,test weights cutting --data-path's sequences, as "
         "megatron-core does", shown="949,50,1")
    for split in ("train", "valid", "test"):
        _add(g, f"--{split}-data-path", nargs="+", default=None,
             help=f"the {split} split's own prefix or 'weight prefix ...' blend, whole (instead of --data-path "
                  f"and --split)", shown="none")
    _add(g, "--num-dataset-builder-threads", type=int, default=1,
         help="threads building a blend's datasets (their sample indices) at once")
    _add(g, "--object-storage-cache-path", default=None,
         help="refused: megazero reads data from local files only", shown="none")
    _add(g, "--tokenizer-model", default=None,
         help="sentencepiece .model, or Hugging Face tokenizer folder/tokenizer.json, the data was tokenized with",
         shown="the embedded corpus's")
    _add(g, "--tokenizer-type", choices=["SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                                         "NullTokenizer", "TikTokenizer"],
         default=None, help="tokenizer kind",
         shown="GPT2BPETokenizer with --vocab-file and --merge-file, else SentencePieceTokenizer")
    _add(g, "--tiktoken-pattern", choices=["v1", "v2"], default=None,
         help="TikTokenizer's pre-tokenization pattern (needs the tiktoken package)", shown="v2")
    _add(g, "--num-workers", type=int, default=2,
         help="0: batches read in the training loop; >0: read ahead by a background thread")
    _add(g, "--no-mmap-bin-files", action="store_true", help="read .bin files with plain reads instead of mmap")
    _add(g, "--reset-position-ids", action="store_true",
         help="packed samples: positions restart at 0 after each end-of-document token")
    _add(g, "--reset-attention-mask", action="store_true",
         help="packed samples: attention stays inside each document (block-diagonal causal)")
    _add(g, "--eod-mask-loss", action="store_true", help="no loss where the input token is the end-of-document token")
    _add(g, "--no-create-attention-mask-in-dataloader", action="store_true",
         help="accepted: megazero never builds attention masks")
    _add(g, "--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json", shown="none")
    _add(g, "--merge-file", default=None, help="GPT2BPETokenizer's merges.txt", shown="none")
    _add(g, "--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary, eod = vocab-size - 1",
         shown="none")
    _add(g, "--data-cache-path", default=None, help="folder for sample indices and the embedded corpus",
         shown="beside the data; $MEGAZERO_CACHE or ~/.cache/megazero")
    _add(g, "--eval-interval", type=int, default=100, help="steps between evaluations")
    _add(g, "--eval-iters", type=int, default=10, help="batches per evaluation; 0: none")
    _merged(g, "log_interval", "steps between log lines", type=int)
    _add(g, "--run-dir", default=None, help="folder for this run's outputs", shown="runs/gpt-<date>-<time>-<6 hex>")
    _add(g, "--metrics-file", default=None, help="JSON lines of the logged metrics",
         shown="<run-dir>/metrics.jsonl")
    add_checkpoint_flags(p.add_argument_group("checkpoints"), _add)
    add_monitor_flags(p.add_argument_group("monitoring"), _add)
    add_run_flags(p.add_argument_group("housekeeping, logging and profiling"), _add)
    add_moe_flags(p.add_argument_group("mixture of experts"), _add)


def build_parser() -> argparse.ArgumentParser:
    # A short usage line instead of argparse's synopsis of every flag (85 lines before any description).
    p = _Parser(prog="pretrain_gpt.py", usage=USAGE, description=_description(), allow_abbrev=False,
                formatter_class=_Help)
    for add_flags in (_model_flags, _parallel_flags, _training_flags, _data_flags):
        add_flags(p)
    return p


def _unknown_flag_error(parser: argparse.ArgumentParser, extras: list[str]) -> UsageError:
    flags = [token.split("=", 1)[0] for token in extras if token.startswith("-")]
    if not flags:
        return UsageError(f"unexpected argument {extras[0]!r}; every value follows its --flag")
    flag = flags[0]
    if any(flag in flags for flags in megatron_flag_groups().values()):
        return UsageError(f"{flag} is a Megatron-LM flag megazero does not have; remove it "
                          f"(python pretrain_gpt.py --help lists what megazero takes)")
    near = difflib.get_close_matches(flag, parser._option_string_actions, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}?" if near else "python pretrain_gpt.py --help lists every flag"
    return UsageError(f"unrecognized flag {flag}; {hint}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        raise _unknown_flag_error(parser, extras)
    return args
