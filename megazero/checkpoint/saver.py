"""Saving a training run: every rank writes its own shard, rank 0 commits the directory.

What a rank writes is its ZeRO storage's own state, read through the storage interface: for every
parameter piece it holds (`local_pieces`) the fp32 master, exp_avg and exp_avg_sq (each moment in
the dtype the run keeps it in, fp32 or bf16), under the parameter's model name, with where the
piece sits in the (TP-local) parameter and how that parameter is split over TP. Copies held elsewhere too are written once: by the rank that counts the
parameter in the gradient norm (TP rank 0 for replicated ones, the first stage for a tied
embedding), and by the first MiCS replica (DP rank 0 at stage 0). Also per rank: its RNG states;
and by the first DP and TP rank of each stage, the model's buffers (the routers' expert biases).
Rank 0 adds metadata.json: model, layout, iteration, consumed samples, the loss of the iteration (and
whether it was finite), the seed, loss scaler, Adam step, lr schedule, and the run's tokenizer (its
files go into tokenizer/). Rank 0 holds the folder's lock for the whole job (checkpoint.resume), so
it alone commits, applies --ckpt-keep-last and removes leftovers (retention.py).

Before anything is written the ranks agree that the filesystem has room for the whole checkpoint;
a write that fails anyway (ENOSPC, EIO) is agreed the same way: every rank raises the same one-line
SaveError, rank 0 removes the temporary directory, and `latest` keeps naming the previous checkpoint
(agreement.py). Files get the umask's mode (safetensors itself writes 0600).

With `async_save` the tensors are copied to host memory and written by a background thread while
training goes on; the commit (rename into place, `latest`) happens at the next save or at `finalize`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import shutil
import threading
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from megazero.models.param_info import param_info
from megazero.parallel.moe import ExpertShard
from megazero.core import comm, host_read
from .agreement import RankReport, agree, check_room, check_written, errno_of, free_bytes
from .files import (
    FORMAT_VERSION,
    LATEST,
    METADATA,
    TOKENIZER_DIR,
    apply_umask,
    commit_directory,
    copy_tokenizer,
    iteration_dir_name,
    latest_iteration_name,
    rank_file_names,
    temporary_name,
    write_file_atomic,
    write_json_atomic,
)
from .retention import apply_keep_last

KINDS = ("fp32", "exp_avg", "exp_avg_sq")
# Written in the dtype the storage keeps them in (bf16 under --exp-avg-dtype / --exp-avg-sq-dtype
# bf16: half the bytes); every other kind in fp32. The reader widens each piece exactly.
LOW_PRECISION_KINDS = ("exp_avg", "exp_avg_sq")


def canonical_name(param, engine) -> str:
    """The model's name for a parameter (a tied head copy is saved under the embedding's)."""
    return param_info(param).init_name or engine.names[id(param)]


def crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.contiguous().view(torch.uint8).numpy()) if tensor.numel() else 0


def collect_rank_state(state) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's tensors (host copies) and their index."""
    engine, groups = state.engine, state.groups
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict] = {}
    for storage in engine.storages():
        # stage 0 keeps whole copies on its domain's data-parallel ranks (experts: the expert-data-
        # parallel ones), the other stages on its MiCS replicas
        domain_groups = engine.domain_of(storage).groups
        copy_index = domain_groups.dp.rank if storage.shard is None else domain_groups.replica.rank
        if copy_index != 0:
            continue
        for param, offset, length in storage.local_pieces():
            if not engine.counts_in_norm(param):
                continue
            name = canonical_name(param, engine)
            info = param_info(param)
            shard = info.tp_shard
            ep = [shard.ep_rank, shard.ep] if isinstance(shard, ExpertShard) else None
            shard = shard.tp if isinstance(shard, ExpertShard) else shard
            entry = {
                "shape": list(info.zero_full_shape or param.shape),
                "offset": offset,
                "length": length,
                "crc": {},
                "ep": ep,
                "tp": None if shard is None else [shard.dim, shard.rank, shard.size, shard.chunks],
            }
            for kind in storage.checkpoint_kinds():
                view = storage.local_view(param, kind).detach()
                dtype = view.dtype if kind in LOW_PRECISION_KINDS else torch.float32
                if view.is_meta:  # the dry run's device: no values to copy, sizes still count
                    tensors[f"{name}/{kind}"] = view.to(dtype)
                    entry["crc"][kind] = 0
                    continue
                host = view.to("cpu", dtype, copy=True)
                tensors[f"{name}/{kind}"] = host
                entry["crc"][kind] = crc32(host)
            pieces[name] = entry
    buffers = model_buffers(state, tensors) if groups.dp.rank == 0 and groups.coords.tp == 0 else {}
    rng = {"cpu": torch.get_rng_state()}
    if state.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(state.device)
    rng.update({f"tracker/{k}": v.cpu() for k, v in state.tracker.get_states().items()})
    for key, value in rng.items():
        tensors[f"rng/{key}"] = value.clone()
    index = {
        "rank": groups.rank,
        "coords": list(groups.coords),
        "pieces": pieces,
        "buffers": buffers,
        "rng": {key: crc32(value) for key, value in rng.items()},
        "layout_key": layout_key(state),
    }
    # What the optimizer's placement keeps beside the states (ZenFlow's open "auto" window).
    index.update(engine.placement.checkpoint_index(engine.storages(), lambda p: canonical_name(p, engine)))
    return tensors, index


def model_buffers(state, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """The model's buffers (the routers' expert biases: state outside the optimizer, the same on
    every rank of a stage) into `tensors` as "buffer/<name>"; their index entries. Written by the
    first data-parallel and tensor-parallel rank of each stage. One never used yet (still on the
    meta device of the build) is its initial zeros."""
    index = {}
    for chunk in state.chunks:
        for name, buffer in chunk.named_buffers():
            host = torch.zeros(buffer.shape) if buffer.is_meta else buffer.detach().to("cpu", torch.float32, copy=True)
            tensors[f"buffer/{name}"] = host
            index[name] = {"shape": list(buffer.shape), "crc": crc32(host)}
    return index


def layout_key(state) -> list:
    """What must match for RNG states to carry over: the same rank in the same layout, on the same
    device type (a CPU generator's state and a CUDA one's differ in size and meaning, and the
    tensor-parallel tracker holds the device's)."""
    cfg, topo = state.cfg, state.groups.topology
    return [topo.world_size, topo.tp, topo.pp, cfg.parallel.virtual_stages, state.groups.rank, state.device.type] + (
        [topo.cp] if topo.cp > 1 else []
    )


def loss_fields(loss: float | None) -> dict:
    """The metadata's record of the iteration's training loss (None: no step ran in this job):
    retention keeps the newest checkpoint whose loss was finite."""
    return {
        "loss": loss if loss is not None and math.isfinite(loss) else None,
        "loss_finite": None if loss is None else math.isfinite(loss),
    }


def run_metadata(state, run_id: str, consumed_samples: int) -> dict:
    cfg, topo, engine = state.cfg, state.groups.topology, state.engine
    return {
        "format_version": FORMAT_VERSION,
        "megazero_version": importlib.metadata.version("megazero"),
        "run_id": run_id,
        "iteration": state.iteration,
        "consumed_samples": consumed_samples,
        **loss_fields(None),
        "seed": cfg.seed,
        "model": dataclasses.asdict(cfg.model),
        "layout": {
            "world_size": topo.world_size,
            "tp": topo.tp,
            "pp": topo.pp,
            "dp": topo.dp,
            "cp": topo.cp,
            "virtual_stages": cfg.parallel.virtual_stages,
            "layer_split": cfg.parallel.layer_split,
            "zero_stage": cfg.zero.stage,
            "mics_shard_size": cfg.zero.mics_shard_size,
        },
        "precision": {"bf16": cfg.precision.bf16, "fp16": cfg.precision.fp16},
        "global_batch_size": cfg.global_batch_size,
        "train_iters": cfg.train_iters,
        # the iteration this optimizer state began at (0, or a resume's without its optimizer): with
        # the step counts it must give the iteration back (checked by the reader)
        "engine": {
            "step_count": engine.step_count,
            "skipped_steps": engine.skipped_steps,
            "first_iteration": state.iteration - engine.step_count - engine.skipped_steps,
        },
        "loss_scaler": engine.loss_scaler.state_dict(),
        "optimizer": cfg.optimizer.model_dump(),  # with the iteration: the lr schedule
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
    return tuple(v > 0 for v in host_read.read(values, "save flags", healthy=[float(f) for f in flags]))


class CheckpointSaver:
    """Writes checkpoints of one run into `save_dir` (see the module docstring). `tokenizer` describes
    the run's tokenizer: {"type", "eod", "vocab_size", "files": {name in the checkpoint: source path}};
    rank 0 copies the files into each checkpoint's tokenizer/ folder (None on the other ranks, or for
    a run without one)."""

    def __init__(
        self,
        save_dir: str | Path,
        run_id: str,
        keep_last: int = 0,
        async_save: bool = False,
        tokenizer: dict | None = None,
        say=None,
        warn=None,
        metadata=None,
    ):
        """`metadata(state, run_id, consumed_samples) -> dict`: rank 0's metadata.json (default
        run_metadata, a pretraining run's; megazero.initialize's engine gives its own), to which
        `save` adds the iteration's loss; `warn`: rank 0's own warning lines."""
        self.save_dir, self.run_id = Path(save_dir), run_id
        self.metadata = metadata or run_metadata
        self.keep_last, self.async_save = keep_last, async_save
        self.tokenizer = tokenizer
        self.say = say or (lambda line: None)  # the run's log: a line per committed checkpoint
        # rank 0's own line (it alone knows what retention could not remove; it may not be the logging rank)
        self.warn = warn or (lambda line: print(f" warning: {line}", flush=True))
        self._pending: dict | None = None
        # --ckpt-keep-last deletes only once a step with a finite loss followed the newest commit
        # (`confirm`): a checkpoint saved as the run diverged never costs the healthy one before it
        self.committed: str | None = None  # the newest checkpoint this job committed
        self.confirmed = latest_iteration_name(self.save_dir)  # the newest a finite loss followed
        self._retention_due = self._writer = False

    def save(
        self, state, consumed_samples: int, why: str = "", dir_name: str | None = None, loss: float | None = None
    ) -> None:
        """Saves the state after `state.iteration` steps (collective over the layout), into the
        directory `dir_name` (default iter_<iteration>; `latest` names it). Raises SaveError
        on every rank alike when the filesystem has no room for it (before anything is written) or a
        rank fails to write; the previous checkpoint stays as it was either way. `why` (periodic,
        final, ...) goes into the line said once it is committed; `loss`, the iteration's training
        loss, into the metadata."""
        self.finalize()
        started = time.monotonic()
        groups, iteration = state.groups, state.iteration
        tensors, index = collect_rank_state(state)
        index["run_id"] = self.run_id
        metadata = self.metadata(state, self.run_id, consumed_samples) if groups.rank == 0 else None
        if metadata is not None:
            metadata.update(loss_fields(loss))
        if metadata is not None and self.tokenizer is not None:
            metadata["tokenizer"] = {**self.tokenizer, "files": sorted(self.tokenizer["files"])}
        need = self._bytes_to_write(tensors, index, metadata)
        # The dry run (a meta state) writes nothing: its room is not this machine's disk.
        free = free_bytes(self.save_dir) if state.device.type != "meta" else 2**62
        room = agree(RankReport(need, free), groups)
        check_room(room, self.save_dir, iteration)
        name = dir_name or iteration_dir_name(iteration)
        tmp = self.save_dir / temporary_name(self.run_id, name)
        code = 0
        if groups.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as err:
                code = errno_of(err)
        # also the barrier after which the directory exists for everyone
        check_written(agree(RankReport(errno=code), groups), self.save_dir, iteration, "create the temporary directory")
        pending = {
            "tmp": tmp,
            "iteration": iteration,
            "name": name,
            "groups": groups,
            "metadata": metadata,
            "errno": 0,
            "started": started,
            "bytes": sum(r.bytes_needed for r in room),
            "why": why,
            "written": state.device.type != "meta",
        }
        if not pending["written"]:
            pass  # the dry run's state has no values to write; the agreements around it still run
        elif self.async_save:
            thread = threading.Thread(target=self._write, args=(pending, tensors, index), daemon=True)
            pending["thread"] = thread
            thread.start()
            self.say(
                f" saving checkpoint of iteration {iteration} into {self.save_dir} in the background "
                f"(--async-save): committed at the next save or the end"
            )
        else:
            self._write(pending, tensors, index)
        self._pending = pending
        if not self.async_save:
            self.finalize()

    def _bytes_to_write(self, tensors: dict, index: dict, metadata: dict | None) -> int:
        """This rank's bytes: its tensors, their safetensors header, its index (written beside the
        shard, then again inside metadata.json), and on rank 0 the metadata and tokenizer files."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values()) + 128 * len(tensors) + 1024
        nbytes += 2 * len(json.dumps(index))
        if metadata is not None:
            nbytes += len(json.dumps(metadata))
            if self.tokenizer is not None:
                nbytes += sum(os.path.getsize(src) for src in self.tokenizer["files"].values())
        return nbytes

    def _write(self, pending: dict, tensors: dict, index: dict) -> None:
        data_name, index_name = rank_file_names(index["rank"])
        path = pending["tmp"] / data_name
        try:
            save_file(tensors, str(path), metadata={"megazero_run_id": index["run_id"], "rank": str(index["rank"])})
            apply_umask(path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            # Every tensor carries its own CRC in the index; the size catches truncation up front.
            index["file"] = {"name": data_name, "bytes": path.stat().st_size}
            write_json_atomic(pending["tmp"] / index_name, index)
            if pending["metadata"] is not None and self.tokenizer is not None:
                copy_tokenizer(self.tokenizer["files"], pending["tmp"] / TOKENIZER_DIR)
        except OSError as err:
            pending["errno"] = errno_of(err)

    def finalize(self) -> None:
        """Waits for a pending save and commits it (collective); a no-op when none is pending. Raises
        SaveError on every rank alike when a rank could not write its shard or rank 0 could not
        commit; the temporary directory is removed then."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if "thread" in pending:
            pending["thread"].join()
        groups, tmp, iteration, name = pending["groups"], pending["tmp"], pending["iteration"], pending["name"]
        reports = agree(RankReport(errno=pending["errno"]), groups)
        if any(r.errno for r in reports):
            if groups.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            check_written(reports, self.save_dir, iteration, "write its shard of the checkpoint")
        code = 0
        if groups.rank == 0 and pending["written"]:
            code = self._commit(tmp, name, pending["metadata"])
        check_written(
            agree(RankReport(errno=code), groups), self.save_dir, iteration, "commit the checkpoint"
        )  # also: committed before anyone goes on
        if not pending["written"]:
            return
        why = f" ({pending['why']})" if pending["why"] else ""
        took = time.monotonic() - pending["started"]
        took = f"committed {took:.1f} s after its step" if "thread" in pending else f"{took:.1f} s"
        self.say(
            f" saved checkpoint{why} of iteration {iteration}: "
            f"{self.save_dir / name} ({pending['bytes'] / 2**20:.1f} MiB, {took})"
        )
        self.committed, self._retention_due, self._writer = name, True, groups.rank == 0

    def confirm(self) -> None:
        """A step with a finite loss followed the newest commit (or the run ended as planned): that
        checkpoint is the one to go back to, and --ckpt-keep-last applies now (rank 0, which also
        retries what could not be removed before; no collective)."""
        if self.committed is not None:
            self.confirmed = self.committed
        if not self._retention_due:
            return
        self._retention_due = False
        if self._writer:
            flag = f"--ckpt-keep-last {self.keep_last}" if self.keep_last else f"--save {self.save_dir}"
            problem = apply_keep_last(self.save_dir, self.keep_last, self.run_id, flag)
            if problem:
                self.warn(problem)

    def rewind(self) -> str:
        """After the run diverged: `latest` names the newest confirmed checkpoint again if one was
        committed since (rank 0 writes it); returns the words naming what is kept."""
        save = self.save_dir
        if self.confirmed is None:
            return (
                f"no checkpoint saved yet in {save}"
                if self.committed is None
                else f"last checkpoint: {save / self.committed}, saved as the run diverged (there is no earlier one)"
            )
        if self.committed not in (None, self.confirmed) and (save / self.confirmed / METADATA).is_file():
            if self._writer:
                write_file_atomic(save / LATEST, (self.confirmed + "\n").encode())
            return (
                f"latest names {save / self.confirmed} again, the last checkpoint a finite loss followed "
                f"({self.committed} was saved as the run diverged; resume with --load {save})"
            )
        return f"last checkpoint: {save / self.confirmed} (resume with --load {save})"

    def _commit(self, tmp: Path, name: str, metadata: dict) -> int:
        """Rank 0: metadata.json, then the directory into place and `latest` at it; 0 or the errno of
        a failure, after which the new directory is gone and `latest` names what it named before."""
        final = self.save_dir / name
        existed = final.exists()
        try:
            write_json_atomic(tmp / METADATA, merge_rank_indexes(tmp, metadata))
            commit_directory(tmp, final, self.run_id)  # a replaced directory left over: retention's
            return 0
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            latest = latest_iteration_name(self.save_dir)
            if not existed and final.exists() and latest != final.name:
                shutil.rmtree(final, ignore_errors=True)
            return errno_of(err)
