"""engine.save_checkpoint / engine.load_checkpoint for megazero.initialize's engine, in megazero's
own checkpoint format (megazero.checkpoint: every rank writes its shard, rank 0 commits atomically,
any world size loads any other's, one parameter at a time).

    engine.save_checkpoint("ck", tag=None, client_state={"epoch": 3})   # ck/global_step<N>/, ck/latest
    path, client_state = engine.load_checkpoint("ck")                   # the directory `latest` names

A tag names the directory (DeepSpeed's default global_step<N>). Saved beside the ZeRO states: the
engine's counters (global steps, micro steps, samples, skipped steps), the loss scaler, the lr
scheduler's state_dict and `client_state`, which must be JSON (megazero's checkpoints hold no
pickle). Parameters are saved under the model's own names (`named_parameters()`), so a checkpoint
loads into the same model built anywhere, at another stage or world size.

One writer per folder, as pretrain_gpt.py's --save: rank 0 takes the folder's lock (`.lock`,
megazero.core.writer_lock) at the engine's first save into it and holds it while the engine lives;
a second job saving there is refused on every rank in one line naming the first. No keep-last:
DeepSpeed's engine has no such setting (its `checkpoint` block has none; the HF Trainer's
save_total_limit prunes outside the engine), so every tag saved stays.

Owns the engine's metadata and its locks; the files, the agreement between ranks and the reading
are megazero.checkpoint's.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import types
import uuid
import weakref
from pathlib import Path

import torch

from megazero.checkpoint.files import FORMAT_VERSION, LOCK, rank_file_names
from megazero.checkpoint.loader import load_engine_states
from megazero.checkpoint.reader import CheckpointReader, resolve
from megazero.checkpoint.retention import remove_leftovers
from megazero.checkpoint.saver import CheckpointSaver
from megazero.core.errors import UsageError
from megazero.core.writer_lock import FolderLock, describe_holder


class _NoTracker:
    """The user's model has no megazero RNG tracker: only torch's own generators are saved."""

    states: dict = {}

    def get_states(self) -> dict:
        return {}

    def set_states(self, states: dict) -> None:
        pass


@dataclasses.dataclass
class EngineState:
    """What megazero.checkpoint reads of a run, for megazero.initialize's engine."""

    engine: object  # the ZeroEngine
    groups: object  # ProcessGroups
    chunks: list
    device: torch.device
    iteration: int
    tracker: _NoTracker = dataclasses.field(default_factory=_NoTracker)
    cfg: object = dataclasses.field(
        default_factory=lambda: types.SimpleNamespace(parallel=types.SimpleNamespace(virtual_stages=1))
    )


def _state(engine) -> EngineState:
    return EngineState(engine.zero, engine.groups, [engine.module], engine.device, engine.global_steps)


def _metadata(engine, client_state: dict):
    def metadata(state, run_id: str, consumed_samples: int) -> dict:
        topo, zero = state.groups.topology, state.engine
        return {
            "format_version": FORMAT_VERSION,
            "megazero_version": importlib.metadata.version("megazero"),
            "run_id": run_id,
            "iteration": state.iteration,
            "consumed_samples": engine.global_samples,
            "model": {"class": type(engine.module).__name__},
            "layout": {
                "world_size": topo.world_size,
                "tp": 1,
                "pp": 1,
                "dp": topo.dp,
                "cp": 1,
                "zero_stage": zero.zero.stage,
                "mics_shard_size": zero.zero.mics_shard_size,
            },
            "precision": {"bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled()},
            "engine": {
                "step_count": zero.step_count,
                "skipped_steps": zero.skipped_steps,
                "global_steps": engine.global_steps,
                "micro_steps": engine.micro_steps,
                "global_samples": engine.global_samples,
                "api_skipped_steps": engine.skipped_steps,
            },
            "loss_scaler": zero.loss_scaler.state_dict(),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "param_group_lrs": engine.get_lr(),
            "client_state": client_state,
            "rank_files": [rank_file_names(r)[0] for r in range(topo.world_size)],
        }

    return metadata


def save_checkpoint(engine, save_dir, tag, client_state: dict, save_latest: bool = True) -> bool:
    """Collective: every rank calls it with the same arguments. DeepSpeed's return value (True)."""
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as err:
        raise UsageError(
            f"save_checkpoint: client_state must be JSON (numbers, strings, lists, dicts): {err}; "
            f"megazero's checkpoints hold no pickle"
        ) from None
    if engine._backwards:
        raise UsageError(
            "save_checkpoint in the middle of a gradient-accumulation window: save after "
            "engine.step() has applied the optimizer"
        )
    name = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if "/" in name or name.startswith("."):
        raise UsageError(f"save_checkpoint: tag {name!r} must be a plain directory name")
    run_id = engine._run_id = getattr(engine, "_run_id", None) or _agreed_run_id(engine)
    _lock_folder(engine, Path(save_dir), run_id)
    saver = CheckpointSaver(save_dir, run_id, metadata=_metadata(engine, client_state))
    saver.save(_state(engine), engine.global_samples, dir_name=name)
    return True


def _lock_folder(engine, save_dir: Path, run_id: str) -> None:
    """Rank 0 takes the folder's lock (megazero.core.writer_lock, as pretrain_gpt.py's --save) at the
    engine's first save into it and holds it while the engine lives; a folder another job holds
    is refused on every rank alike, before anything is written. The lock's first holder removes what
    interrupted saves left there (.tmp-* entries), with a line."""
    locks = engine.__dict__.setdefault("_folder_locks", {})
    key = str(save_dir.resolve())
    what = f"engine.save_checkpoint({str(save_dir)!r})"
    refused = None
    if engine.groups.rank == 0 and key not in locks:
        try:
            lock = FolderLock.take(save_dir / LOCK, run_id, what)
        except UsageError as err:
            refused = err
        else:
            locks[key] = lock
            weakref.finalize(engine, lock.release)
            for line in filter(None, [lock.note, remove_leftovers(save_dir, what)]):
                print(f"megazero: note: {line}", flush=True)
    if _any_rank(engine, refused is not None):
        raise refused or UsageError(
            f"{what}: another job writes there ({describe_holder(save_dir / LOCK)}); "
            f"let it finish, or choose another folder"
        )


def _any_rank(engine, flag: bool) -> bool:
    """Whether `flag` holds on some rank (collective over the data-parallel group)."""
    from megazero.core import comm

    if engine.groups.dp.size == 1:
        return flag
    value = torch.tensor([float(flag)], device=engine.groups.dp.device)
    comm.all_reduce(value, engine.groups.dp)
    return bool(value.item())


def _agreed_run_id(engine) -> str:
    """One id for the run, rank 0's, shared by broadcast (the saver checks files against it)."""
    from megazero.core import comm

    value = torch.tensor(list(uuid.uuid4().bytes), dtype=torch.uint8, device=engine.groups.dp.device)
    comm.broadcast(value, 0, engine.groups.dp)
    return bytes(value.tolist()).hex()[:16]


def load_checkpoint(engine, load_dir, tag, load_optimizer_states: bool, load_lr_scheduler_states: bool):
    """(the directory loaded, client_state), as DeepSpeed returns; (None, None) when there is no
    checkpoint in `load_dir`."""
    path = Path(load_dir) / str(tag) if tag is not None else Path(load_dir)
    if tag is None and not (path / "latest").is_file() and not (path / "metadata.json").is_file():
        return None, None
    reader = CheckpointReader(resolve(path))
    missing = [n for n, _ in engine.module.named_parameters() if n not in reader.where]
    if missing:
        raise UsageError(
            f"{reader.path}: no parameter {missing[0]!r} ({len(missing)} of the model's are "
            f"missing): load a checkpoint of the same model"
        )
    load_engine_states(engine.zero, reader, load_optimizer_states)
    meta = reader.metadata
    counters = meta["engine"]
    if load_optimizer_states:
        engine.zero.step_count, engine.zero.skipped_steps = counters["step_count"], counters["skipped_steps"]
        engine.zero.loss_scaler.load_state_dict(meta["loss_scaler"])
    engine.global_steps, engine.micro_steps = counters["global_steps"], counters["micro_steps"]
    engine.global_samples, engine.skipped_steps = counters["global_samples"], counters["api_skipped_steps"]
    for group, lr in zip(engine.optimizer.param_groups, meta["param_group_lrs"]):
        group["lr"] = lr
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    return str(reader.path), meta.get("client_state", {})
