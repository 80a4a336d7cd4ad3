"""Reading Megatron-LM's legacy checkpoints (`--ckpt-format torch`) as full megatron-core tensors;
megatron_files.py calls it and hands it its weights-only unpickler. Must not know megazero's names.

Layout: `iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`, one folder per tensor rank TT,
pipeline rank PPP (when the pipeline degree is above 1) and expert-parallel rank EEE (when the
expert degree is above 1), each with the rank's shard of the model: `model`, or a virtual pipeline's
`model0`, `model1`, ... (megatron_stages.py places them), the experts numbered locally (expert rank e
holds experts e L .. e L + L - 1), and beside it `distrib_optim.pt`, the distributed optimizer's flat
buffers per grad buffer (one per model chunk): one optimizer's, or with experts a list of two, the
dense parameters' (kept only in the file of the dense optimizer's first data-parallel rank) and the
experts' (megatron_optim.py lays them out).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch

from . import megatron_optim, megatron_stages
from .megatron_optim import OPTIM_FILE

LEGACY_FILE = "model_optim_rng.pt"


class LegacyFilesError(ValueError):
    """Legacy files megazero cannot read; the message says why and what to do."""


def _legacy_files(directory: Path, files: list[Path], args: dict) -> tuple[dict, int, int, int]:
    """{(pp rank, ep rank, tp rank): file}, the tensor, pipeline and expert degrees; refuses an
    incomplete copy. Two numbers after mp_rank_TT are the pipeline rank, then the expert rank; one
    is the pipeline rank unless the run had experts split and no pipeline."""
    by_rank = {}
    expert_only = (args.get("pipeline_model_parallel_size") or 1) == 1 and (
        args.get("expert_model_parallel_size") or 1
    ) > 1
    for file in files:
        match = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?", file.parent.name)
        if match is None:
            raise LegacyFilesError(f"{file.parent}: not an mp_rank_TT[_PPP][_EEE] directory")
        t, second, third = int(match.group(1)), int(match.group(2) or 0), int(match.group(3) or 0)
        p, e = (0, second) if expert_only and match.group(3) is None else (second, third)
        by_rank[(p, e, t)] = file
    pp, ep, tp = (1 + max(key[i] for key in by_rank) for i in range(3))
    missing = [
        key for key in ((p, e, t) for p in range(pp) for e in range(ep) for t in range(tp)) if key not in by_rank
    ]
    if missing:
        p, e, t = missing[0]
        raise LegacyFilesError(
            f"{directory}: the file of tensor rank {t}, pipeline rank {p}, expert rank {e} "
            f"({LEGACY_FILE}) is missing; the copy is incomplete"
        )
    return by_rank, tp, pp, ep


def _chunks(loaded: dict, file: Path) -> list[dict]:
    """A legacy file's model chunks: `model`, or a virtual pipeline's model0, model1, ... in order."""
    if "model" in loaded:
        return [loaded["model"]]
    keys = sorted((k for k in loaded if re.fullmatch(r"model\d+", str(k))), key=lambda k: int(k[5:]))
    if not keys:
        raise LegacyFilesError(f"{file}: no `model` (nor model0, model1, ...); not a Megatron-LM checkpoint")
    return [loaded[k] for k in keys]


def _chunk_states(file: Path, parts: list, model: dict, args: dict, chunk: megatron_optim.Chunk) -> dict:
    """{state: {name: tensor}} of one rank's chunk from its distrib_optim.pt buffers `parts` (the
    dense optimizer's, then the experts'; None where the file keeps none)."""
    out = {kind: {} for kind in megatron_optim.STATES}
    groups = (
        [n for n in model if not megatron_stages.is_expert(n)],
        [n for n in model if megatron_stages.is_expert(n)],
    )
    for index, (names, part) in enumerate(zip(groups, parts + [None] * (2 - len(parts)))):
        if not names or part is None:  # the dense states of another expert rank's file
            continue
        if chunk.vp_stage >= len(part):
            raise LegacyFilesError(
                f"{file}: {len(part)} grad buffers, fewer than the model's chunks; pass "
                f"--weights-only to import the weights alone"
            )
        where = chunk if index == 0 else megatron_optim.Chunk(chunk.pp_rank, chunk.vp_stage)
        states = megatron_optim.legacy_rank_states(
            file, part[chunk.vp_stage], {n: model[n] for n in names}, args, where
        )
        for kind in megatron_optim.STATES:
            out[kind].update(states[kind])
    return out


def _read_rank_group(files: list[Path], load: Callable, args: dict, with_states: bool, p: int, e: int, pp: int) -> dict:
    """{vp stage: [model, param, exp_avg, exp_avg_sq]} of one (pipeline, expert) rank, merged over
    its tensor ranks `files`, experts given global numbers."""
    loaded = [load(file) for file in files]
    chunks = [_chunks(one, file) for one, file in zip(loaded, files)]
    vp = len(chunks[0])
    parts = (
        [megatron_optim.legacy_buffers(file.parent / OPTIM_FILE, load(file.parent / OPTIM_FILE)) for file in files]
        if with_states
        else []
    )
    local = (args.get("num_experts") or 0) // (args.get("expert_model_parallel_size") or 1)
    out = {}
    for v in range(vp):
        models = [{k: x for k, x in chunk[v].items() if isinstance(x, torch.Tensor)} for chunk in chunks]
        shards = [models]
        if with_states:
            chunk = megatron_optim.Chunk(p, v, frozenset(megatron_stages.shared_embedding(args, p, v, pp, vp)))
            ranks = [
                _chunk_states(file.parent / OPTIM_FILE, part, model, args, chunk)
                for file, part, model in zip(files, parts, models)
            ]
            shards += [[rank[kind] for rank in ranks] for kind in megatron_optim.STATES]
        swiglu = bool(args.get("swiglu"))
        out[v] = [
            megatron_stages.global_experts(
                {name: megatron_stages.merge_tp(name, [m[name] for m in per_rank], swiglu) for name in per_rank[0]},
                e,
                local,
            )
            for per_rank in shards
        ]
    return out


def read_legacy(
    directory: Path, files: list[Path], optimizer: bool, load: Callable, record_of: Callable
) -> tuple[dict, dict, dict]:
    """(record, full model tensors, full optimizer states) of legacy files; `load` unpickles a file
    weights-only, `record_of(loaded, path)` makes the record. A virtual pipeline's chunks are dealt in
    rounds (chunk v of stage p after every chunk of rounds before v and of stages before p in round
    v), each chunk numbering its layers from 0."""
    first = load(files[0])
    record = record_of(first, files[0])
    args = record["args"]
    by_rank, tp, pp, ep = _legacy_files(directory, files, args)
    cached = {files[0]: first}
    with_states = optimizer and all((file.parent / OPTIM_FILE).is_file() for file in by_rank.values())
    merged = {}
    for p in range(pp):
        for e in range(ep):
            group = [by_rank[(p, e, t)] for t in range(tp)]
            per_chunk = _read_rank_group(
                group, lambda f: cached.pop(f) if f in cached else load(f), args, with_states, p, e, pp
            )
            for v, parts in per_chunk.items():
                into = merged.setdefault((v, p), [{} for _ in parts])
                for part, out in zip(parts, into):
                    for name, tensor in part.items():
                        out.setdefault(name, tensor)
    counts = {megatron_stages.layer_count(parts[0]) for parts in merged.values()}
    uneven = [key for key in megatron_stages.UNEVEN if args.get(key)]
    if max(v for v, _ in merged) > 0 and (len(counts) > 1 or uneven):
        what = f"--{uneven[0].replace('_', '-')}" if uneven else f"chunks of {sorted(counts)} layers"
        raise LegacyFilesError(
            f"{directory}: a virtual pipeline split unevenly ({what}); megazero places the "
            f"chunks of a uniform split only"
        )
    state, states, offset = {}, {}, 0
    for key in sorted(merged):  # rounds first, stages within a round
        parts = merged[key]
        outs = [state] + [states.setdefault(kind, {}) for kind in megatron_optim.STATES[: len(parts) - 1]]
        for part, out in zip(parts, outs):
            for name, tensor in megatron_stages.renumbered(part, offset).items():
                out.setdefault(name, tensor)
        offset += megatron_stages.layer_count(parts[0])
    return record, state, states
