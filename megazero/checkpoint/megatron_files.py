"""Reading and writing Megatron-LM's checkpoint directories, as full (unsharded) megatron-core tensors.

Two formats, both under `SAVE/latest_checkpointed_iteration.txt` and `SAVE/iter_NNNNNNN/`:
- torch_dist (`--ckpt-format torch_dist`): the iteration directory is a torch.distributed.checkpoint
  folder (`.metadata`, `__R_K.distcp`) plus `metadata.json` and `common.pt` (args, iteration). The
  layers are stacked: `decoder.layers.<rest>` has a leading layer axis, split here into
  `decoder.layers.N.<rest>`. Read and written without a process group (one process).
- legacy (`--ckpt-format torch`): `iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`, one
  pickle per tensor/pipeline/expert rank; megatron_legacy.py merges them (megatron_stages.py knows
  where each stage's, chunk's and expert rank's parameters go).

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
from . import megatron_legacy, megatron_optim, megatron_stages
from .megatron_optim import MegatronOptimizerError

TRACKER = "latest_checkpointed_iteration.txt"
_LOCAL_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.*)$")
LEGACY_FILE = megatron_legacy.LEGACY_FILE
_STACKED = re.compile(r"^decoder\.layers\.(?!\d)")
# What megatron-core itself allows in its pickles (megatron/core/safe_globals.py) and megazero reads
# without importing it: its enums, as their values, and its records, as plain attribute bags.
_MEGATRON_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
)
_MEGATRON_RECORDS = (
    "megatron.core.optimizer.OptimizerConfig",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunState",
)


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
    return [
        core.multiarray._reconstruct,
        numpy.ndarray,
        numpy.dtype,
        *(getattr(numpy.dtypes, name) for name in dir(numpy.dtypes) if name.endswith("DType")),
    ]


def safe_load(path: Path, data=None):
    """A Megatron pickle (the file `path`, or `data`, its bytes as a file object, named by `path`),
    weights-only: tensors, containers, argparse.Namespace, Megatron's enums (as their values), numpy
    arrays (the RNG states)."""
    allowed = (
        [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals]
        + [(_stand_in(name), name) for name in _MEGATRON_ENUMS]
        + [(_record_stand_in(name), name) for name in _MEGATRON_RECORDS]
        + _numpy_globals()
    )
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path if data is None else data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f"it names {found.group(1)}, outside the allow-list" if found else str(err).split("\n")[0]
        raise MegatronCheckpointError(
            f"{path}: refused to unpickle it ({what}); megazero loads Megatron "
            f"pickles weights-only, never running code from the file"
        ) from None


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
        raise MegatronCheckpointError(
            f"{directory}: neither a torch_dist checkpoint (metadata.json) nor a legacy "
            f"one (mp_rank_*/{LEGACY_FILE}); give a Megatron-LM --save directory or "
            f"one of its iter_* directories"
        )
    try:
        if (directory / "metadata.json").is_file():
            record, state, states = _read_torch_dist(directory, optimizer)
        else:
            record, state, states = megatron_legacy.read_legacy(directory, ranks, optimizer, safe_load, _record)
        if states:
            layout = "fully_reshardable" if (directory / "metadata.json").is_file() else "legacy"
            megatron_optim.check_masters(state, states, directory, layout)
    except MegatronOptimizerError as err:
        raise MegatronCheckpointError(str(err)) from None
    return record, state, states


def _record(common: dict, where: Path) -> dict:
    args = common.get("args")
    if args is None:
        raise MegatronCheckpointError(
            f"{where}: no `args` record; megazero needs Megatron-LM's arguments to "
            f"know the model's shape (checkpoints saved by Megatron-LM keep them)"
        )
    args = dict(vars(args))
    return {
        "args": args,
        "iteration": common.get("iteration", 0),
        "checkpoint_version": common.get("checkpoint_version"),
        "progress": megatron_optim.progress(common, args),
    }


def _unstack(stacked: dict) -> dict:
    """Per-layer tensors from torch_dist's stacked ones (`decoder.layers.<rest>`, a leading layer axis;
    experts, `mlp.experts.experts.<rest>`, an expert axis next, become per-expert tensors)."""
    state = {}
    for name, tensor in stacked.items():
        if _STACKED.match(name):
            rest = name[len("decoder.layers.") :]
            for i, layer in enumerate(tensor.unbind(0)):
                if rest.startswith("mlp.experts.experts."):  # then an expert axis: the local spec's names
                    tail = rest[len("mlp.experts.experts.") :]
                    state.update(
                        {
                            f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{tail}": expert
                            for e, expert in enumerate(layer.unbind(0))
                        }
                    )
                else:
                    state[f"decoder.layers.{i}.{rest}"] = layer
        else:
            state[name] = tensor
    return state


def _read_torch_dist(directory: Path, optimizer: bool) -> tuple[dict, dict, dict]:
    backend = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise MegatronCheckpointError(
            f"{directory}: sharded backend {backend!r}; megazero reads torch_dist "
            f"(re-save with --ckpt-format torch_dist)"
        )
    common = safe_load(directory / "common.pt")
    record = _record(common, directory)
    reader = dcp.FileSystemReader(str(directory))
    metadata = reader.read_metadata().state_dict_metadata
    stacked = {
        name: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata) and (optimizer or not megatron_optim.is_optimizer(name))
    }
    dcp.load(stacked, storage_reader=reader, no_dist=True)
    model, states, buckets = megatron_optim.split_torch_dist(stacked, directory)
    if buckets and record["progress"]["adam_step"] is None:  # dp_reshardable: the groups are an object
        objects = _read_objects(
            reader, metadata, r"^(chained_0\.)?optimizer\.distributed\.dp_group_idx_0\.optimizer/", directory
        )
        groups = objects[0] if objects else None
        record["progress"].update(adam_step=megatron_optim.adam_step(groups), adam=megatron_optim.adam_hyper(groups))
    model, states = _unstack(model), {kind: _unstack(tensors) for kind, tensors in states.items()}
    if buckets and not states:
        states = _bucket_states(model, buckets[0], record["args"], directory)
        if record["args"].get("num_experts"):
            _expert_bucket_states(model, buckets.get(1, {}), record["args"], directory, states)
            megatron_optim.check_masters(model, states, directory, "dp_reshardable")
    return record, model, states


class _RawBytes(DefaultLoadPlanner):
    """Keeps the objects DCP reads as their bytes (its default planner unpickles them unrestricted)."""

    objects: dict

    def load_bytes(self, read_item, value) -> None:
        self.objects[read_item.dest_index.fqn] = io.BytesIO(value.read())


def _read_objects(reader, metadata: dict, pattern: str, directory: Path) -> list:
    """The objects of a torch_dist checkpoint whose names match `pattern`, unpickled weights-only."""
    names = sorted(
        name for name, meta in metadata.items() if isinstance(meta, BytesStorageMetadata) and re.match(pattern, name)
    )
    planner = _RawBytes(flatten_state_dict=False)
    planner.objects = {}
    dcp.load({name: None for name in names}, storage_reader=reader, planner=planner, no_dist=True)
    return [safe_load(directory / name, planner.objects[name]) for name in names]


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
            f"or pass --weights-only to import the weights alone"
        )
    swiglu = bool(args.get("swiglu"))
    shards = {
        name: [torch.empty(shape) for shape in megatron_stages.shard_shapes(name, full, tp)]
        for name, full in model.items()
    }
    if megatron_stages.shared_embedding(args, pp - 1, vp - 1, pp, vp):  # the last stage's copy of a tied head
        shards.setdefault("output_layer.weight", shards.get("embedding.word_embeddings.weight"))
    for spec in megatron_optim.LAYER_ORDERS:
        states = {kind: {} for kind in megatron_optim.STATES}
        try:
            for p, v in ((p, v) for p in range(pp) for v in range(vp)):
                dense = [n for n in shards if not megatron_stages.is_expert(n)]
                order = megatron_optim.registration_order(megatron_stages.chunk_names(dense, args, p, v), spec)
                if order is None:
                    raise MegatronOptimizerError(f"{where}: no {spec} order")
                chunk = megatron_optim.Chunk(p, v, frozenset(megatron_stages.shared_embedding(args, p, v, pp, vp)))
                ranks = [
                    megatron_optim.bucket_rank_states(
                        buckets[p * tp + t][v], {n: shards[n][t] for n in order}, args, where, chunk
                    )
                    for t in range(tp)
                ]
                for kind in megatron_optim.STATES:
                    states[kind].update(
                        {
                            n: megatron_stages.merge_tp(n, [rank[kind][n] for rank in ranks], swiglu)
                            for n in order
                            if n in model
                        }
                    )
            megatron_optim.check_masters(
                {n: w for n, w in model.items() if not megatron_stages.is_expert(n)}, states, where
            )
            return states
        except MegatronOptimizerError:
            continue
    raise MegatronCheckpointError(
        f"{where}: the dp_reshardable optimizer buckets match no parameter order megazero knows (megatron-core's "
        f"local and Transformer Engine layer specs); re-save with --dist-ckpt-optim-fully-reshardable, or pass "
        f"--weights-only to import the weights alone"
    )


def _expert_bucket_states(model: dict, buckets: dict, args: dict, where: Path, states: dict) -> None:
    """Adds the experts' full states from the experts' optimizer's dp_reshardable buckets: per domain
    (pipeline rank x expert x tensor degree + expert rank x tensor degree + tensor rank, megatron-core's
    tp-ep-pp group) and chunk, each expert rank's experts in registration order (layer, expert,
    linear_fc1 then linear_fc2)."""
    tp, pp, vp = megatron_stages.degrees(args)
    ep = args.get("expert_model_parallel_size") or 1
    local = args["num_experts"] // ep
    if sorted(buckets) != list(range(tp * ep * pp)):
        raise MegatronCheckpointError(
            f"{where}: the experts' dp_reshardable optimizer state has {len(buckets)} domains "
            f"where the run's arguments give {tp * ep * pp}; pass --weights-only to import "
            f"the weights alone"
        )
    experts = [n for n in model if megatron_stages.is_expert(n)]
    for p, v, e in ((p, v, e) for p in range(pp) for v in range(vp) for e in range(ep)):
        order = sorted(
            (
                n
                for n in megatron_stages.chunk_names(experts, args, p, v)
                if e * local <= megatron_stages.expert_index(n) < (e + 1) * local
            ),
            key=megatron_stages.expert_key,
        )
        shards = {n: [torch.empty(shape) for shape in megatron_stages.shard_shapes(n, model[n], tp)] for n in order}
        ranks = [
            megatron_optim.bucket_rank_states(
                buckets[(p * ep + e) * tp + t][v],
                {n: shards[n][t] for n in order},
                args,
                where,
                megatron_optim.Chunk(p, v),
            )
            for t in range(tp)
        ]
        for kind in megatron_optim.STATES:
            states[kind].update(
                {
                    n: megatron_stages.merge_tp(n, [rank[kind][n] for rank in ranks], bool(args.get("swiglu")))
                    for n in order
                }
            )


def _stack(state: dict, layers: list[int]) -> dict:
    """torch_dist's stacked tensors (`decoder.layers.<rest>`, a leading layer axis) from per-layer ones."""
    stacked = {}
    for name, tensor in state.items():
        expert = _LOCAL_EXPERT.match(name)
        if expert:  # then an expert axis: megatron-core's experts.experts.<rest>
            if expert.group(1) == expert.group(2) == "0":
                rest, count = expert.group(3), megatron_stages.expert_count(state)
                stacked[f"decoder.layers.mlp.experts.experts.{rest}"] = torch.stack(
                    [
                        torch.stack(
                            [state[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{rest}"] for e in range(count)]
                        )
                        for i in layers
                    ]
                )
            continue
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
    experts = megatron_stages.expert_count(state)
    for kind, tensors in (states or {}).items():
        # a mixture of experts has two chained optimizers, the dense parameters' and the experts'
        stacked.update(
            {
                (f"chained_{int('.experts.experts.' in name)}." if experts else "")
                + f"optimizer.state.{kind}.{name}": t
                for name, t in _stack(tensors, layers).items()
            }
        )
    # megatron-core's local-spec linear layers keep an empty extra state, one object per layer (and
    # expert), stored as megatron-core stores objects: a pickled list of the object's values
    for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
        for i in layers:
            stacked[f"decoder.layers.{module}._extra_state/shard_{i}_{len(layers)}"] = [None]
    for module, i, e in ((m, i, e) for m in ("linear_fc1", "linear_fc2") for i in layers for e in range(experts)):
        stacked[f"decoder.layers.mlp.experts.experts.{module}._extra_state/shard_{i}.{e}_{len(layers)}.{experts}"] = [
            None
        ]
    # unflattened: the planner pickles each object value whole, as megatron-core's does
    dcp.save(
        stacked,
        storage_writer=dcp.FileSystemWriter(str(directory)),
        planner=DefaultSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )
    common = {"args": argparse.Namespace(**record["args"]), "iteration": iteration, "checkpoint_version": 3.0}
    if states:
        parts = [
            {"optimizer": {"param_groups": record[key]}, "param_state_sharding_type": "fully_reshardable"}
            for key in ("param_groups", "expert_param_groups")[: 2 if experts else 1]
        ]
        common.update(
            opt_param_scheduler=record["opt_param_scheduler"],
            optimizer=dict(enumerate(parts)) if experts else parts[0],
            content_metadata={"distrib_optim_sharding_type": "fully_reshardable"},
        )
    torch.save(common, directory / "common.pt")
    (directory / "metadata.json").write_text(
        json.dumps(
            {
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            }
        )
    )
    (save / TRACKER).write_text(f"{iteration}")
    for file in [*directory.iterdir(), save / TRACKER]:
        apply_umask(file)
    return directory
