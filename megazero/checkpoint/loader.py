"""Loading a checkpoint into a freshly set-up run of any layout.

For every parameter this rank's ZeRO storage holds, the reader assembles the saved full value of
each kind (fp32 master, and unless told otherwise exp_avg and exp_avg_sq), this rank's TP slice is
taken and the storage writes its own piece (`write_full`, which also refreshes the low-precision
weights). Adam moments load into whatever dtype this run keeps them in, whatever the saving run's:
a bf16 moment into an fp32 one exactly, an fp32 moment into a bf16 one rounded to nearest even (the
rounding a step stores with), so fp32 -> bf16 -> fp32 loses what bf16 cannot hold and
bf16 -> fp32 -> bf16 is bitwise. One parameter at a time, no communication: every layout reads
every other. Vocabulary padding of the word embedding and output head (it depends on the TP
degree) is cut or zero-filled; no other tensor may change shape, but for the learned position table
grown on purpose (--extend-position-embeddings: row p starts from the saved row p mod its rows, Adam
moments alike). The model's buffers (the routers' expert biases) are set from the checkpoint, by
name, whatever layout saved them. The loss scaler, Adam's step count and, for the same rank of the
same layout on the same device type, the RNG states follow.
"""

from __future__ import annotations

import dataclasses

import torch

from .files import CheckpointError
from .reader import POSITION_TABLE, CheckpointReader
from .saver import canonical_name, layout_key
from megazero.models.param_info import param_info


@dataclasses.dataclass
class LoadResult:
    iteration: int
    consumed_samples: int
    run_id: str
    rng_restored: bool


# The tensors whose rows are the padded vocabulary (padding depends on the TP degree).
VOCAB_PADDED = ("embedding.word.weight", "output_head.weight")


def _fit(full: torch.Tensor, shape: tuple[int, ...], name: str, where, extend_positions: bool = False) -> torch.Tensor:
    """The saved value in the target's full shape: equal, or differing only in vocabulary padding
    rows (dimension 0 of the embedding and output head), which are zero, or a position table grown
    by `extend_positions` (its rows repeated)."""
    if tuple(full.shape) == tuple(shape):
        return full
    same_rows = full.dim() == len(shape) and tuple(full.shape[1:]) == tuple(shape[1:])
    if same_rows and name == POSITION_TABLE and extend_positions and shape[0] > full.shape[0]:
        return full[torch.arange(shape[0]) % full.shape[0]]
    if same_rows and name in VOCAB_PADDED:
        out = torch.zeros(shape, dtype=full.dtype)
        rows = min(shape[0], full.shape[0])
        if full[rows:].abs().sum() != 0:
            raise CheckpointError(
                f"{where}: {name} has {full.shape[0]} rows with values beyond the {shape[0]} this model has"
            )
        out[:rows] = full[:rows]
        return out
    raise CheckpointError(
        f"{where}: {name} has shape {tuple(full.shape)}, this model's is "
        f"{tuple(shape)}; load a checkpoint of the same model"
    )


def load_checkpoint(
    state,
    path,
    *,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    extend_positions: bool = False,
) -> LoadResult:
    """Fills `state` (from megazero.training.setup) from the checkpoint at `path` (an iter_*
    directory, or a save directory whose `latest` names one). `finetune`: weights only, iteration 0;
    `extend_positions`: a smaller learned position table grows (--extend-position-embeddings)."""
    reader = path if isinstance(path, CheckpointReader) else CheckpointReader(path)
    reader.check_model(state.cfg.model, extend_positions=extend_positions)
    engine = state.engine
    load_engine_states(engine, reader, load_optim and not finetune, extend_positions)
    _load_buffers(state, reader)
    meta = reader.metadata
    if finetune:
        return LoadResult(0, 0, reader.run_id, False)
    if load_optim:
        engine.step_count = meta["engine"]["step_count"]
        engine.skipped_steps = meta["engine"]["skipped_steps"]
        engine.placement.restore(reader.indexes, engine.storages(), lambda p: canonical_name(p, engine))
        if meta["loss_scaler"] is not None:  # None: written from full tensors, no run
            engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    state.iteration = meta["iteration"]
    rng = load_rng and _restore_rng(state, reader)
    return LoadResult(meta["iteration"], meta["consumed_samples"], reader.run_id, rng)


def load_engine_states(
    engine, reader: CheckpointReader, load_optim: bool = True, extend_positions: bool = False
) -> None:
    """Every parameter piece the engine's storages hold on this rank, from the checkpoint: the fp32
    master, and with `load_optim` the optimizer states (the storage's checkpoint kinds);
    `extend_positions`: a smaller learned position table grows (see _fit)."""
    for storage in engine.storages():
        kinds = storage.checkpoint_kinds() if load_optim else ("fp32",)
        for i, param in enumerate(storage.params):
            if not storage.weights_always_full and storage.layout.local_piece(i) is None:
                continue  # stage 3: this rank holds none of it
            name = canonical_name(param, engine)
            shard = param_info(param).tp_shard
            local_shape = tuple(storage.full_shape(i))
            full_shape = shard.full_shape(local_shape) if shard is not None else local_shape
            for kind in kinds:
                full = _fit(reader.full_tensor(name, kind), full_shape, name, reader.path, extend_positions)
                value = shard.local_from_full(full) if shard is not None else full
                storage.write_full(param, kind, value.to(storage.device))


def _load_buffers(state, reader: CheckpointReader) -> None:
    """The model's buffers (expert biases) from the checkpoint, whatever layout saved them; one the
    checkpoint lacks (saved without the expert bias) keeps its initial zeros."""
    for chunk in state.chunks:
        for name, buffer in list(chunk.named_buffers()):
            if name in reader.buffers:
                owner, _, leaf = name.rpartition(".")
                value = _fit(reader.buffer(name), tuple(buffer.shape), name, reader.path)
                setattr(chunk.get_submodule(owner), leaf, value.to(state.device))


def _restore_rng(state, reader: CheckpointReader) -> bool:
    """Restores this rank's RNG states if the checkpoint holds this very rank of this layout, saved
    on this device type (CPU <-> GPU moves keep the weights and optimizer, not the RNG streams)."""
    rank = state.groups.rank
    if rank >= len(reader.indexes) or reader.indexes[rank].get("layout_key") != layout_key(state):
        return False
    torch.set_rng_state(reader.rng_state(rank, "cpu"))
    if state.device.type == "cuda" and "cuda" in reader.indexes[rank]["rng"]:
        torch.cuda.set_rng_state(reader.rng_state(rank, "cuda"), state.device)
    prefix = "tracker/"
    states = {
        key[len(prefix) :]: reader.rng_state(rank, key) for key in reader.indexes[rank]["rng"] if key.startswith(prefix)
    }
    state.tracker.set_states({k: v.to(state.tracker.states[k].device) for k, v in states.items()})
    return True
