"""The command line's shape: every flag of pretrain_gpt.py with a one-line help that ends in its
default, the launcher flags other tools add (`--local_rank`, `--deepspeed_config`), and the parse.
Each area's *_flags module (model, parallelism, data and logging, precision, optimizer and its
states, Muon, checkpoints, monitors, housekeeping, MoE) adds its flags here through `_add` and
`_merged`, in the order --help lists them.

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
from megazero.config.data_flags import add_data_flags
from megazero.config.model_flags import add_model_flags
from megazero.config.moe_flags import add_moe_flags
from megazero.config.monitor_flags import add_monitor_flags
from megazero.config.optimizer_flags import add_optimizer_flags
from megazero.config.optimizer_state_flags import add_optimizer_state_flags
from megazero.config.parallel_flags import add_parallel_flags
from megazero.config.muon_flags import add_muon_flags
from megazero.config.precision_flags import add_precision_flags
from megazero.config.run_flags import add_run_flags

# Settings that a flag or a DeepSpeed key may give: name -> (flag, default when neither does). The
# parser's own default is None, so that a flag and a JSON key that disagree can be told apart.
MERGED = {
    "micro_batch_size": ("--micro-batch-size", 8),
    "global_batch_size": ("--global-batch-size", None),
    "clip_grad": ("--clip-grad", 1.0),
    "lr": ("--lr", 1e-3),
    "weight_decay": ("--weight-decay", 0.01),
    "adam_beta1": ("--adam-beta1", 0.9),
    "adam_beta2": ("--adam-beta2", 0.95),
    "adam_eps": ("--adam-eps", 1e-8),
    "bf16": ("--bf16", False),
    "fp16": ("--fp16", False),
    "loss_scale": ("--loss-scale", 0.0),
    "min_loss_scale": ("--min-loss-scale", 1.0),
    "loss_scale_window": ("--loss-scale-window", 1000),
    "hysteresis": ("--hysteresis", 2),
    "log_interval": ("--log-interval", 10),
    "seed": ("--seed", 1234),
    "reduce_dtype": ("--grad-reduce-in-bf16", "fp32"),
    "optimizer": ("--optimizer", "adam"),
    "muon_momentum": ("--muon-momentum", None),
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
MERGED_RANGES = {
    "lr": (0, True, None, False),
    "weight_decay": (0, True, None, False),
    "adam_beta1": (0, True, 1, False),
    "adam_beta2": (0, True, 1, False),
    "adam_eps": (0, False, None, False),
    "clip_grad": (0, True, None, False),
    "loss_scale": (0, True, None, False),
    "min_loss_scale": (0, False, None, False),
}
# Ranges of flags only the command line gives: args attribute -> (lowest, lowest allowed, highest, ...).
FLAG_RANGES = {
    "min_lr": (0, True, None, False),
    "decoupled_lr": (0, True, None, False),
    "decoupled_min_lr": (0, True, None, False),
    "rotary_base": (0, False, None, False),
    "norm_epsilon": (0, False, None, False),
    "init_method_std": (0, False, None, False),
    "lr_warmup_fraction": (0, True, 1, True),
    "lr_warmup_iters": (0, True, None, False),
    "lr_decay_iters": (1, True, None, False),
    "train_samples": (1, True, None, False),
    "lr_warmup_samples": (0, True, None, False),
    "lr_decay_samples": (1, True, None, False),
    "eval_iters": (0, True, None, False),
    "make_vocab_size_divisible_by": (1, True, None, False),
    "tensor_model_parallel_size": (1, True, None, False),
    "pipeline_model_parallel_size": (1, True, None, False),
    "context_parallel_size": (1, True, None, False),
    "ds_sequence_parallel_size": (1, True, None, False),
    "num_query_groups": (1, True, None, False),
    "ffn_hidden_size": (0, True, None, False),
    "kv_channels": (1, True, None, False),
    "rotary_percent": (0, False, 1, True),
    "recompute_num_layers": (1, True, None, False),
    "cpu_offloading_num_layers": (0, True, None, False),
    "max_position_embeddings": (0, True, None, False),
    "ranks_per_node": (0, True, None, False),
    "num_layers_per_virtual_pipeline_stage": (0, True, None, False),
    "zero_hpz_partition_size": (1, True, None, False),
    "zero_sub_group_size": (1, True, None, False),
    "cpu_optimizer_threads": (1, True, None, False),
    "distributed_timeout_minutes": (0, False, None, False),
    "heartbeat_timeout_minutes": (0, True, None, False),
    "num_dataset_builder_threads": (1, True, None, False),
}


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
    def error(self, message):  # one line, no usage block
        raise UsageError(message)


def _description() -> str:
    width = max(len(name) for name in GROUPS) + 2
    lines = [f"  {name:<{width}}{what}" for name, what in GROUPS.items()]
    return (
        "Train a GPT with TP x PP x ZeRO data parallelism. Flags follow Megatron-LM's names.\n\n"
        "flag groups:\n" + "\n".join(lines)
    )


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


def _training_flags(p) -> None:
    g = p.add_argument_group("training")
    _merged(g, "micro_batch_size", "samples per microbatch per data-parallel rank", type=int)
    _merged(g, "global_batch_size", "samples per optimizer step", type=int)
    _add(g, "--train-iters", type=int, default=None, help="optimizer steps", shown=200)
    _add(
        g,
        "--train-samples",
        type=int,
        default=None,
        help="samples to train on (instead of --train-iters)",
        shown="none",
    )
    add_optimizer_flags(g, _add, _merged)
    add_optimizer_state_flags(g, _add)
    add_muon_flags(g, _add)
    _merged(g, "seed", "random seed", type=int)
    add_precision_flags(g, _add, _merged)


def build_parser() -> argparse.ArgumentParser:
    # A short usage line instead of argparse's synopsis of every flag (85 lines before any description).
    p = _Parser(
        prog="pretrain_gpt.py", usage=USAGE, description=_description(), allow_abbrev=False, formatter_class=_Help
    )
    add_model_flags(p.add_argument_group("model"), _add)
    add_parallel_flags(p.add_argument_group("parallelism"), _add)
    _training_flags(p)
    add_data_flags(p.add_argument_group("data and logging"), _add, _merged)
    add_checkpoint_flags(p.add_argument_group("checkpoints"), _add)
    add_monitor_flags(p.add_argument_group("monitoring"), _add)
    add_run_flags(p.add_argument_group("housekeeping, logging and profiling"), _add)
    add_moe_flags(p.add_argument_group("mixture of experts"), _add)
    return p


def _unknown_flag_error(parser: argparse.ArgumentParser, extras: list[str]) -> UsageError:
    flags = [token.split("=", 1)[0] for token in extras if token.startswith("-")]
    if not flags:
        return UsageError(f"unexpected argument {extras[0]!r}; every value follows its --flag")
    flag = flags[0]
    if any(flag in flags for flags in megatron_flag_groups().values()):
        return UsageError(
            f"{flag} is a Megatron-LM flag megazero does not have; remove it "
            f"(python pretrain_gpt.py --help lists what megazero takes)"
        )
    near = difflib.get_close_matches(flag, parser._option_string_actions, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}?" if near else "python pretrain_gpt.py --help lists every flag"
    return UsageError(f"unrecognized flag {flag}; {hint}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        raise _unknown_flag_error(parser, extras)
    return args
