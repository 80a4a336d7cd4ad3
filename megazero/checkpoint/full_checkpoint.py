"""A one-rank checkpoint written from full fp32 tensors under the model's parameter names (a model
imported from another format, tools/convert_checkpoint.py): the same files and metadata a training
run's CheckpointSaver commits (files.py), so it loads at every layout. Owns nothing of a running
job: no process group, no engine, no RNG states.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .files import (
    FORMAT_VERSION,
    METADATA,
    TOKENIZER_DIR,
    apply_umask,
    commit_directory,
    copy_tokenizer,
    iteration_dir_name,
    rank_file_names,
    temporary_name,
    write_json_atomic,
)
from .saver import KINDS, crc32


def write_full_checkpoint(
    save_dir: str | Path,
    model_config,
    tensors: dict[str, torch.Tensor],
    run_id: str,
    iteration: int = 0,
    tokenizer: dict | None = None,
    states: dict | None = None,
    resume: dict | None = None,
) -> Path:
    """A one-rank checkpoint from full fp32 tensors under the model's parameter names (e.g. a model
    imported from another format): zero Adam states unless `states` gives them ({"exp_avg" |
    "exp_avg_sq": {name: full tensor}}), no RNG states, iteration `iteration`, and the tokenizer
    described as CheckpointSaver's `tokenizer`. `resume` makes it a run to continue: its
    "step_count" (Adam's steps), "consumed_samples", "optimizer" (the lr schedule and Adam, as
    OptimizerConfig's fields), "train_iters" and "global_batch_size". Like any checkpoint it loads
    at every layout (`--load`, `--finetune`). Returns the iteration directory."""
    save_dir = Path(save_dir)
    tmp = save_dir / temporary_name(run_id, iteration_dir_name(iteration))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    data, pieces = _full_pieces(tensors, states)
    data_name = rank_file_names(0)[0]
    save_file(data, str(tmp / data_name), metadata={"megazero_run_id": run_id, "rank": "0"})
    apply_umask(tmp / data_name)
    index = {
        "rank": 0,
        "coords": [0, 0, 0],
        "pieces": pieces,
        "rng": {},
        "layout_key": None,
        "run_id": run_id,
        "file": {"name": data_name, "bytes": (tmp / data_name).stat().st_size},
    }
    metadata = {
        "format_version": FORMAT_VERSION,
        "megazero_version": importlib.metadata.version("megazero"),
        "run_id": run_id,
        "iteration": iteration,
        "consumed_samples": 0,
        "model": dataclasses.asdict(model_config),
        "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1},
        "precision": {},
        "global_batch_size": None,
        "loss": None,
        "loss_finite": None,
        "engine": {"step_count": 0, "skipped_steps": 0, "first_iteration": iteration},
        "loss_scaler": None,
        "rank_files": [data_name],
        "ranks": [index],
    }
    if resume is not None:
        steps = resume["step_count"]
        metadata.update(
            consumed_samples=resume["consumed_samples"],
            optimizer=resume["optimizer"],
            train_iters=resume["train_iters"],
            global_batch_size=resume["global_batch_size"],
            engine={"step_count": steps, "skipped_steps": 0, "first_iteration": iteration - steps},
        )
    if tokenizer is not None:
        copy_tokenizer(tokenizer["files"], tmp / TOKENIZER_DIR)
        metadata["tokenizer"] = {**tokenizer, "files": sorted(tokenizer["files"])}
    write_json_atomic(tmp / METADATA, metadata)
    final = save_dir / iteration_dir_name(iteration)
    commit_directory(tmp, final, run_id)
    return final


def _full_pieces(tensors: dict[str, torch.Tensor], states: dict | None) -> tuple[dict, dict]:
    """The one rank's tensors ("<name>/<kind>", fp32) and their index entries: each weight whole, its
    Adam moments from `states` or zeros."""
    data, pieces = {}, {}
    for name, value in tensors.items():
        value = value.detach().to("cpu", torch.float32).contiguous()
        flat = value.reshape(-1)
        entry = {"shape": list(value.shape), "offset": 0, "length": flat.numel(), "tp": None, "crc": {}}
        for kind in KINDS:
            given = (states or {}).get(kind, {}).get(name)
            if given is not None and tuple(given.shape) != tuple(value.shape):
                raise ValueError(f"{name}: its {kind} has shape {tuple(given.shape)}, the weight {tuple(value.shape)}")
            data[f"{name}/{kind}"] = (
                flat.clone()
                if kind == "fp32"
                else torch.zeros_like(flat)
                if given is None
                else given.detach().to("cpu", torch.float32).reshape(-1).clone()
            )
            entry["crc"][kind] = crc32(data[f"{name}/{kind}"])
        pieces[name] = entry
    return data, pieces
