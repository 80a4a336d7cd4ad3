"""Reading and writing Megatron-LM's checkpoint directories, as full (unsharded) megatron-core tensors.

Two formats, both under `SAVE/latest_checkpointed_iteration.txt` and `SAVE/iter_NNNNNNN/`:
- torch_dist (`--ckpt-format torch_dist`): the iteration directory is a torch.distributed.checkpoint
  folder (`.metadata`, `__R_K.distcp`) plus `metadata.json` and `common.pt` (args, iteration). The
  layers are stacked: `decoder.layers.<rest>` has a leading layer axis, split here into
  `decoder.layers.N.<rest>`. Read and written without a process group (one process).
- legacy (`--ckpt-format torch`): `iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`, one pickle per
  tensor/pipeline rank, each with the rank's shard of the model; merged here along each parameter's
  tensor-parallel axis, pipeline stages renumbered into global layers.

The distributed optimizer's Adam states (fp32 masters, exp_avg, exp_avg_sq) come too where the
checkpoint holds them, full and by the same names (megatron_optim.py knows their layouts); they are
checked against the weights (each master rounds to its weight) before anything is written. Exports
write them as torch_dist's `fully_reshardable` optimizer state.

Every pickle (`common.pt`, `model_optim_rng.pt`, `distrib_optim.pt`) is read with torch.load(weights_only=True) and an
explicit allow-list, megatron-core's own (argparse.Namespace, SimpleNamespace, PosixPath, signals,
numpy arrays for the RNG states; Megatron's enums read as their values and its records as attribute
bags, without importing megatron): no code from the file runs; anything else is refused naming it. Mapping names to megazero's is
models/megatron_adapter.py's job; this module must not know megazero's parameter names.
"""
from __future__ import annotations

import argparse
import io
import json
import pathlib
import pickle
import re
import signal
import types
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from .files import apply_umask
from . import megatron_optim, megatron_stages
from .megatron_optim import OPTIM_FILE, MegatronOptimizerError

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


def safe_load(path: Path, data=None):
    """A Megatron pickle (the file `path`, or `data`, its bytes as a file object, named by `path`),
    weights-only: tensors, containers, argparse.Namespace, Megatron's enums (as their values), numpy
    arrays (the RNG states)."""
    allowed = ([argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals]
               + [(_stand_in(name), name) for name in _MEGATRON_ENUMS]
               + [(_record_stand_in(name), name) for name in _MEGATRON_RECORDS] + _numpy_globals())
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path if data is None else data, map_location="cpu", weights_only=True)
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


def read_checkpoint(path: str | Path, optimizer: bool = True) -> tuple[dict, dict, dict]:
    """(the non-tensor record: args as a dict, iteration, and `progress` (megatron_optim.progress); the
    model's full tensors by megatron-core name; the distributed optimizer's full states,
    {param|exp_avg|exp_avg_sq: {name: tensor}}, empty when the checkpoint holds none or `optimizer`
    is False) of a Megatron-LM checkpoint in either format."""
    directory = iteration_dir(path)
    ranks = sorted(directory.glob(f"mp_rank_*/{LEGACY_FILE}"))
    if not (directory / "metadata.json").is_file() and not ranks:
        raise MegatronCheckpointError(f"{directory}: neither a torch_dist checkpoint (metadata.json) nor a legacy "
                                      f"one (mp_rank_*/{LEGACY_FILE}); give a Megatron-LM --save directory or "
                                      f"one of its iter_* directories")
    try:
        if (directory / "metadata.json").is_file():
            record, state, states = _read_torch_dist(directory, optimizer)
        else:
            record, state, states = _read_legacy(directory, ranks, optimizer)
        if states:
            megatron_optim.check_masters(state, states, directory)
    except MegatronOptimizerError as err:
        raise MegatronCheckpointError(str(err)) from None
    return record, state, states


def _record(common: dict, where: Path) -> dict:
    args = common.get("args")
    if args is None:
        raise MegatronCheckpointError(f"{where}: no `args` record; megazero needs Megatron-LM's arguments to "
                                      f"know the model's shape (checkpoints saved by Megatron-LM keep them)")
    args = dict(vars(args))
    return {"args": args, "iteration": common.get("iteration", 0),
            "checkpoint_version": common.get("checkpoint_version"), "progress": megatron_optim.progress(common, args)}


def _unstack(stacked: dict) -> dict:
    """Per-layer tensors from torch_dist's stacked ones (`decoder.layers.<rest>`, a leading layer axis)."""
    state = {}
    for name, tensor in stacked.items():
        if _STACKED.match(name):
            rest = name[len("decoder.layers."):]
            state.update({f"decoder.layers.{i}.{rest}": layer for i, layer in enumerate(tensor.unbind(0))})
        else:
            state[name] = tensor
    return state


def _read_torch_dist(directory: Path, optimizer: bool) -> tuple[dict, dict, dict]:
    backend = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise MegatronCheckpointError(f"{directory}: sharded backend {backend!r}; megazero reads torch_dist "
                                      f"(re-save with --ckpt-format torch_dist)")
    common = safe_load(directory / "common.pt")
    record = _record(common, directory)
    reader = dcp.FileSystemReader(str(directory))
    metadata = reader.read_metadata().state_dict_metadata
    stacked = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in metadata.items()
               if isinstance(meta, TensorStorageMetadata) and (optimizer or not name.startswith("optimizer."))}
    dcp.load(stacked, storage_reader=reader, no_dist=True)
    model, states, buckets = megatron_optim.split_torch_dist(stacked, directory)
    if buckets and record["progress"]["adam_step"] is None:     # dp_reshardable: the groups are an object
        objects = _read_objects(reader, metadata, r"^optimizer\.distributed\.dp_group_idx_0\.optimizer/", directory)
        groups = objects[0] if objects else None
        record["progress"].update(adam_step=megatron_optim.adam_step(groups), adam=megatron_optim.adam_hyper(groups))
    model, states = _unstack(model), {kind: _unstack(tensors) for kind, tensors in states.items()}
    if buckets and not states:
        states = _bucket_states(model, buckets, record["args"], directory)
    return record, model, states


class _RawBytes(DefaultLoadPlanner):
    """Keeps the objects DCP reads as their bytes (its default planner unpickles them unrestricted)."""

    objects: dict

    def load_bytes(self, read_item, value) -> None:
        self.objects[read_item.dest_index.fqn] = io.BytesIO(value.read())


def _read_objects(reader, metadata: dict, pattern: str, directory: Path) -> list:
    """The objects of a torch_dist checkpoint whose names match `pattern`, unpickled weights-only."""
    names = sorted(name for name, meta in metadata.items() if isinstance(meta, BytesStorageMetadata)
                   and re.match(pattern, name))
    planner = _RawBytes(flatten_state_dict=False)
    planner.objects = {}
    dcp.load({name: None for name in names}, storage_reader=reader, planner=planner, no_dist=True)
    return [safe_load(directory / name, planner.objects[name]) for name in names]


def _shard_shapes(name: str, full: torch.Tensor, tp: int) -> list[torch.Size]:
    """One parameter's tensor-parallel shard shapes (rank order), as _merge_tp joins them."""
    if _ROW.search(name):
        return [t.shape for t in full.chunk(tp, dim=1)]
    if _COLUMN.search(name):
        return [t.shape for t in full.chunk(tp, dim=0)]
    return [full.shape] * tp


def _bucket_states(model: dict, buckets: dict, args: dict, where: Path) -> dict:
    """Full states from torch_dist's dp_reshardable buckets: per model-parallel domain (pipeline rank
    x tensor degree + tensor rank, as megatron-core numbers its model-parallel group) and grad buffer
    (a virtual-pipeline chunk) the buckets joined make the legacy buffer of that chunk; the parameter
    order is megatron-core's registration order of the spec whose masters match."""
    tp, pp, vp = megatron_stages.degrees(args)
    if sorted(buckets) != list(range(tp * pp)) or any(sorted(b) != list(range(vp)) for b in buckets.values()):
        raise MegatronCheckpointError(
            f"{where}: dp_reshardable optimizer state of {len(buckets)} model-parallel domains where the run's "
            f"arguments give {tp * pp} of {vp} grad buffers each; re-save with --dist-ckpt-optim-fully-reshardable, "
            f"or pass --weights-only to import the weights alone")
    swiglu = bool(args.get("swiglu"))
    shards = {name: [torch.empty(shape) for shape in _shard_shapes(name, full, tp)] for name, full in model.items()}
    if megatron_stages.shared_embedding(args, pp - 1, vp - 1, pp, vp):        # the last stage's copy of a tied head
        shards.setdefault("output_layer.weight", shards.get("embedding.word_embeddings.weight"))
    for spec in megatron_optim.LAYER_ORDERS:
        states = {kind: {} for kind in megatron_optim.STATES}
        try:
            for p, v in ((p, v) for p in range(pp) for v in range(vp)):
                order = megatron_optim.registration_order(megatron_stages.chunk_names(shards, args, p, v), spec)
                if order is None:
                    raise MegatronOptimizerError(f"{where}: no {spec} order")
                chunk = megatron_optim.Chunk(p, v, frozenset(megatron_stages.shared_embedding(args, p, v, pp, vp)))
                ranks = [megatron_optim.bucket_rank_states(buckets[p * tp + t][v], {n: shards[n][t] for n in order},
                                                           args, where, chunk) for t in range(tp)]
                for kind in megatron_optim.STATES:
                    states[kind].update({n: _merge_tp(n, [rank[kind][n] for rank in ranks], swiglu) for n in order
                                         if n in model})
            megatron_optim.check_masters(model, states, where)
            return states
        except MegatronOptimizerError:
            continue
    raise MegatronCheckpointError(
        f"{where}: the dp_reshardable optimizer buckets match no parameter order megazero knows (megatron-core's "
        f"local and Transformer Engine layer specs); re-save with --dist-ckpt-optim-fully-reshardable, or pass "
        f"--weights-only to import the weights alone")


def _stack(state: dict, layers: list[int]) -> dict:
    """torch_dist's stacked tensors (`decoder.layers.<rest>`, a leading layer axis) from per-layer ones."""
    stacked = {}
    for name, tensor in state.items():
        match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
        if match is None:
            stacked[name] = tensor.contiguous()
        elif int(match.group(1)) == 0:
            rest = match.group(2)
            stacked[f"decoder.layers.{rest}"] = torch.stack([state[f"decoder.layers.{i}.{rest}"] for i in layers])
    return stacked


def write_torch_dist(save: str | Path, record: dict, state: dict, iteration: int, states: dict | None = None) -> Path:
    """Writes full megatron-core tensors (per-layer names) as a torch_dist checkpoint at `iteration`
    under `save`, with its tracker file; `record` is what goes into common.pt besides the iteration
    (args, and with `states` the scheduler's state and the optimizer's param groups). `states`:
    the distributed optimizer's {param | exp_avg | exp_avg_sq: {name: tensor}}, written as its
    `fully_reshardable` sharding type. Returns the directory."""
    save = Path(save)
    directory = save / f"iter_{iteration:07d}"
    directory.mkdir(parents=True)
    layers = sorted({int(m.group(1)) for m in map(re.compile(r"^decoder\.layers\.(\d+)\.").match, state) if m})
    stacked = _stack(state, layers)
    for kind, tensors in (states or {}).items():
        stacked.update({f"optimizer.state.{kind}.{name}": t for name, t in _stack(tensors, layers).items()})
    # megatron-core's local-spec linear layers keep an empty extra state, one object per layer, stored
    # as megatron-core stores objects: a pickled list of the object's values
    for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
        for i in layers:
            stacked[f"decoder.layers.{module}._extra_state/shard_{i}_{len(layers)}"] = [None]
    # unflattened: the planner pickles each object value whole, as megatron-core's does
    dcp.save(stacked, storage_writer=dcp.FileSystemWriter(str(directory)),
             planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    common = {"args": argparse.Namespace(**record["args"]), "iteration": iteration, "checkpoint_version": 3.0}
    if states:
        common.update(opt_param_scheduler=record["opt_param_scheduler"],
                      optimizer={"optimizer": {"param_groups": record["param_groups"]},
                                 "param_state_sharding_type": "fully_reshardable"},
                      content_metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    torch.save(common, directory / "common.pt")
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


def _legacy_files(directory: Path, files: list[Path]) -> tuple[dict, int, int]:
    """{(pp rank, tp rank): file}, the tensor and the pipeline degree; refuses an incomplete copy."""
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
    return by_rank, tp, pp


def _chunks(loaded: dict, file: Path) -> list[dict]:
    """A legacy file's model chunks: `model`, or a virtual pipeline's model0, model1, ... in order."""
    if "model" in loaded:
        return [loaded["model"]]
    keys = sorted((k for k in loaded if re.fullmatch(r"model\d+", str(k))), key=lambda k: int(k[5:]))
    if not keys:
        raise MegatronCheckpointError(f"{file}: no `model` (nor model0, model1, ...); not a Megatron-LM checkpoint")
    return [loaded[k] for k in keys]


def _read_legacy(directory: Path, files: list[Path], optimizer: bool) -> tuple[dict, dict, dict]:
    """Every rank's chunks merged along tensor parallelism, placed by chunk: megatron-core deals a
    virtual pipeline's chunks in rounds (chunk v of stage p after every chunk of rounds before v and
    of stages before p in round v), each chunk numbering its layers from 0."""
    by_rank, tp, pp = _legacy_files(directory, files)
    with_states = optimizer and all((file.parent / OPTIM_FILE).is_file() for file in by_rank.values())
    record, merged = None, {}
    for p in range(pp):
        loaded = [safe_load(by_rank[(p, t)]) for t in range(tp)]
        record = record or _record(loaded[0], by_rank[(p, 0)])
        args = record["args"]
        chunks = [_chunks(one, by_rank[(p, t)]) for t, one in enumerate(loaded)]
        vp = len(chunks[0])
        buffers = [megatron_optim.legacy_buffers(by_rank[(p, t)].parent / OPTIM_FILE,
                                                 safe_load(by_rank[(p, t)].parent / OPTIM_FILE)) if with_states else []
                   for t in range(tp)]
        for v in range(vp):
            models = [{k: x for k, x in chunks[t][v].items() if isinstance(x, torch.Tensor)} for t in range(tp)]
            shards = [models]
            if with_states:
                if any(len(b) != vp for b in buffers):
                    raise MegatronCheckpointError(f"{by_rank[(p, 0)].parent / OPTIM_FILE}: {len(buffers[0])} grad "
                                                  f"buffers for {vp} model chunks; pass --weights-only to import the "
                                                  f"weights alone")
                chunk = megatron_optim.Chunk(p, v, frozenset(megatron_stages.shared_embedding(args, p, v, pp, vp)))
                ranks = [megatron_optim.legacy_rank_states(by_rank[(p, t)].parent / OPTIM_FILE, buffers[t][v],
                                                           models[t], args, chunk) for t in range(tp)]
                shards += [[rank[kind] for rank in ranks] for kind in megatron_optim.STATES]
            merged[(v, p)] = [{name: _merge_tp(name, [m[name] for m in per_rank], bool(args.get("swiglu")))
                               for name in per_rank[0]} for per_rank in shards]
    state, states, offset = {}, {}, 0
    for key in sorted(merged):          # rounds first, stages within a round
        parts = merged[key]
        for part, out in zip(parts, [state] + [states.setdefault(k, {}) for k in megatron_optim.STATES[:len(parts) - 1]]):
            for name, tensor in megatron_stages.renumbered(part, offset).items():
                out.setdefault(name, tensor)
        offset += megatron_stages.layer_count(parts[0])
    return record, state, states

