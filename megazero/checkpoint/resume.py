"""Checkpointing of one `pretrain_gpt.py` run: the checks on --save/--load before any process group
exists, then loading and the save policy once the model is set up.

    --save D --load D     the resume idiom: with no checkpoint in D yet the run starts from scratch
                          (one line says so); a --load directory that does not exist otherwise fails
    --save D              refuses a D holding another run's checkpoints (never mixes runs)
    --finetune            weights only: iteration 0, fresh optimizer, a new run

The lr schedule on resume follows Megatron-LM: the checkpoint's schedule (peak and final lr, warmup,
decay iterations and style, weight decay) must equal the flags' unless --override-opt_param-scheduler
(the flags win) or --use-checkpoint-opt_param-scheduler (the checkpoint wins) says which to keep; a
changed --train-iters changes the decay (and the default warmup), so it is caught too. --finetune and
--no-load-optim start a fresh schedule, as in Megatron.
"""
from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import torch

from megazero.core import comm, host_read
from megazero.config.train_config import CheckpointConfig, OptimizerConfig
from megazero.core.errors import UsageError, check_writable_dir
from .files import METADATA, latest_iteration_dir, read_json
from .loader import load_checkpoint
from .policy import SavePolicy
from .reader import CheckpointReader
from .saver import CheckpointSaver


def _has_checkpoint(path: Path) -> bool:
    return (path / METADATA).is_file() or (path / "latest").is_file()


@dataclasses.dataclass
class Resume:
    """What --load and --save found before any process group: the checkpoint to load (or None), lines
    to print once the run logs, and the optimizer settings (the lr schedule may be the checkpoint's)."""
    reader: CheckpointReader | None
    notices: list[str]
    optimizer: OptimizerConfig


# The lr schedule's settings: OptimizerConfig field -> the flag that sets it.
SCHEDULE = {"lr": "--lr", "min_lr": "--min-lr", "warmup_iters": "--lr-warmup-iters",
            "decay_iters": "--lr-decay-iters", "decay_style": "--lr-decay-style"}


def _schedule_differences(saved: dict, optimizer: OptimizerConfig) -> list[str]:
    diffs = [f"{flag} {getattr(optimizer, field)} (checkpoint: {saved[field]})"
             for field, flag in SCHEDULE.items() if field in saved and saved[field] != getattr(optimizer, field)]
    saved_decay = saved.get("adam", {}).get("weight_decay")
    if saved_decay is not None and saved_decay != optimizer.adam.weight_decay:
        diffs.append(f"--weight-decay {optimizer.adam.weight_decay} (checkpoint: {saved_decay})")
    return diffs


def schedule_on_resume(ck: CheckpointConfig, optimizer: OptimizerConfig, reader: CheckpointReader,
                       train_iters: int | None = None) -> tuple[OptimizerConfig, str | None]:
    """The optimizer settings a resume runs with, and a notice when the flags and checkpoint differed
    (`train_iters`: this run's, named when the difference is the schedule it derives)."""
    saved = reader.metadata.get("optimizer")
    if saved is None or ck.finetune or not ck.load_optim:
        return optimizer, None
    diffs = _schedule_differences(saved, optimizer)
    if not diffs:
        return optimizer, None
    described = ", ".join(diffs)
    if ck.scheduler_on_load == "check":
        changed = [field for field in SCHEDULE if field in saved and saved[field] != getattr(optimizer, field)]
        if changed and set(changed) <= set(optimizer.from_train_iters) and train_iters is not None:
            saved_iters = reader.metadata.get("train_iters")
            was = f" ({saved_iters})" if saved_iters is not None else ""
            derived = ", ".join(f"{field.replace('_iters', '')} over {getattr(optimizer, field)} iteration"
                                f"{'s' if getattr(optimizer, field) != 1 else ''} (checkpoint: {saved[field]})"
                                for field in changed)
            raise UsageError(f"--load {ck.load}: --train-iters {train_iters} differs from the checkpoint's "
                             f"run{was}, and the lr schedule follows it ({derived}); train with the "
                             f"checkpoint's --train-iters, or pass --override-opt_param-scheduler for the new "
                             f"schedule or --use-checkpoint-opt_param-scheduler to keep the old one")
        raise UsageError(f"--load {ck.load}: the lr schedule differs from the checkpoint's: {described} (a "
                         f"changed --train-iters moves the decay); pass --override-opt_param-scheduler to "
                         f"use the flags' or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    if ck.scheduler_on_load == "flags":
        return optimizer, f"lr schedule of the flags (--override-opt_param-scheduler): {described}"
    adam = dataclasses.replace(optimizer.adam, weight_decay=saved.get("adam", {}).get(
        "weight_decay", optimizer.adam.weight_decay))
    kept = optimizer.replace(adam=adam, **{f: saved[f] for f in SCHEDULE if f in saved})
    return kept, f"lr schedule of the checkpoint (--use-checkpoint-opt_param-scheduler); the flags gave {described}"


def _check_same_optimizer(ck: CheckpointConfig, optimizer: OptimizerConfig, reader: CheckpointReader) -> None:
    """An Adam checkpoint's first moments are no Muon momentum (nor the reverse): refused."""
    saved = reader.metadata.get("optimizer")
    if saved is None or ck.finetune or not ck.load_optim:
        return
    was, now = ("muon" if saved.get("muon") else "adam"), ("muon" if optimizer.muon else "adam")
    if was != now:
        raise UsageError(f"--load {ck.load}: the checkpoint's optimizer is {was}, this run's {now}, whose "
                         f"states differ; resume with --optimizer {was}, or pass --no-load-optim to start "
                         f"fresh optimizer states")


def check_resume(ck: CheckpointConfig, model_config, global_batch_size: int, optimizer: OptimizerConfig,
                 train_iters: int | None = None) -> Resume:
    """Validates --load and --save (no file is written): the checkpoint to load and the schedule to
    resume with."""
    reader, notice = None, None
    same = ck.save is not None and ck.load is not None and Path(ck.save).resolve() == Path(ck.load).resolve()
    if ck.load is not None:
        path = Path(ck.load)
        if not path.exists() or (path.is_dir() and not _has_checkpoint(path)):
            if not same:
                raise UsageError(f"--load {ck.load}: {'no such directory' if not path.exists() else 'holds no checkpoint'}"
                                 f"; give a --save directory of an earlier run (or drop --load)")
            notice = f"--load {ck.load}: no checkpoint there yet; training starts from scratch"
        else:
            reader = CheckpointReader(path)
            reader.check_model(model_config, f"--load {ck.load}:")
            saved_batch = reader.metadata.get("global_batch_size")
            if not ck.finetune and saved_batch not in (None, global_batch_size):
                raise UsageError(f"--global-batch-size {global_batch_size} differs from the checkpoint's "
                                 f"{saved_batch}; resuming reads samples where it stopped only with the "
                                 f"same global batch (or use --finetune)")
            _check_same_optimizer(ck, optimizer, reader)
            optimizer, notice = schedule_on_resume(ck, optimizer, reader, train_iters)
    if ck.save is not None:
        check_writable_dir(ck.save, f"--save {ck.save}", "choose a folder you can write to")
        save = Path(ck.save)
        mine = reader.run_id if reader is not None and not ck.finetune else None
        latest = latest_iteration_dir(save) if save.is_dir() else None
        if latest is not None:
            theirs = read_json(latest / METADATA)
            if theirs.get("run_id") != mine:
                raise UsageError(f"--save {ck.save} holds checkpoints of another run (iteration "
                                 f"{theirs.get('iteration')}); resume it with --load {ck.save}, or "
                                 f"save into an empty folder")
    return Resume(reader, [notice] if notice else [], optimizer)


def agreed_run_id(groups) -> str:
    """A new run id, the same on every rank: global rank 0's, broadcast over DP and then over
    TP x PP (together they reach the whole layout)."""
    value = torch.tensor(list(uuid.uuid4().bytes), dtype=torch.uint8, device=groups.dp.device)
    comm.broadcast(value, 0, groups.dp)
    comm.broadcast(value, 0, groups.mp)
    return bytes(host_read.read(value, "run id")).hex()


def start(state, ck: CheckpointConfig, reader: CheckpointReader | None, say,
          tokenizer: dict | None = None) -> tuple[int, SavePolicy]:
    """Loads the checkpoint (if any) into the set-up state; returns the iteration to start from and
    the save policy of the run (whose checkpoints keep `tokenizer`, see CheckpointSaver)."""
    run_id = agreed_run_id(state.groups)
    start_iteration = 0
    if reader is not None:
        result = load_checkpoint(state, reader, load_optim=ck.load_optim, load_rng=ck.load_rng,
                                 finetune=ck.finetune)
        start_iteration = result.iteration
        if not ck.finetune:
            run_id = result.run_id
        what = "weights (finetune)" if ck.finetune else "weights and optimizer" if ck.load_optim else "weights"
        rng = "" if ck.finetune else "; RNG states restored" if result.rng_restored else \
            "; RNG states not restored: another layout or device type, or --no-load-rng"
        say(f" loaded {what} from {reader.path} at iteration {reader.metadata['iteration']}{rng}")
    saver = (CheckpointSaver(ck.save, run_id, keep_last=ck.keep_last, async_save=ck.async_save,
                             tokenizer=tokenizer, say=say) if ck.save is not None else None)
    policy = SavePolicy(saver, ck.save_interval, ck.exit_interval, ck.exit_duration_mins,
                        ck.exit_signal_handler, ck.exit_signal, ck.exit_on_save_failure, say)
    if reader is not None and not ck.finetune and ck.save is not None and \
            Path(ck.save).resolve() == Path(reader.path).resolve().parent:
        policy.last_saved = start_iteration     # the checkpoint just loaded: not written again
    return start_iteration, policy
