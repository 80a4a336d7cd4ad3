"""Which columns ZenFlow selects (zenflow.py): a matrix's column L1 norms from the flat piece of it a
rank holds, the top `topk_ratio` of them, and, where tensor parallelism splits a matrix's columns,
this rank's share of the whole matrix's choice.

Owns the arithmetic of the choice; never communicates (zenflow.py gathers the sums).
"""
from __future__ import annotations

import dataclasses

import torch

from megazero.core import host_read


def column_abs_sums(piece: torch.Tensor, offset: int, columns: int) -> torch.Tensor:
    """L1 norm per column (DeepSpeed's importance) of a [rows, columns] matrix over the flat
    elements [offset, offset + len(piece)) that `piece` holds (a partial first and last row allowed)."""
    out = torch.zeros(columns, dtype=torch.float32, device=piece.device)
    absolute = piece.float().abs()
    col0 = offset % columns
    head = min(len(absolute), (columns - col0) % columns)
    if head:
        out[col0:col0 + head] += absolute[:head]
    rows = (len(absolute) - head) // columns
    if rows:
        out += absolute[head:head + rows * columns].view(rows, columns).sum(0)
    tail = absolute[head + rows * columns:]
    out[:len(tail)] += tail
    return out


def top_columns(norms: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices of the `ratio` largest columns (at least one when ratio > 0)."""
    count = 0 if ratio <= 0 else max(1, int(ratio * len(norms)))
    return torch.topk(norms, min(count, len(norms)), sorted=False).indices


def chosen_in_split(split, per_rank: torch.Tensor, ratio: float) -> torch.Tensor:
    """This rank's chosen columns of a matrix whose columns tensor parallelism splits, chosen by
    the whole matrix's column norms: `per_rank` [ranks, local columns] holds each rank's sums,
    pieces of the matrix's row of sums in the order the shard (the parameter's `tp_shard`) says."""
    along = dataclasses.replace(split, dim=0)        # the same split, of a row of column sums
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
