"""Saving a training run: every rank writes its own shard, rank 0 commits the directory.

What a rank writes is its ZeRO storage's own state, read through the storage interface: for every
parameter piece it holds (`local_pieces`) the fp32 master, exp_avg and exp_avg_sq, under the
parameter's model name, with where the piece sits in the (TP-local) parameter and how that
parameter is split over TP. Copies held elsewhere too are written once: by the rank that counts the
parameter in the gradient norm (TP rank 0 for replicated ones, the first stage for a tied
embedding), and by the first MiCS replica (DP rank 0 at stage 0). Also per rank: its RNG states.
Rank 0 adds metadata.json: model, layout, iteration, consumed samples, loss scaler, Adam step.

With `async_save` the tensors are copied to host memory and written by a background thread while
training goes on; the commit (rename into place, `latest`) happens at the next save or at `finalize`.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import shutil
import threading
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from megazero.core import comm
from .files import (FORMAT_VERSION, METADATA, TMP_PREFIX, CheckpointError, commit_directory,
                    iteration_dir_name, rank_file_names, remove_old, write_json_atomic)

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def canonical_name(param, engine) -> str:
    """The model's name for a parameter (a tied head copy is saved under the embedding's)."""
    return getattr(param, "init_name", engine.names[id(param)])


def crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.contiguous().view(torch.uint8).numpy()) if tensor.numel() else 0


def collect_rank_state(state) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's tensors (host copies) and their index."""
    engine, groups = state.engine, state.groups
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict] = {}
    for storage in engine.storages():
        copy_index = groups.dp.rank if storage.shard is None else engine.groups.replica.rank
        if copy_index != 0:
            continue
        for param, offset, length in storage.local_pieces():
            if not engine.counts_in_norm(param):
                continue
            name = canonical_name(param, engine)
            shard = getattr(param, "tp_shard", None)
            entry = {"shape": list(getattr(param, "zero_full_shape", param.shape)), "offset": offset,
                     "length": length, "crc": {},
                     "tp": None if shard is None else [shard.dim, shard.rank, shard.size, shard.chunks]}
            for kind in KINDS:
                host = storage.local_view(param, kind).detach().to("cpu", torch.float32, copy=True)
                tensors[f"{name}/{kind}"] = host
                entry["crc"][kind] = crc32(host)
            pieces[name] = entry
    rng = {"cpu": torch.get_rng_state()}
    if state.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(state.device)
    rng.update({f"tracker/{k}": v.cpu() for k, v in state.tracker.get_states().items()})
    for key, value in rng.items():
        tensors[f"rng/{key}"] = value.clone()
    index = {"rank": groups.rank, "coords": list(groups.coords), "pieces": pieces,
             "rng": {key: crc32(value) for key, value in rng.items()}, "layout_key": layout_key(state)}
    return tensors, index


def layout_key(state) -> list:
    """What must match for RNG states to carry over: the same rank in the same layout, on the same
    device type (a CPU generator's state and a CUDA one's differ in size and meaning, and the
    tensor-parallel tracker holds the device's)."""
    cfg, topo = state.cfg, state.groups.topology
    return [topo.world_size, topo.tp, topo.pp, cfg.parallel.virtual_stages, state.groups.rank,
            state.device.type] + ([topo.cp] if topo.cp > 1 else [])


def run_metadata(state, run_id: str, consumed_samples: int) -> dict:
    cfg, topo, engine = state.cfg, state.groups.topology, state.engine
    return {
        "format_version": FORMAT_VERSION, "megazero_version": importlib.metadata.version("megazero"),
        "run_id": run_id, "iteration": state.iteration, "consumed_samples": consumed_samples,
        "model": dataclasses.asdict(cfg.model),
        "layout": {"world_size": topo.world_size, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "cp": topo.cp,
                   "virtual_stages": cfg.parallel.virtual_stages, "layer_split": cfg.parallel.layer_split,
                   "zero_stage": cfg.zero.stage, "mics_shard_size": cfg.zero.mics_shard_size},
        "precision": {"bf16": cfg.precision.bf16, "fp16": cfg.precision.fp16},
        "global_batch_size": cfg.global_batch_size,
        "engine": {"step_count": engine.step_count, "skipped_steps": engine.skipped_steps},
        "loss_scaler": engine.loss_scaler.state_dict(),
        "optimizer": dataclasses.asdict(cfg.optimizer),   # with the iteration: the lr schedule
        "rank_files": [rank_file_names(r)[0] for r in range(topo.world_size)],
    }


def merge_rank_indexes(tmp: Path, metadata: dict) -> dict:
    """metadata.json describes every tensor: each rank's index (written beside its shard, as ranks
    cannot share one file) moves into it under "ranks"."""
    ranks = []
    for r in range(len(metadata["rank_files"])):
        index_path = tmp / rank_file_names(r)[1]
        ranks.append(json.loads(index_path.read_text()))
        index_path.unlink()
    return {**metadata, "ranks": ranks}


def agree_on_failure(failed: bool, groups) -> bool:
    """True on every rank if any rank failed (max over DP, then over TP x PP: the whole layout).
    Doubles as the barrier between the phases of a save."""
    return agree_on_any((failed,), groups)[0]


def agree_on_any(flags: tuple[bool, ...], groups) -> tuple[bool, ...]:
    """Each flag true on every rank if it is true on any rank of the layout, all in one reduction."""
    values = torch.tensor([1.0 if f else 0.0 for f in flags], device=groups.dp.device)
    comm.all_reduce(values, groups.dp, op=comm.ReduceOp.MAX)
    comm.all_reduce(values, groups.mp, op=comm.ReduceOp.MAX)
    return tuple(v > 0 for v in values.tolist())


class CheckpointSaver:
    """Writes checkpoints of one run into `save_dir` (see the module docstring)."""

    def __init__(self, save_dir: str | Path, run_id: str, keep_last: int = 0, async_save: bool = False):
        self.save_dir, self.run_id = Path(save_dir), run_id
        self.keep_last, self.async_save = keep_last, async_save
        self._pending: dict | None = None

    def save(self, state, consumed_samples: int) -> None:
        """Saves the state after `state.iteration` steps (collective over the layout)."""
        self.finalize()
        groups = state.groups
        tmp = self.save_dir / f"{TMP_PREFIX}{iteration_dir_name(state.iteration)}"
        problem = None
        if groups.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as err:
                problem = f"--save {self.save_dir}: cannot create {tmp.name} ({err.strerror or err})"
        if agree_on_failure(problem is not None, groups):   # also: the directory exists for everyone
            raise CheckpointError(problem or f"--save {self.save_dir}: rank 0 could not create the "
                                  f"checkpoint directory")
        tensors, index = collect_rank_state(state)
        index["run_id"] = self.run_id
        metadata = run_metadata(state, self.run_id, consumed_samples) if groups.rank == 0 else None
        pending = {"tmp": tmp, "iteration": state.iteration, "groups": groups, "metadata": metadata,
                   "error": None}
        if self.async_save:
            thread = threading.Thread(target=self._write, args=(pending, tensors, index), daemon=True)
            pending["thread"] = thread
            thread.start()
        else:
            self._write(pending, tensors, index)
        self._pending = pending
        if not self.async_save:
            self.finalize()

    @staticmethod
    def _write(pending: dict, tensors: dict, index: dict) -> None:
        data_name, index_name = rank_file_names(index["rank"])
        path = pending["tmp"] / data_name
        try:
            save_file(tensors, str(path), metadata={"megazero_run_id": index["run_id"],
                                                    "rank": str(index["rank"])})
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            # Every tensor carries its own CRC in the index; the size catches truncation up front.
            index["file"] = {"name": data_name, "bytes": path.stat().st_size}
            write_json_atomic(pending["tmp"] / index_name, index)
        except OSError as err:
            pending["error"] = f"{path}: could not write ({err.strerror or err}); check free space and permissions"

    def finalize(self) -> None:
        """Waits for a pending save and commits it (collective); a no-op when none is pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if "thread" in pending:
            pending["thread"].join()
        groups = pending["groups"]
        if agree_on_failure(pending["error"] is not None, groups):
            if groups.rank == 0:
                shutil.rmtree(pending["tmp"], ignore_errors=True)
            raise CheckpointError(pending["error"] or "another rank could not write its checkpoint "
                                  "shard; the previous checkpoint is kept")
        if groups.rank == 0:
            final = self.save_dir / iteration_dir_name(pending["iteration"])
            write_json_atomic(pending["tmp"] / METADATA, merge_rank_indexes(pending["tmp"], pending["metadata"]))
            commit_directory(pending["tmp"], final)
            remove_old(self.save_dir, self.keep_last)
        agree_on_failure(False, groups)                  # committed before anyone goes on


def write_full_checkpoint(save_dir: str | Path, model_config, tensors: dict[str, torch.Tensor],
                          run_id: str, iteration: int = 0) -> Path:
    """A one-rank checkpoint from full fp32 tensors under the model's parameter names (e.g. a model
    imported from another format): zero Adam states, no RNG states, iteration `iteration`. Like any
    checkpoint it loads at every layout (`--load`, `--finetune`). Returns the iteration directory."""
    save_dir = Path(save_dir)
    tmp = save_dir / f"{TMP_PREFIX}{iteration_dir_name(iteration)}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    data, pieces = {}, {}
    for name, value in tensors.items():
        value = value.detach().to("cpu", torch.float32).contiguous()
        flat = value.reshape(-1)
        entry = {"shape": list(value.shape), "offset": 0, "length": flat.numel(), "tp": None, "crc": {}}
        for kind in KINDS:
            data[f"{name}/{kind}"] = flat.clone() if kind == "fp32" else torch.zeros_like(flat)
            entry["crc"][kind] = crc32(data[f"{name}/{kind}"])
        pieces[name] = entry
    data_name = rank_file_names(0)[0]
    save_file(data, str(tmp / data_name), metadata={"megazero_run_id": run_id, "rank": "0"})
    index = {"rank": 0, "coords": [0, 0, 0], "pieces": pieces, "rng": {}, "layout_key": None,
             "run_id": run_id, "file": {"name": data_name, "bytes": (tmp / data_name).stat().st_size}}
    metadata = {
        "format_version": FORMAT_VERSION, "megazero_version": importlib.metadata.version("megazero"),
        "run_id": run_id, "iteration": iteration, "consumed_samples": 0,
        "model": dataclasses.asdict(model_config), "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1},
        "precision": {}, "global_batch_size": None, "engine": {"step_count": 0, "skipped_steps": 0},
        "loss_scaler": None, "rank_files": [data_name], "ranks": [index],
    }
    write_json_atomic(tmp / METADATA, metadata)
    final = save_dir / iteration_dir_name(iteration)
    commit_directory(tmp, final)
    return final
