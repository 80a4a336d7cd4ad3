"""What every rank of a save agrees on: whether the target filesystem has room for the whole checkpoint
(checked before anything is written) and which rank, if any, failed to write its part, so that every
rank raises the same one line (`SaveError`) and nothing saved before changes.

Each rank contributes one row of facts (bytes it will write, bytes free where it writes, the errno of
a failed write) to a (world, 3) table summed over the data-parallel group and then over the tensor x
pipeline group: between them they reach every rank exactly once, so every rank holds the same table
and decides the same way without another round. The table lives on the groups' device, as every
tensor that meets a collective does.

Room: the shards of all ranks land on one filesystem (the checkpoint directory is shared, rank 0
commits it), so the whole checkpoint plus a margin (MARGIN_FRACTION of it and MARGIN_BYTES, for the
metadata rank 0 merges and the filesystem's own blocks) must fit in the free space every rank sees.
"""

from __future__ import annotations

import dataclasses
import errno as errno_codes
import os
import shutil
from pathlib import Path

import torch

from megazero.core import comm, host_read
from megazero.core.errors import AgreedStop
from .files import latest_iteration_name

MARGIN_FRACTION = 0.01
MARGIN_BYTES = 1 << 20


class SaveError(AgreedStop):
    """A checkpoint that could not be written (no room, a failed write, rename or fsync). The message is
    one line, the same on every rank; the temporary directory is gone and `latest` is untouched."""

    def __init__(self, message: str):
        super().__init__(message, code=1)


@dataclasses.dataclass
class RankReport:
    """One rank's row of the table."""

    bytes_needed: int = 0
    bytes_free: int = 0
    errno: int = 0


def agree(report: RankReport, groups) -> list[RankReport]:
    """Every rank's report, on every rank (collective over the whole layout)."""
    world = groups.topology.world_size
    table = torch.zeros(world, 3, dtype=torch.float64, device=groups.dp.device)
    table[groups.rank] = torch.tensor([report.bytes_needed, report.bytes_free, report.errno], dtype=torch.float64)
    comm.all_reduce(table, groups.dp)
    comm.all_reduce(table, groups.mp)
    return [
        RankReport(int(need), int(free), int(code))
        for need, free, code in host_read.read(
            table, "save room table", healthy=lambda: [[report.bytes_needed, report.bytes_free, report.errno]] * world
        )
    ]


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `folder` (or of its nearest
    existing parent, before the first save creates it)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def what_is_kept(save_dir: Path) -> str:
    """The end of a failed save's line: which checkpoint `latest` still names."""
    name = latest_iteration_name(save_dir)
    return (
        "no checkpoint was saved before"
        if name is None
        else (f"latest still names {name if name.isprintable() else repr(name)}")
    )


def check_room(reports: list[RankReport], save_dir: Path, iteration: int) -> None:
    """Raises SaveError (on every rank alike) when the checkpoint and its margin exceed the free space."""
    total = sum(r.bytes_needed for r in reports)
    needed = total + int(MARGIN_FRACTION * total) + MARGIN_BYTES
    free = min(r.bytes_free for r in reports)
    if free < needed:
        raise SaveError(
            f"--save {save_dir}: no room for the checkpoint of iteration {iteration}: it needs "
            f"{mib(needed)} (the shards of {len(reports)} rank(s) and their metadata, plus a "
            f"margin of {MARGIN_FRACTION:.0%} and {mib(MARGIN_BYTES)}) and {mib(free)} are free "
            f"there; nothing was written and {what_is_kept(save_dir)}"
        )


def check_written(reports: list[RankReport], save_dir: Path, iteration: int, what: str) -> None:
    """Raises SaveError (on every rank alike) naming the first rank whose `what` failed, and why."""
    failed = [(rank, r.errno) for rank, r in enumerate(reports) if r.errno]
    if failed:
        rank, code = failed[0]
        reason = os.strerror(code) if code > 0 else "an error without an errno"
        others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        raise SaveError(
            f"--save {save_dir}: rank {rank}{others} could not {what} of iteration {iteration} "
            f"({reason}); the partial checkpoint was removed and {what_is_kept(save_dir)}"
        )


def errno_of(err: OSError) -> int:
    """The errno to report for `err` (EIO when the error carries none)."""
    return err.errno or errno_codes.EIO
