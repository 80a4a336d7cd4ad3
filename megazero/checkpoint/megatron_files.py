"""Reading and writing Megatron-LM's checkpoint directories, as full (unsharded) megatron-core tensors.

Two formats, both under `SAVE/latest_checkpointed_iteration.txt` and `SAVE/iter_NNNNNNN/`:
- torch_dist (`--ckpt-format torch_dist`): the iteration directory is a torch.distributed.checkpoint
  folder (`.metadata`, `__R_K.distcp`) plus `metadata.json` and `common.pt` (args, iteration). The
  layers are stacked: `decoder.layers.<rest>` has a leading layer axis, split here into
  `decoder.layers.N.<rest>`. Read and written without a process group (one process).
- legacy (`--ckpt-format torch`): `iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`, one pickle per
  tensor/pipeline rank, each with the rank's shard of the model; merged here along each parameter's
  tensor-parallel axis, pipeline stages renumbered into global layers.

Every pickle (`common.pt`, `model_optim_rng.pt`) is read with torch.load(weights_only=True) and an
explicit allow-list, megatron-core's own (argparse.Namespace, SimpleNamespace, PosixPath, signals,
numpy arrays for the RNG states; Megatron's enums read as their values and its records as attribute
bags, without importing megatron): no code from the file runs; anything else is refused naming it. Mapping names to megazero's is
models/megatron_adapter.py's job; this module must not know megazero's parameter names.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import pickle
import re
import signal
import types
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .files import apply_umask

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_STACKED = re.compile(r"^decoder\.layers\.(?!\d)")
# What megatron-core itself allows in its pickles (megatron/core/safe_globals.py) and megazero reads
# without importing it: its enums, as their values, and its records, as plain attribute bags.
_MEGATRON_ENUMS = ("megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphScope",
                   "megatron.core.enums.ModelType", "megatron.core.rerun_state_machine.RerunDiagnostic",
                   "megatron.core.rerun_state_machine.RerunMode")
_MEGATRON_RECORDS = ("megatron.core.optimizer.OptimizerConfig", "megatron.core.optimizer.optimizer_config.OptimizerConfig",
                     "megatron.core.rerun_state_machine.RerunState")


class MegatronCheckpointError(ValueError):
    """A directory that is not a readable Megatron-LM checkpoint; the message says why and what to do."""


def _stand_in(qualified: str) -> type:
    """A class standing in for one of Megatron's enums: unpickling calls it with the member's value."""
    return type(qualified.rsplit(".", 1)[1], (), {"__new__": lambda cls, value: value})


def _record_stand_in(qualified: str) -> type:
    """A class standing in for one of Megatron's dataclasses: its fields become attributes."""
    return type(qualified.rsplit(".", 1)[1], (types.SimpleNamespace,), {})


def _numpy_globals() -> list:
    """What a numpy array's pickle names (Megatron keeps numpy's RNG state): its reconstructor, the
    array and dtype classes; they build arrays from bytes and run nothing else."""
    import numpy
    core = getattr(numpy, "_core", None) or numpy.core
    return [core.multiarray._reconstruct, numpy.ndarray, numpy.dtype,
            *(getattr(numpy.dtypes, name) for name in dir(numpy.dtypes) if name.endswith("DType"))]


def safe_load(path: Path):
    """A Megatron pickle, weights-only: tensors, containers, argparse.Namespace, Megatron's enums (as
    their values), numpy arrays (the RNG states)."""
    allowed = ([argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals]
               + [(_stand_in(name), name) for name in _MEGATRON_ENUMS]
               + [(_record_stand_in(name), name) for name in _MEGATRON_RECORDS] + _numpy_globals())
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f"it names {found.group(1)}, outside the allow-list" if found else str(err).split("\n")[0]
        raise MegatronCheckpointError(f"{path}: refused to unpickle it ({what}); megazero loads Megatron "
                                      f"pickles weights-only, never running code from the file") from None


def iteration_dir(path: str | Path) -> Path:
    """An iter_* directory itself, or the one a save directory's tracker file names."""
    path = Path(path)
    if (path / TRACKER).is_file():
        text = (path / TRACKER).read_text().strip()
        if text == "release":
            return path / "release"
        if not text.isdigit():
            raise MegatronCheckpointError(f"{path / TRACKER}: {text!r} is not an iteration number")
        return path / f"iter_{int(text):07d}"
    if path.is_dir():
        return path
    raise MegatronCheckpointError(f"{path}: no such directory")


def read_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """(the non-tensor record: args as a dict, iteration, ...; the model's full tensors by megatron-core
    name) of a Megatron-LM checkpoint in either format."""
    directory = iteration_dir(path)
    if (directory / "metadata.json").is_file():
        return _read_torch_dist(directory)
    ranks = sorted(directory.glob(f"mp_rank_*/{LEGACY_FILE}"))
    if ranks:
        return _read_legacy(directory, ranks)
    raise MegatronCheckpointError(f"{directory}: neither a torch_dist checkpoint (metadata.json) nor a legacy "
                                  f"one (mp_rank_*/{LEGACY_FILE}); give a Megatron-LM --save directory or "
                                  f"one of its iter_* directories")


def _record(common: dict, where: Path) -> dict:
    args = common.get("args")
    if args is None:
        raise MegatronCheckpointError(f"{where}: no `args` record; megazero needs Megatron-LM's arguments to "
                                      f"know the model's shape (checkpoints saved by Megatron-LM keep them)")
    return {"args": dict(vars(args)), "iteration": common.get("iteration", 0),
            "checkpoint_version": common.get("checkpoint_version")}


def _read_torch_dist(directory: Path) -> tuple[dict, dict]:
    backend = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise MegatronCheckpointError(f"{directory}: sharded backend {backend!r}; megazero reads torch_dist "
                                      f"(re-save with --ckpt-format torch_dist)")
    reader = dcp.FileSystemReader(str(directory))
    metadata = reader.read_metadata().state_dict_metadata
    stacked = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in metadata.items()
               if isinstance(meta, TensorStorageMetadata) and not name.startswith("optimizer.")}
    dcp.load(stacked, storage_reader=reader, no_dist=True)
    state = {}
    for name, tensor in stacked.items():
        if _STACKED.match(name):
            rest = name[len("decoder.layers."):]
            state.update({f"decoder.layers.{i}.{rest}": layer for i, layer in enumerate(tensor.unbind(0))})
        else:
            state[name] = tensor
    return _record(safe_load(directory / "common.pt"), directory), state


def write_torch_dist(save: str | Path, record: dict, state: dict, iteration: int) -> Path:
    """Writes full megatron-core tensors (per-layer names) as a torch_dist checkpoint at `iteration`
    under `save`, with its tracker file; `record` is what goes into common.pt. Returns the directory."""
    save = Path(save)
    directory = save / f"iter_{iteration:07d}"
    directory.mkdir(parents=True)
    layers = sorted({int(m.group(1)) for m in map(re.compile(r"^decoder\.layers\.(\d+)\.").match, state) if m})
    stacked = {}
    for name, tensor in state.items():
        match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
        if match is None:
            stacked[name] = tensor.contiguous()
        elif int(match.group(1)) == 0:
            rest = match.group(2)
            stacked[f"decoder.layers.{rest}"] = torch.stack([state[f"decoder.layers.{i}.{rest}"] for i in layers])
    # megatron-core's local-spec linear layers keep an empty extra state, one object per layer, stored
    # as megatron-core stores objects: a pickled list of the object's values
    for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
        for i in layers:
            stacked[f"decoder.layers.{module}._extra_state/shard_{i}_{len(layers)}"] = [None]
    # unflattened: the planner pickles each object value whole, as megatron-core's does
    dcp.save(stacked, storage_writer=dcp.FileSystemWriter(str(directory)),
             planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    torch.save({"args": argparse.Namespace(**record["args"]), "iteration": iteration,
                "checkpoint_version": 3.0}, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}))
    (save / TRACKER).write_text(f"{iteration}")
    for file in [*directory.iterdir(), save / TRACKER]:
        apply_umask(file)
    return directory


_COLUMN = re.compile(r"(word_embeddings\.weight|output_layer\.weight|linear_qkv\.(weight|bias)|linear_fc1\.(weight|bias))$")
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")


def _merge_tp(name: str, shards: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """One parameter's full tensor from its tensor-parallel shards (rank order)."""
    if _ROW.search(name):
        return torch.cat(shards, dim=1)
    if not _COLUMN.search(name):
        return shards[0]                   # replicated: norms, row-parallel biases, positions
    if swiglu and "linear_fc1." in name:   # each rank holds [its gate rows; its up rows]
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)


def _read_legacy(directory: Path, files: list[Path]) -> tuple[dict, dict]:
    by_rank = {}
    for file in files:
        match = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?", file.parent.name)
        if match is None:
            raise MegatronCheckpointError(f"{file.parent}: not an mp_rank_TT[_PPP] directory")
        by_rank[(int(match.group(2) or 0), int(match.group(1)))] = file
    pp = 1 + max(p for p, _ in by_rank)
    tp = 1 + max(t for _, t in by_rank)
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for p in range(pp) for t in range(tp)
               if (p, t) not in by_rank]
    if missing:
        raise MegatronCheckpointError(f"{directory}: {missing[0]}/{LEGACY_FILE} is missing; the copy is incomplete")
    record, state, offset = None, {}, 0
    for p in range(pp):
        loaded = [safe_load(by_rank[(p, t)]) for t in range(tp)]
        if "model" not in loaded[0]:
            raise MegatronCheckpointError(f"{by_rank[(p, 0)]}: no `model` (a virtual-pipeline checkpoint keeps "
                                          f"model0, model1, ...; megazero reads plain pipelines only)")
        record = record or _record(loaded[0], by_rank[(p, 0)])
        swiglu = bool(record["args"].get("swiglu"))
        models = [{k: v for k, v in one["model"].items() if isinstance(v, torch.Tensor)} for one in loaded]
        layers = {int(m.group(1)) for m in map(re.compile(r"^decoder\.layers\.(\d+)\.").match, models[0]) if m}
        for name in models[0]:
            full = _merge_tp(name, [m[name] for m in models], swiglu)
            match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
            if match:
                name = f"decoder.layers.{offset + int(match.group(1))}.{match.group(2)}"
            state.setdefault(name, full)
        offset += len(layers)
    return record, state
