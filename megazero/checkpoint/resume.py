"""Checkpointing of one `pretrain_gpt.py` run: the checks on --save/--load before any process group
exists, then loading and the save policy once the model is set up.

    --save D --load D     the resume idiom: with no checkpoint in D yet the run starts from scratch
                          (one line says so); a --load directory that does not exist otherwise fails
    --save D              refuses a D holding another run's checkpoints (never mixes runs), and a D
                          another job is writing (its lock, taken here by rank 0 for the whole job:
                          the refusal names that job; megazero.core.writer_lock); the lock's owner
                          then removes the `.tmp-*` leftovers of interrupted saves (retention.py)
    --finetune            weights only: iteration 0, fresh optimizer, a new run

A resume refuses another model (reader.check_model: every architecture field, and the learned
position table's rows unless --extend-position-embeddings grows it). A different --seed is accepted
with a line, as Megatron-LM accepts it (silently there): the RNG states still come from the
checkpoint where the layout allows, but the sample order from here on follows the new seed.

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

from megazero.config.train_config import CheckpointConfig, OptimizerConfig
from megazero.core.errors import UsageError, check_writable_dir
from megazero.core.writer_lock import FolderLock
from .files import LOCK, METADATA, latest_iteration_dir, read_json
from .loader import load_checkpoint
from .policy import SavePolicy
from .reader import CheckpointReader
from .retention import remove_leftovers
from .saver import CheckpointSaver


def _has_checkpoint(path: Path) -> bool:
    return (path / METADATA).is_file() or (path / "latest").is_file()


@dataclasses.dataclass
class Resume:
    """What --load and --save found before any process group: the checkpoint to load (or None), lines
    to print once the run logs, the optimizer settings (the lr schedule may be the checkpoint's), the
    run id this rank proposes (the checkpoint's on a resume, else a new one: rank 0's becomes the
    run's), and what only the writing rank holds and says: its folder locks, and what it removed."""

    reader: CheckpointReader | None
    notices: list[str]
    optimizer: OptimizerConfig
    run_id: str = ""
    locks: list[FolderLock] = dataclasses.field(default_factory=list)
    writer_lines: list[str] = dataclasses.field(default_factory=list)

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


# The lr schedule's settings: OptimizerConfig field -> the flag that sets it.
SCHEDULE = {
    "lr": "--lr",
    "min_lr": "--min-lr",
    "warmup_iters": "--lr-warmup-iters",
    "decay_iters": "--lr-decay-iters",
    "decay_style": "--lr-decay-style",
}


def _schedule_differences(saved: dict, optimizer: OptimizerConfig) -> list[str]:
    diffs = [
        f"{flag} {getattr(optimizer, field)} (checkpoint: {saved[field]})"
        for field, flag in SCHEDULE.items()
        if field in saved and saved[field] != getattr(optimizer, field)
    ]
    saved_decay = saved.get("adam", {}).get("weight_decay")
    if saved_decay is not None and saved_decay != optimizer.adam.weight_decay:
        diffs.append(f"--weight-decay {optimizer.adam.weight_decay} (checkpoint: {saved_decay})")
    return diffs


def schedule_on_resume(
    ck: CheckpointConfig, optimizer: OptimizerConfig, reader: CheckpointReader, train_iters: int | None = None
) -> tuple[OptimizerConfig, str | None]:
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
            derived = ", ".join(
                f"{field.replace('_iters', '')} over {getattr(optimizer, field)} iteration"
                f"{'s' if getattr(optimizer, field) != 1 else ''} (checkpoint: {saved[field]})"
                for field in changed
            )
            raise UsageError(
                f"--load {ck.load}: --train-iters {train_iters} differs from the checkpoint's "
                f"run{was}, and the lr schedule follows it ({derived}); train with the "
                f"checkpoint's --train-iters, or pass --override-opt_param-scheduler for the new "
                f"schedule or --use-checkpoint-opt_param-scheduler to keep the old one"
            )
        raise UsageError(
            f"--load {ck.load}: the lr schedule differs from the checkpoint's: {described} (a "
            f"changed --train-iters moves the decay); pass --override-opt_param-scheduler to "
            f"use the flags' or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )
    if ck.scheduler_on_load == "flags":
        return optimizer, f"lr schedule of the flags (--override-opt_param-scheduler): {described}"
    adam = dataclasses.replace(
        optimizer.adam, weight_decay=saved.get("adam", {}).get("weight_decay", optimizer.adam.weight_decay)
    )
    kept = optimizer.replace(adam=adam, **{f: saved[f] for f in SCHEDULE if f in saved})
    return kept, f"lr schedule of the checkpoint (--use-checkpoint-opt_param-scheduler); the flags gave {described}"


def _check_same_optimizer(ck: CheckpointConfig, optimizer: OptimizerConfig, reader: CheckpointReader) -> None:
    """An Adam checkpoint's first moments are no Muon momentum (nor the reverse): refused."""
    saved = reader.metadata.get("optimizer")
    if saved is None or ck.finetune or not ck.load_optim:
        return
    was, now = ("muon" if saved.get("muon") else "adam"), ("muon" if optimizer.muon else "adam")
    if was != now:
        raise UsageError(
            f"--load {ck.load}: the checkpoint's optimizer is {was}, this run's {now}, whose "
            f"states differ; resume with --optimizer {was}, or pass --no-load-optim to start "
            f"fresh optimizer states"
        )


def batch_mismatch(saved: int, glob: int, micro: int | None = None, dp: int | None = None) -> str:
    """The line refusing a resume at global batch `glob` (micro batch `micro` at data-parallel size
    `dp`) of a checkpoint saved at global batch `saved`, naming every flag the resume needs at once:
    the global batch, and the micro batch where `saved` does not split into this one x `dp`."""
    line = (
        f"--global-batch-size {glob} differs from the checkpoint's {saved}; resuming reads samples "
        f"where it stopped only with the same global batch: "
    )
    if micro is None or dp is None or saved % (micro * dp) == 0:
        return line + f"pass --global-batch-size {saved} (or use --finetune)"
    if saved % dp:
        return line + (
            f"no micro batch splits {saved} samples over data-parallel size {dp}: resume at a "
            f"data-parallel size dividing {saved} with --global-batch-size {saved} (or use --finetune)"
        )
    fits = [m for m in range(saved // dp, 0, -1) if (saved // dp) % m == 0][:3]
    return line + (
        f"pass --global-batch-size {saved} with --micro-batch-size {' or '.join(map(str, fits))} "
        f"(--micro-batch-size {micro} x data-parallel size {dp} = {micro * dp} does not divide "
        f"{saved}) (or use --finetune)"
    )


def check_resume(
    ck: CheckpointConfig,
    model_config,
    global_batch_size: int,
    optimizer: OptimizerConfig,
    train_iters: int | None = None,
    micro_and_dp: tuple[int, int] | None = None,
    seed: int | None = None,
    writer: bool = False,
) -> Resume:
    """Validates --load and --save: the checkpoint to load and the schedule to resume with.
    `micro_and_dp`: this run's micro batch and data-parallel size, for the line refusing another
    global batch. `writer` (rank 0): also takes the --save folder's lock for the job (a UsageError
    naming the job that holds it) and removes leftovers there; nothing else is written."""
    reader, notices = None, []
    same = ck.save is not None and ck.load is not None and Path(ck.save).resolve() == Path(ck.load).resolve()
    if ck.load is not None:
        path = Path(ck.load)
        if not path.exists() or (path.is_dir() and not _has_checkpoint(path)):
            if not same:
                raise UsageError(
                    f"--load {ck.load}: {'no such directory' if not path.exists() else 'holds no checkpoint'}"
                    f"; give a --save directory of an earlier run (or drop --load)"
                )
            notices.append(f"--load {ck.load}: no checkpoint there yet; training starts from scratch")
        else:
            reader = CheckpointReader(path)
            reader.check_model(model_config, f"--load {ck.load}:", ck.extend_positions)
            saved_batch = reader.metadata.get("global_batch_size")
            if not ck.finetune and saved_batch not in (None, global_batch_size):
                raise UsageError(batch_mismatch(saved_batch, global_batch_size, *(micro_and_dp or ())))
            _check_same_optimizer(ck, optimizer, reader)
            optimizer, notice = schedule_on_resume(ck, optimizer, reader, train_iters)
            notices += [notice] if notice else []
            notices += _seed_notice(reader, seed) if not ck.finetune else []
    run_id = reader.run_id if reader is not None and not ck.finetune else uuid.uuid4().hex
    resume = Resume(reader, notices, optimizer, run_id)
    if ck.save is not None:
        check_writable_dir(ck.save, f"--save {ck.save}", "choose a folder you can write to")
        try:
            _check_save_folder(ck, resume, writer)
        except BaseException:
            resume.release()
            raise
    return resume


def _seed_notice(reader: CheckpointReader, seed: int | None) -> list[str]:
    saved = reader.metadata.get("seed")
    if seed is None or saved is None or saved == seed:
        return []
    return [
        f"--seed {seed} differs from the checkpoint's {saved} (accepted, as Megatron-LM does): the "
        f"samples from here on come in the order --seed {seed} gives, the RNG states (dropout) come from "
        f"the checkpoint where the layout allows; pass --seed {saved} to keep its order"
    ]


def _check_save_folder(ck: CheckpointConfig, resume: Resume, writer: bool) -> None:
    """The --save folder holds no other run's checkpoints and no other job writes it (`writer`: the
    lock is taken, and held, first, so that the job writing there is named whatever it has written)."""
    save = Path(ck.save)
    flag = f"--save {ck.save}"
    if writer:
        lock = FolderLock.take(save / LOCK, resume.run_id, flag)
        resume.locks.append(lock)
    mine = resume.reader.run_id if resume.reader is not None and not ck.finetune else None
    latest = latest_iteration_dir(save) if save.is_dir() else None
    if latest is not None:
        theirs = read_json(latest / METADATA)
        if theirs.get("run_id") != mine:
            raise UsageError(
                f"--save {ck.save} holds checkpoints of another run (iteration "
                f"{theirs.get('iteration')}); resume it with --load {ck.save}, or "
                f"save into an empty folder"
            )
    if writer:
        line = remove_leftovers(save, flag)
        resume.writer_lines += [line] if line else []


def start(
    state, ck: CheckpointConfig, reader: CheckpointReader | None, say, run_id: str, tokenizer: dict | None = None
) -> tuple[int, SavePolicy]:
    """Loads the checkpoint (if any) into the set-up state; returns the iteration to start from and
    the save policy of the run `run_id` (the same on every rank: the checkpoint's on a resume), whose
    checkpoints keep `tokenizer` (see CheckpointSaver)."""
    start_iteration = 0
    if reader is not None:
        result = load_checkpoint(
            state,
            reader,
            load_optim=ck.load_optim,
            load_rng=ck.load_rng,
            finetune=ck.finetune,
            extend_positions=ck.extend_positions,
        )
        start_iteration = result.iteration
        what = "weights (finetune)" if ck.finetune else "weights and optimizer" if ck.load_optim else "weights"
        rng = (
            ""
            if ck.finetune
            else "; RNG states restored"
            if result.rng_restored
            else "; RNG states not restored: another layout or device type, or --no-load-rng"
        )
        say(f" loaded {what} from {reader.path} at iteration {reader.metadata['iteration']}{rng}")
    saver = (
        CheckpointSaver(ck.save, run_id, keep_last=ck.keep_last, async_save=ck.async_save, tokenizer=tokenizer, say=say)
        if ck.save is not None
        else None
    )
    policy = SavePolicy(
        saver,
        ck.save_interval,
        ck.exit_interval,
        ck.exit_duration_mins,
        ck.exit_signal_handler,
        ck.exit_signal,
        ck.exit_on_save_failure,
        say,
    )
    if (
        reader is not None
        and not ck.finetune
        and ck.save is not None
        and Path(ck.save).resolve() == Path(reader.path).resolve().parent
    ):
        policy.last_saved = start_iteration  # the checkpoint just loaded: not written again
    return start_iteration, policy
