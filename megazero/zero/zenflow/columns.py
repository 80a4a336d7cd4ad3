"""Which columns ZenFlow selects (optimizer.py): where tensor parallelism splits each matrix, a
matrix's column L1 norms from the flat piece of it a rank holds, the top `topk_ratio` of them, and,
where tensor parallelism splits a matrix's columns, this rank's share of the whole matrix's choice;
the partition's mask from them (and the dry run's stand-in for it).

Owns the arithmetic of the choice; never communicates (optimizer.py gathers the sums).
"""

from __future__ import annotations

import dataclasses

import torch

from megazero.core import host_read
from megazero.models.param_info import param_info


def matrix_splits(storage, tensor, counted) -> tuple[list, list[bool], torch.Tensor]:
    """Per parameter of `storage`: the shard tensor parallelism (`tensor`, its group; None without)
    cuts its matrix into (None: whole, or a vector), and whether along its columns; and which
    matrices "auto" counts (bool, on the storage's device): each once, one pipeline stage's copy of
    a tied one (`counted`), one tensor-parallel rank's of a split or replicated one."""
    tp_split = [
        param_info(p).tp_shard if tensor is not None and len(storage.full_shape(i)) >= 2 else None
        for i, p in enumerate(storage.params)
    ]
    columns_split = [
        s is not None and s.dim % len(storage.full_shape(i)) == len(storage.full_shape(i)) - 1
        for i, s in enumerate(tp_split)
    ]
    first = tensor is None or tensor.rank == 0
    matrices = torch.tensor(
        [
            len(storage.full_shape(i)) >= 2 and counted(p) and (first or not split)
            for i, (p, split) in enumerate(zip(storage.params, tp_split))
        ],
        device=storage.device,
    )
    return tp_split, columns_split, matrices


def column_abs_sums(piece: torch.Tensor, offset: int, columns: int) -> torch.Tensor:
    """L1 norm per column (DeepSpeed's importance) of a [rows, columns] matrix over the flat
    elements [offset, offset + len(piece)) that `piece` holds (a partial first and last row allowed)."""
    out = torch.zeros(columns, dtype=torch.float32, device=piece.device)
    absolute = piece.float().abs()
    col0 = offset % columns
    head = min(len(absolute), (columns - col0) % columns)
    if head:
        out[col0 : col0 + head] += absolute[:head]
    rows = (len(absolute) - head) // columns
    if rows:
        out += absolute[head : head + rows * columns].view(rows, columns).sum(0)
    tail = absolute[head + rows * columns :]
    out[: len(tail)] += tail
    return out


def top_columns(norms: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices of the `ratio` largest columns (at least one when ratio > 0)."""
    count = 0 if ratio <= 0 else max(1, int(ratio * len(norms)))
    return torch.topk(norms, min(count, len(norms)), sorted=False).indices


def chosen_in_split(split, per_rank: torch.Tensor, ratio: float) -> torch.Tensor:
    """This rank's chosen columns of a matrix whose columns tensor parallelism splits, chosen by
    the whole matrix's column norms: `per_rank` [ranks, local columns] holds each rank's sums,
    pieces of the matrix's row of sums in the order the shard (the parameter's `tp_shard`) says."""
    along = dataclasses.replace(split, dim=0)  # the same split, of a row of column sums
    whole = along.full_from_locals(list(per_rank))
    picked = torch.zeros(len(whole), dtype=torch.bool, device=whole.device)
    chosen = top_columns(whole, ratio)
    picked[chosen] = True
    local = along.local_from_full(picked)
    # This rank's share is data-dependent: its indices are read on the host (nonzero would sync as
    # well). Healthy (the dry run's meta tensors): the matrix's count spread evenly, first columns.
    share = len(chosen) * len(local) // max(len(whole), 1)
    mine = host_read.read(local, "zenflow columns chosen", healthy=lambda: [i < share for i in range(len(local))])
    return torch.tensor([i for i, hit in enumerate(mine) if hit], dtype=torch.long, device=local.device)


def selection_mask(
    pieces,
    flat: torch.Tensor,
    per_rank: torch.Tensor | None,
    tp_split,
    columns_split,
    ratio: float,
    partition_size: int,
) -> torch.Tensor:
    """The partition's selected elements (bool) from the column sums: `pieces` (this rank's piece of
    each parameter, or None, and its columns), `flat` the sums of every parameter's columns summed
    over the shard group, `per_rank` every tensor-parallel rank's `flat` where a split matrix needs
    them; `tp_split` each parameter's shard (None: whole), `columns_split` whether its columns are."""
    mask = torch.zeros(partition_size, dtype=torch.bool, device=flat.device)
    at = 0
    for (piece, columns), split, by_columns in zip(pieces, tp_split, columns_split):
        if split is None:
            chosen = top_columns(flat[at : at + columns], ratio)
        elif not by_columns:  # rows split: each rank's sums are partial (L1 adds up)
            chosen = top_columns(per_rank[:, at : at + columns].sum(0), ratio)
        else:
            chosen = chosen_in_split(split, per_rank[:, at : at + columns], ratio)
        at += columns
        if piece is None or len(chosen) == 0:
            continue
        cols = torch.arange(piece.param_offset, piece.param_offset + piece.length, device=flat.device) % columns
        start = piece.partition_offset
        mask[start : start + piece.length] = torch.isin(cols, chosen)
    return mask


def first_columns(pieces, ratio: float, like: torch.Tensor) -> torch.Tensor:
    """A selection of the size `selection_mask` makes (top_columns' count of every matrix's columns; a
    vector whole), of each matrix's first columns, shaped and typed as `like` (the host mask): what
    the dry run's meta tensors select."""
    mask = torch.zeros_like(like)
    for piece, columns in pieces:
        if piece is None:
            continue
        count = 0 if ratio <= 0 else max(1, int(ratio * columns))
        cols = torch.arange(piece.param_offset, piece.param_offset + piece.length) % columns
        mask[piece.partition_offset : piece.partition_offset + piece.length] = (cols < count).float()
    return mask
