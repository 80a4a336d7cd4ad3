"""Fine-tune a Hugging Face causal language model on SFT records with megazero's ZeRO.

    python tools/finetune.py --hf-model DIR --data sft.jsonl --deepspeed_config ds.json --save ck
    torchrun --nproc-per-node 8 tools/finetune.py --hf-model DIR --data sft.jsonl \\
        --deepspeed_config ds.json --seq-length 2048 --pack --save ck --export-hf out/hf
    python tools/finetune.py --hf-model DIR --load ck --export-hf out/hf     # a checkpoint, exported

DIR is a transformers model folder (save_pretrained's: config.json, the safetensors, the tokenizer);
nothing is downloaded. The records are {"prompt", "response"} or {"messages": [...]} (rendered by
the tokenizer's chat template), one a line; the loss is on the response tokens only
(megazero/data/sft.py). --pack lays several records into one row, kept apart by position ids that
restart at each record (transformers' masking reads them; a model whose masks are built otherwise
is refused). The DeepSpeed config says the batch (micro batch, accumulation, train_batch_size),
the optimizer, scheduler, precision and ZeRO stage, as for megazero.initialize, which trains the
model on the same engine pretrain_gpt.py uses (docs/own_model.md).

Logs as pretrain_gpt.py: a line per --log-interval iterations and metrics.jsonl in --run-dir
(megazero.training.metrics). --save writes megazero's sharded checkpoints (engine.save_checkpoint:
iter_<N>/, `latest`) every --save-interval iterations and at the end, --ckpt-keep-last K keeps the
newest K; --export-hf OUT writes the fine-tuned model as a transformers folder (model + tokenizer)
that AutoModelForCausalLM.from_pretrained loads; --load CK --export-hf OUT (no --data) exports a
checkpoint of the job afterwards, in one process, one parameter at a time. Bad input (the folder, the records with their line
numbers, --seq-length against the model's positions, the config) is one line, before any process
group.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch

from megazero.api.arguments import add_config_arguments
from megazero.core.errors import UsageError


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-model", required=True, help="a transformers causal-LM folder (config, weights, tokenizer)")
    p.add_argument("--data", help="JSON-lines SFT records: {prompt, response} or {messages}")
    p.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="tokens a row holds at most; records are truncated to it (default: the model's positions)",
    )
    p.add_argument("--pack", action="store_true", help="several records a row, each attending to itself only")
    p.add_argument("--epochs", type=int, default=1, help="passes over the records (default: 1)")
    p.add_argument("--train-iters", type=int, default=None, help="optimizer steps (default: --epochs' worth)")
    p.add_argument("--seed", type=int, default=1234, help="the record order's and the model's seed (default: 1234)")
    p.add_argument("--log-interval", type=int, default=1, help="iterations a log line averages (default: 1)")
    p.add_argument("--run-dir", default=None, help="where metrics.jsonl goes (default: runs/finetune-<time>)")
    p.add_argument("--save", default=None, help="megazero checkpoints (iter_<N>/ and latest) go here")
    p.add_argument("--save-interval", type=int, default=0, help="save every N iterations too (default: at the end)")
    p.add_argument("--ckpt-keep-last", type=int, default=0, help="keep only the newest K checkpoints (default: all)")
    p.add_argument("--export-hf", default=None, help="at the end, the model as a transformers folder here")
    p.add_argument(
        "--load",
        default=None,
        help="with --export-hf and no --data: export this checkpoint "
        "(a --save folder or its iter_<N>) of --hf-model's architecture, and train nothing",
    )
    add_config_arguments(p)
    args = p.parse_args(argv)
    for name in ("epochs", "log_interval"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    for name in ("save_interval", "ckpt_keep_last"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: give 0 or more")
    for name in ("train_iters", "seq_length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if args.load is not None:
        if args.export_hf is None or args.data is not None:
            raise UsageError(
                "--load exports a checkpoint: give --hf-model, --load and --export-hf, without --data "
                "(this tool resumes no training)"
            )
        return args
    if args.data is None:
        raise UsageError("--data sft.jsonl is needed: the records to fine-tune on")
    if args.deepspeed_config is None:
        raise UsageError(
            "--deepspeed_config ds.json is needed: it says the batch, optimizer and ZeRO stage "
            "(examples/ds_config.json is one)"
        )
    return args


@dataclasses.dataclass
class Plan:
    """What the checks before any process group found: the model's config and class, the tokenizer,
    the rows to train on and the run's length."""

    config: object
    model_class: type
    tokenizer: object
    rows: list
    records: int
    seq_length: int
    settings: object
    iters: int
    run_dir: Path


def model_class(folder: Path):
    """The folder's transformers config and causal-LM class; a UsageError for anything else."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not (folder / "config.json").is_file():
        raise UsageError(
            f"--hf-model {folder}: no config.json there; give a transformers model folder (what save_pretrained writes)"
        )
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    names = list(config.architectures or [])
    if (names and not set(names) <= causal) or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(
            f"--hf-model {folder}: a {names[0] if names else config.model_type} model, not a causal "
            f"language model (AutoModelForCausalLM has no class for it); give a *ForCausalLM folder"
        )
    return config, AutoModelForCausalLM._model_mapping[type(config)]


def max_positions(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_packing(cls) -> None:
    """Packing keeps records apart only in a model whose masks come from transformers' masking_utils:
    it reads position ids that restart as separate documents (attention_mask None, no cache)."""
    from transformers import masking_utils

    module = importlib.import_module(cls.__module__)
    if getattr(module, "create_causal_mask", None) is not masking_utils.create_causal_mask:
        raise UsageError(
            f"--pack: {cls.__name__} does not build its masks with transformers' masking_utils "
            f"(which reads position ids restarting at each record as separate records), so packed "
            f"records would see each other; run without --pack (one record a row)"
        )


def prepare(args, dp: int) -> Plan:
    """Every check and the tokenized data, before any process group (one line for each mistake)."""
    from transformers import AutoTokenizer
    from megazero.api.settings import api_settings
    from megazero.data.sft import load_samples, make_rows

    folder = Path(args.hf_model)
    if not folder.is_dir():
        raise UsageError(f"--hf-model {folder}: no such folder; give a transformers model folder (save_pretrained's)")
    config, cls = model_class(folder)
    positions = max_positions(config)
    seq_length = args.seq_length or positions
    if seq_length is None:
        raise UsageError(f"--hf-model {folder}: the config names no maximum position; give --seq-length")
    if positions is not None and seq_length > positions:
        raise UsageError(
            f"--seq-length {seq_length} is above the model's {positions} positions "
            f"({type(config).__name__}); give --seq-length {positions} or less"
        )
    if args.pack:
        check_packing(cls)
    settings = api_settings(args.deepspeed_config, dp)
    if args.save is not None and (Path(args.save) / "latest").exists():
        # this job resumes nothing, so what is there is another run's (--ckpt-keep-last would delete it)
        raise UsageError(f"--save {args.save} holds checkpoints of another run; save into an empty folder")
    check_export_folder(args.export_hf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UsageError(
            f"--hf-model {folder}: no tokenizer could be loaded there ({err}); save the model's "
            f"tokenizer into it (tokenizer.save_pretrained)"
        ) from None
    samples = load_samples(args.data, tokenizer, seq_length)
    rows = make_rows(samples, seq_length, args.pack)
    if len(rows) < settings.global_batch:
        raise UsageError(
            f"--data {args.data}: {len(rows)} rows, fewer than one global batch of "
            f"{settings.global_batch} ({settings.where}); give more records or a smaller batch"
        )
    iters = args.train_iters or args.epochs * (len(rows) // settings.global_batch)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or f"runs/finetune-{stamp}")
    return Plan(config, cls, tokenizer, rows, len(samples), seq_length, settings, iters, run_dir)


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


@dataclasses.dataclass
class Finetuned:
    engine: object
    history: list[dict]


def run(args, process_groups=None) -> Finetuned:
    """The whole job on this rank; `process_groups`: groups built already (a test's pool)."""
    import megazero
    from megazero.data.sft import SFTBatches
    from megazero.training.metrics import MetricsLogger

    plan = prepare(args, process_groups.dp.size if process_groups is not None else world_size())
    torch.manual_seed(args.seed)
    model = plan.model_class.from_pretrained(args.hf_model, dtype=torch.float32, local_files_only=True)
    n_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = megazero.initialize(model=model, config=args.deepspeed_config, process_groups=process_groups)
    engine.train()  # from_pretrained leaves the model in eval mode
    groups = engine.groups
    tokenizer = plan.tokenizer
    pad = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
    batches = SFTBatches(
        plan.rows,
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
        groups.dp.size,
        args.seed,
        pad,
        args.pack,
    )
    # only rank 0 writes metrics.jsonl, so its own id is the run's: records of several runs stay apart
    metrics = MetricsLogger(
        str(plan.run_dir / "metrics.jsonl"), enabled=groups.rank == 0, total_iters=plan.iters, run_id=uuid.uuid4().hex
    )
    metrics.say(
        f" megazero finetune: {plan.model_class.__name__} ({n_params:,} parameters) from {args.hf_model}; "
        f"{groups.dp.size} data-parallel ranks, zero_stage={engine.zero_optimization_stage()}"
    )
    metrics.say(
        f" data: {plan.records} records of {args.data} -> {len(plan.rows)} rows of at most "
        f"{plan.seq_length} tokens ({'packed' if args.pack else 'one record a row'}); global batch "
        f"{batches.global_batch} rows = micro {batches.micro} x {groups.dp.size} ranks x "
        f"{batches.accumulation} accumulation; {batches.steps_per_epoch} iterations an epoch, {plan.iters} in all"
    )
    saves = f"into {args.save}" if args.save else "none (no --save)"
    metrics.say(f" run folder: {plan.run_dir} (metrics.jsonl); checkpoints: {saves}")
    history = train(engine, batches, plan.iters, metrics, args, n_params)
    if args.export_hf is not None:
        export_hf(engine, plan, args.export_hf)
        metrics.say(f" exported the model as a transformers folder: {args.export_hf}")
    metrics.close()
    return Finetuned(engine, history)


def train(engine, batches, iters: int, metrics, args, n_params: int) -> list[dict]:
    from megazero.checkpoint.files import iteration_dir_name
    from megazero.core import comm, host_read
    from megazero.training.loop import peak_memory_mib

    dp = engine.groups.dp
    history, window = [], []
    for it in range(iters):
        started = time.perf_counter()
        lr, skipped_before = engine.get_lr()[0], engine.skipped_steps
        losses, tokens = [], 0  # this rank's micro-batch losses, and the tokens it computed
        for micro in range(batches.accumulation):
            batch = {k: v.to(engine.device) for k, v in batches.micro_batch(it, micro, dp.rank).items()}
            # use_cache=False: with a cache, transformers' masking would not read packed records
            loss = engine(**batch, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().double())
            tokens += batch["input_ids"].numel()
        sums = torch.stack([torch.stack(losses).sum(), torch.tensor(tokens, dtype=torch.float64, device=engine.device)])
        comm.all_reduce(sums, dp)
        loss_sum, tokens = host_read.read(sums, "the step's loss")
        elapsed = time.perf_counter() - started
        record = {
            "iteration": it + 1,
            "loss": loss_sum / (batches.accumulation * dp.size),
            "lr": lr,
            "grad_norm": float(engine.get_global_grad_norm()),
            "skipped": engine.skipped_steps > skipped_before,
            "loss_scale": engine.get_loss_scale(),
            "skipped_total": engine.skipped_steps,
            "tokens_per_s": tokens / elapsed,
            "ms_per_iter": 1000 * elapsed,
            # model FLOPs: 6 per parameter per token (attention's own not counted)
            "tflops_per_device": 6 * n_params * tokens / elapsed / dp.size / 1e12,
            "memory_mib": peak_memory_mib(engine.device),
        }
        history.append(record)
        window.append(record)
        if (it + 1) % args.log_interval == 0 or it == 0 or it + 1 == iters:
            metrics.log_train(window)
            window = []
        if args.save and ((args.save_interval and (it + 1) % args.save_interval == 0) or it + 1 == iters):
            engine.save_checkpoint(args.save, tag=iteration_dir_name(it + 1))
            metrics.say(f" saved checkpoint of iteration {it + 1}: {Path(args.save) / iteration_dir_name(it + 1)}")
            if engine.global_rank == 0 and args.ckpt_keep_last:
                keep_last(args.save, args.ckpt_keep_last)
    return history


def keep_last(save: str, k: int) -> None:
    """--ckpt-keep-last as pretrain_gpt.py's (megazero.checkpoint.retention), on rank 0."""
    from megazero.checkpoint.files import METADATA, latest_iteration_dir
    from megazero.checkpoint.retention import apply_keep_last

    run_id = json.loads((latest_iteration_dir(Path(save)) / METADATA).read_text())["run_id"]
    problem = apply_keep_last(Path(save), k, run_id, f"--ckpt-keep-last {k}")
    if problem:
        print(f" warning: {problem}", flush=True)


def check_export_folder(out) -> None:
    if out is not None and Path(out).is_dir() and any(Path(out).iterdir()):
        raise UsageError(f"--export-hf {out}: the folder is not empty; choose a new one")


def export_hf(engine, plan: Plan, out) -> None:
    """The trained weights into a transformers folder, on rank 0. Gathered one parameter at a time
    (collective: every rank takes part); rank 0 keeps each in host memory, the others drop it, so no
    device ever holds the whole model."""
    from megazero.utils import safe_get_full_fp32_param

    rank0 = engine.global_rank == 0
    state = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)
        if rank0:
            state[name] = full.cpu()
        del full
    if rank0:
        state.update({name: b.detach().cpu() for name, b in engine.module.named_buffers()})
        write_hf(plan.model_class, plan.config, plan.tokenizer, state, out)


def export_checkpoint(args) -> None:
    """--load CK --export-hf OUT: a checkpoint of --hf-model's architecture (any world size and
    stage) read one whole parameter at a time into a transformers folder."""
    from transformers import AutoTokenizer
    from megazero.checkpoint.reader import CheckpointReader, resolve

    folder = Path(args.hf_model)
    config, cls = model_class(folder)
    check_export_folder(args.export_hf)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if not (Path(args.load) / "latest").is_file() and not (Path(args.load) / "metadata.json").is_file():
        raise UsageError(f"--load {args.load}: no checkpoint there (no latest, no metadata.json)")
    reader = CheckpointReader(resolve(Path(args.load)))
    with torch.device("meta"):
        names = [name for name, _ in cls(config).named_parameters()]
    missing = [name for name in names if name not in reader.where]
    if missing:
        raise UsageError(
            f"--load {reader.path}: no parameter {missing[0]!r} ({len(missing)} of {cls.__name__}'s "
            f"are missing): export a checkpoint of the --hf-model's architecture"
        )
    state = {}
    for name in names:
        state[name] = reader.full_tensor(name, "fp32")
        reader.close()  # files are memory-mapped: keep only what was read
    write_hf(cls, config, tokenizer, state, args.export_hf)


def write_hf(cls, config, tokenizer, state: dict, out) -> None:
    """save_pretrained of `cls` holding `state`'s tensors, with the tokenizer beside. The model is
    made on meta and takes the tensors, so the weights are in memory once, not twice."""
    with torch.device("meta"):
        model = cls(config)
    buffers = {name for name, _ in model.named_buffers()}
    model.load_state_dict({k: v for k, v in state.items() if k not in buffers}, strict=False, assign=True)
    model.tie_weights()
    for name in buffers & set(state):  # rotary inv_freq & co. (non-persistent: not in a state dict)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = state[name]
    saved = model.state_dict()
    left = [name for name, tensor in saved.items() if tensor.is_meta]
    if left:
        raise RuntimeError(f"export-hf: {left[0]} was not among the trained tensors ({len(left)} missing)")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        if args.load is not None:
            export_checkpoint(args)
        else:
            run(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
