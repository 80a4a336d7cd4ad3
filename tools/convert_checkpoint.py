"""Convert megazero checkpoints.

    python tools/convert_checkpoint.py consolidate --load runs/ckpt --output out/model [--with-optimizer]
    python tools/convert_checkpoint.py export-hf --load runs/ckpt --output out/hf [--format auto|gpt2|llama|mixtral|qwen2_moe]
                                             [--without-tokenizer] [--overwrite]
    python tools/convert_checkpoint.py import-hf --input path/to/hf_model --save runs/imported
    python tools/convert_checkpoint.py import-megatron --input megatron/save_dir --save runs/imported
    python tools/convert_checkpoint.py export-megatron --load runs/ckpt --output megatron/save_dir

`consolidate` writes the full fp32 model of a sharded checkpoint (any layout) as
OUT/model.safetensors + OUT/config.json, loadable by megazero.models.GPT with strict=True, reading
one parameter at a time (see megazero/checkpoint/consolidate.py). It prints the peak memory it used.

`export-hf` writes a checkpoint of any layout as OUT/config.json + OUT/model.safetensors (fp32) in
GPT2LMHeadModel's format (learned positions, GELU, LayerNorm) or LlamaForCausalLM's (rotary, SwiGLU,
RMSNorm), mixtures of experts as MixtralForCausalLM's or Qwen2MoeForCausalLM's (a gated shared
expert); `auto` picks by the position embedding, the experts and the shared expert. A model the format cannot express exactly is
refused, naming the option. The run's tokenizer (which every checkpoint keeps) goes with it in the
form transformers loads (megazero/data/tokenizer_export.py), its bos/eos/pad ids in config.json and
generation_config.json, so `AutoTokenizer`, `generate` and `pipeline("text-generation")` work from
the folder alone; a checkpoint without a tokenizer, or one transformers cannot load exactly, is
refused unless --without-tokenizer asks for the weights alone. A non-empty output folder is refused
unless --overwrite (files of the names export-hf writes are replaced, others stay). `import-hf` reads such a directory
(local files only; safetensors, one file or sharded with its index) into a one-rank megazero
checkpoint that `--load`/`--finetune` accept at any layout, with the folder's tokenizer (tokenizer.json,
a sentencepiece tokenizer.model, or GPT-2's vocab.json + merges.txt) kept as the checkpoint's. Names,
shapes and configs are mapped in models/hf_adapter.py (megazero.models.hf_adapter); this file only
reads and writes. `import-megatron` reads a Megatron-LM checkpoint (`--ckpt-format torch_dist`, or
the legacy per-rank `model_optim_rng.pt` files at any TP/PP/EP, virtual pipelines included; mixtures
of experts too) into a one-rank megazero checkpoint:
with the distributed optimizer's Adam states where it holds them (torch_dist `fully_reshardable` or
`dp_reshardable`, or legacy `distrib_optim.pt`), the iteration, Adam's step, the lr schedule and the consumed samples, so
`pretrain_gpt.py --load` continues the run at any layout; else, or with --weights-only, the weights
at iteration 0. `export-megatron` writes one as `--ckpt-format torch_dist` that megatron-core loads
at any layout, with the Adam states (as `fully_reshardable`), step and schedule when the checkpoint
has taken a step (megazero/checkpoint/megatron_files.py and megatron_optim.py read and write,
models/megatron_adapter.py maps). Every file gets the umask's mode (0644 by default).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import uuid
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megazero.checkpoint import CheckpointReader, write_full_checkpoint
from megazero.checkpoint.consolidate import consolidate
from megazero.checkpoint import megatron_files
from megazero.checkpoint.files import LATEST, TOKENIZER_DIR, apply_umask
from megazero.core.errors import UsageError, check_writable_dir
from megazero.data.tokenizer_export import HFTokenizer
from megazero.data.tokenizer import load_tokenizer, saved_form, tokenizer_from_saved
from megazero.data.tokenizer_bpe import GPT2BPETokenizer, HuggingFaceTokenizer
from megazero.models import hf_adapter, megatron_adapter
from megazero.models.config import GPTConfig


def checkpoint_tokenizer(reader: CheckpointReader, without: bool = False) -> HFTokenizer | None:
    """The tokenizer a checkpoint keeps, ready for a model folder (None with `without`); refused when
    the checkpoint keeps none or transformers cannot load it exactly."""
    record = reader.metadata.get("tokenizer")
    if without:
        return None
    if record is None:
        raise UsageError(
            f"export-hf {reader.path}: the checkpoint keeps no tokenizer (it was saved before "
            f"megazero kept one, or imported without one); pass --without-tokenizer to export "
            f"the weights alone"
        )
    try:
        return HFTokenizer(tokenizer_from_saved(reader.path / TOKENIZER_DIR, record))
    except UsageError as err:
        raise UsageError(f"export-hf {reader.path}: {err}") from None


def export_hf(load, output, fmt: str = "auto", without_tokenizer: bool = False, overwrite: bool = False) -> dict:
    """Writes the checkpoint at `load` in a Hugging Face format, with its tokenizer; returns the
    format, the tensor count and the tokenizer's type (None without one). A non-empty `output` is
    refused unless `overwrite` (its files of the same names are then replaced, others left)."""
    out = Path(output)
    if not overwrite and out.is_dir() and any(out.iterdir()):
        names = sorted(p.name for p in out.iterdir())
        raise UsageError(
            f"export-hf --output {out}: the folder is not empty ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}); choose a new or empty folder, or pass "
            f"--overwrite to replace the files export-hf writes there"
        )
    reader = CheckpointReader(load)
    config = GPTConfig(**reader.metadata["model"])

    def read(name):
        tensor = reader.full_tensor(name, "fp32")
        reader.close()  # files are memory-mapped: keep only what was read
        return tensor

    try:
        fmt = hf_adapter.choose_format(config, fmt)
        check_writable_dir(out, f"--output {out}", "choose a writable directory")
        state = hf_adapter.to_hf(config, fmt, read)
    except hf_adapter.ConversionError as err:
        raise UsageError(f"export-hf {reader.path}: {err}") from None
    tokenizer = checkpoint_tokenizer(reader, without_tokenizer)  # checked before a file is written
    out.mkdir(parents=True, exist_ok=True)
    special = tokenizer.special_ids() if tokenizer else {}
    if tokenizer:
        tokenizer.write(out, config.max_position_embeddings)
    # transformers checks this metadata key before it reads a safetensors file
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    apply_umask(out / "model.safetensors")
    config_json = json.dumps(hf_adapter.hf_config(config, fmt, special), indent=2, sort_keys=True)
    (out / "config.json").write_text(config_json + "\n")
    if special:
        (out / "generation_config.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")
    return {"format": fmt, "tensors": len(state), "tokenizer": tokenizer and tokenizer.tokenizer.tokenizer_type}


def read_hf_directory(path) -> tuple[dict, dict]:
    """config.json and every tensor of a local Hugging Face model directory (safetensors only)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UsageError(
            f"--input {path}: no config.json; give a local directory written by "
            f"save_pretrained (import-hf does not download)"
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"{path / 'config.json'}: not valid JSON ({err})") from None
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif index.is_file():
        files = [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        raise UsageError(
            f"--input {path}: no model.safetensors (nor its index); import-hf reads "
            f"safetensors only: re-save the model with save_pretrained(safe_serialization=True)"
        )
    state = {}
    for file in files:
        if not file.is_file():
            raise UsageError(f"{index}: names {file.name}, which is missing; the download is incomplete")
        try:
            with safe_open(str(file), framework="pt") as f:
                state.update({key: f.get_tensor(key) for key in f.keys()})
        except (SafetensorError, OSError) as err:  # a cut download, another format renamed, a bad disk
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise UsageError(
                f"{file}: not a readable safetensors file ({reason}); it is damaged or incomplete: "
                f"download it again, or re-save the model with save_pretrained"
            ) from None
    return config, state


def folder_tokenizer(folder: Path):
    """The tokenizer a Hugging Face model folder holds (None when it holds none): tokenizer.json, else
    a sentencepiece tokenizer.model, else GPT-2's vocab.json + merges.txt."""
    if (folder / "tokenizer.json").is_file():
        return HuggingFaceTokenizer(folder)
    if (folder / "tokenizer.model").is_file():
        return load_tokenizer(folder / "tokenizer.model")
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return GPT2BPETokenizer(folder / "vocab.json", folder / "merges.txt")
    return None


def import_hf(input_dir, save, run_id: str | None = None) -> tuple[Path, str | None]:
    """Writes the Hugging Face model at `input_dir` as a megazero checkpoint in `save`, with the folder's
    tokenizer; returns its iteration directory and the tokenizer's type (None when there was none)."""
    save = Path(save)
    check_writable_dir(save, f"--save {save}", "choose a writable directory")
    if (save / LATEST).exists():
        raise UsageError(f"--save {save} already holds a checkpoint ({LATEST}); import into a new directory")
    hf_config, state = read_hf_directory(input_dir)
    try:
        config = hf_adapter.gpt_config(hf_config)
        params = hf_adapter.from_hf(config, hf_adapter.hf_format(hf_config), state)
    except ValueError as err:  # ConversionError, or GPTConfig refusing the shape
        raise UsageError(f"import-hf {input_dir}: {err}") from None
    tokenizer = folder_tokenizer(Path(input_dir))
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise UsageError(
            f"import-hf {input_dir}: its tokenizer has {tokenizer.vocab_size} tokens, more than the "
            f"model's vocab_size {config.vocab_size}; the files do not belong together"
        )
    record = saved_form(tokenizer) if tokenizer is not None else None
    directory = write_full_checkpoint(
        save, config, params, run_id or f"import-hf-{uuid.uuid4().hex[:12]}", tokenizer=record
    )
    return directory, tokenizer and tokenizer.tokenizer_type


def import_megatron(input_dir, save, run_id: str | None = None, weights_only: bool = False) -> tuple[Path, int, bool]:
    """Writes the Megatron-LM checkpoint at `input_dir` (either format) as a megazero checkpoint in `save`;
    returns its iteration directory, the Megatron iteration it held, and whether the run goes on from
    there (the distributed optimizer's Adam states, Adam's step, the lr schedule and the consumed
    samples carried over; else, or with `weights_only`, the weights alone at iteration 0)."""
    save = Path(save)
    check_writable_dir(save, f"--save {save}", "choose a writable directory")
    if (save / LATEST).exists():
        raise UsageError(f"--save {save} already holds a checkpoint ({LATEST}); import into a new directory")
    try:
        record, state, states = megatron_files.read_checkpoint(input_dir, optimizer=not weights_only)
        args, progress = record["args"], record["progress"]
        config = megatron_adapter.gpt_config(args)
        interleaved = bool(args.get("rotary_interleaved"))
        params = megatron_adapter.from_megatron(config, state, interleaved)
        resume = None
        if states and progress["adam_step"] is not None:
            states = megatron_adapter.optimizer_from_megatron(config, states, interleaved)
            params = states.pop("fp32")  # Adam's fp32 master weights are the run's weights
            resume = {
                "step_count": progress["adam_step"],
                "consumed_samples": progress["consumed_samples"],
                "optimizer": megatron_adapter.schedule(args, progress),
                "train_iters": args.get("train_iters"),
                "global_batch_size": args.get("global_batch_size"),
            }
    except ValueError as err:  # unreadable files, a model megazero cannot match, GPTConfig refusing
        raise UsageError(f"import-megatron {input_dir}: {err}") from None
    run_id = run_id or f"import-megatron-{uuid.uuid4().hex[:12]}"
    iteration = record["iteration"] if resume else 0
    directory = write_full_checkpoint(
        save, config, params, run_id, iteration, states=states if resume else None, resume=resume
    )
    return directory, record["iteration"], resume is not None


def export_megatron(load, output, weights_only: bool = False) -> tuple[Path, bool]:
    """Writes the checkpoint at `load` as a Megatron-LM torch_dist checkpoint under `output`; returns its
    directory and whether the run goes on from there in Megatron-LM (a checkpoint with Adam states:
    the fp32 masters, exp_avg and exp_avg_sq as the distributed optimizer's fully_reshardable state,
    Adam's step, the lr schedule and the consumed samples; else, or with `weights_only`, the weights
    alone at the checkpoint's iteration)."""
    reader = CheckpointReader(load)
    meta = reader.metadata
    config = GPTConfig(**meta["model"])
    out = Path(output)
    check_writable_dir(out, f"--output {out}", "choose a writable directory")
    if (out / megatron_files.TRACKER).exists():
        raise UsageError(f"--output {out} already holds a Megatron-LM checkpoint; export into a new directory")
    optimizer = meta.get("optimizer")
    with_states = (
        not weights_only and meta["engine"]["step_count"] > 0 and optimizer is not None and not optimizer.get("muon")
    )

    def read(kind):
        def one(name):
            tensor = reader.full_tensor(name, kind)
            reader.close()
            return tensor

        return one

    try:
        record = {"args": megatron_adapter.megatron_args(config)}
        state = megatron_adapter.to_megatron(config, read("fp32"))
        states = None
        if with_states:
            progress = {
                "step_count": meta["engine"]["step_count"],
                "consumed_samples": meta["consumed_samples"],
                "train_iters": meta["train_iters"],
                "global_batch_size": meta["global_batch_size"],
            }
            extra = megatron_adapter.megatron_progress(optimizer, progress)
            record = {**extra, "args": {**record["args"], **extra["args"]}}
            states = {
                theirs: megatron_adapter.to_megatron(config, read(ours))
                for theirs, ours in megatron_adapter.MEGATRON_STATES.items()
            }
    except megatron_adapter.ConversionError as err:
        raise UsageError(f"export-megatron {reader.path}: {err}") from None
    return megatron_files.write_torch_dist(out, record, state, meta["iteration"], states), with_states


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="one full fp32 state dict from a sharded checkpoint")
    c.add_argument("--load", required=True, help="a --save directory (its `latest`) or an iter_* directory")
    c.add_argument("--output", required=True, help="directory for model.safetensors and config.json")
    c.add_argument("--with-optimizer", action="store_true", help="also write the full Adam states")
    e = sub.add_parser(
        "export-hf", help="a checkpoint as a Hugging Face GPT-2, Llama, Mixtral or Qwen2-MoE model directory"
    )
    e.add_argument("--load", required=True, help="a --save directory (its `latest`) or an iter_* directory")
    e.add_argument("--output", required=True, help="directory for config.json and model.safetensors")
    e.add_argument(
        "--format",
        default="auto",
        choices=["auto", *hf_adapter.FORMATS],
        help="target format; auto: gpt2 for learned positions, qwen2_moe for rope with experts and a shared expert, mixtral for rope with experts, llama for rope",
    )
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --output folder, replacing the files of the same names",
    )
    e.add_argument(
        "--without-tokenizer", action="store_true", help="export the weights alone, without the checkpoint's tokenizer"
    )
    i = sub.add_parser(
        "import-hf", help="a local Hugging Face GPT-2, Llama, Mixtral or Qwen2-MoE model as a megazero checkpoint"
    )
    i.add_argument("--input", required=True, help="directory with config.json and model.safetensors")
    i.add_argument("--save", required=True, help="new directory for the checkpoint (for --load/--finetune)")
    m = sub.add_parser(
        "import-megatron", help="a Megatron-LM checkpoint (torch_dist or legacy) as a megazero checkpoint"
    )
    m.add_argument("--input", required=True, help="a Megatron-LM --save directory or one of its iter_* directories")
    m.add_argument("--save", required=True, help="new directory for the checkpoint (for --load/--finetune)")
    m.add_argument(
        "--weights-only",
        action="store_true",
        help="import the weights alone at iteration 0 (no Adam states, schedule or progress)",
    )
    x = sub.add_parser("export-megatron", help="a checkpoint as a Megatron-LM --ckpt-format torch_dist checkpoint")
    x.add_argument("--load", required=True, help="a --save directory (its `latest`) or an iter_* directory")
    x.add_argument("--output", required=True, help="new directory: Megatron-LM's --load for it")
    x.add_argument(
        "--weights-only", action="store_true", help="export the weights alone (no Adam states, schedule or progress)"
    )
    return parser.parse_args(argv)


def run(args) -> str:
    """Runs one subcommand; returns what it wrote, in words."""
    if args.command == "export-hf":
        written = export_hf(args.load, args.output, args.format, args.without_tokenizer, args.overwrite)
        tokenizer = f" and its {written['tokenizer']}" if written["tokenizer"] else " (no tokenizer)"
        return (
            f"wrote {written['format']} config.json and model.safetensors "
            f"({written['tensors']} tensors){tokenizer} to {args.output}"
        )
    if args.command == "import-hf":
        directory, tokenizer = import_hf(args.input, args.save)
        if tokenizer is None:
            return f"wrote checkpoint {directory} (the folder has no tokenizer)"
        flag = "--tokenizer-model" if tokenizer != "GPT2BPETokenizer" else "--vocab-file/--merge-file"
        return (
            f"wrote checkpoint {directory} with its {tokenizer} in {directory / TOKENIZER_DIR} (for "
            f"preprocess_data.py and pretrain_gpt.py: --tokenizer-type {tokenizer} {flag} from there)"
        )
    if args.command == "import-megatron":
        directory, iteration, resumable = import_megatron(args.input, args.save, weights_only=args.weights_only)
        what = (
            f"Megatron-LM iteration {iteration} with its Adam states, step, lr schedule and consumed samples: "
            f"--load resumes it"
            if resumable
            else f"the weights of Megatron-LM iteration {iteration}, at iteration 0"
        )
        return f"wrote checkpoint {directory} ({what}; pickles read weights-only, no code from them ran)"
    if args.command == "export-megatron":
        directory, resumable = export_megatron(args.load, args.output, args.weights_only)
        what = (
            "with the distributed optimizer's Adam states (fully_reshardable), step, lr schedule and consumed samples"
            if resumable
            else "the weights alone"
        )
        return f"wrote Megatron-LM torch_dist checkpoint {directory} ({what})"
    written = consolidate(args.load, args.output, args.with_optimizer)
    files = ", ".join(f"{name} ({count} tensors)" for name, count in written.items())
    return f"wrote {files} to {args.output}"


def main(argv=None) -> int:
    args = parse_args(argv)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    try:
        done = run(args)
    except (UsageError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"{done} in {time.perf_counter() - started:.1f}s; "
        f"peak RSS {peak / 1024:.0f} MiB ({(peak - before) / 1024:.0f} MiB above start-up)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
