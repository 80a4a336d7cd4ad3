"""The comm layer's accounting: `CommLog` counts per step the bytes each collective moves per rank,
by op, group and intra/inter-node, and with `trace` keeps every op in issue order (`CommEntry`),
which the dry run compares across the members of each group. megazero.core.comm's ops record into
it; this module issues nothing and knows no process group.

Byte convention (per rank, as DeepSpeed's comms logger and the ring algorithms): reduce-scatter,
all-gather and all-to-all move (n-1)/n of the full buffer; all-reduce moves 2(n-1)/n; point-to-point
moves the tensor's bytes; broadcast counts (n-1)/n of the tensor.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

from megazero.core import source_paths


class CommLog:
    """Bytes moved per rank, keyed by (op, group name, 'intra'|'inter'), for the current step and in total.

    With `trace=True` it also keeps every op in issue order (`entries`, `CommEntry`): what ranks must
    agree on (op, dtype, element count, reduce op, root; a p2p's peer and shape) and where the code
    issued it, which the dry run (megazero.dry_run) compares across the members of each group."""

    def __init__(self, trace: bool = False):
        self.entries: list[CommEntry] | None = [] if trace else None
        self.step_ends: list[int] = []  # len(entries) at each end_step
        self.step_bytes: dict[tuple[str, str, str], float] = defaultdict(float)
        self.step_calls: dict[tuple[str, str, str], int] = defaultdict(int)
        self.total_bytes: dict[tuple[str, str, str], float] = defaultdict(float)
        # host seconds blocked in collectives (a synchronous op's call, an async op's wait), in total:
        # where a rank waits for slower peers (megazero.training.stragglers)
        self.wait_s = 0.0
        self.last_step: dict[tuple[str, str, str], float] = {}
        self.issued = 0  # collectives issued so far (groups of one excluded)
        # (op, group name, its ranks, count) of the last one: what a heartbeat reports (another
        # thread reads it, so it is replaced whole, never changed in place)
        self.last_issued: tuple[str, str, tuple[int, ...], int] | None = None

    def record(
        self,
        op: str,
        group,
        nbytes: float,
        tensor: torch.Tensor | None = None,
        reduce_op=None,
        root: int | None = None,
        peer: int | None = None,
    ) -> None:
        """One op on `group` (a megazero.core.comm.Group) that moved `nbytes` per rank."""
        key = (op, group.name, "intra" if group.intra_node else "inter")
        if self.entries is not None:
            self.entries.append(
                CommEntry(
                    op,
                    group.name,
                    tuple(group.ranks),
                    str(tensor.dtype).removeprefix("torch."),
                    tensor.numel(),
                    tuple(tensor.shape),
                    _reduce_name(reduce_op),
                    root,
                    peer,
                    _call_site(),
                )
            )
        self.issued += 1
        self.last_issued = (op, group.name, tuple(group.ranks), self.issued)
        self.step_bytes[key] += nbytes
        self.step_calls[key] += 1
        self.total_bytes[key] += nbytes

    def end_step(self) -> dict[tuple[str, str, str], float]:
        """Closes the step: returns its byte counts and starts a new one."""
        self.last_step = dict(self.step_bytes)
        if self.entries is not None:
            self.step_ends.append(len(self.entries))
        self.step_bytes.clear()
        self.step_calls.clear()
        return self.last_step

    def summary(self, counts: dict | None = None) -> str:
        counts = self.last_step if counts is None else counts
        parts = [f"{op}[{g},{loc}]={b / 2**20:.2f}MiB" for (op, g, loc), b in sorted(counts.items())]
        return "comm/rank: " + (" ".join(parts) if parts else "none")


@dataclasses.dataclass(frozen=True)
class CommEntry:
    """One traced op as this rank issued it. `root`: a broadcast's source, `peer`: a send's or
    receive's other end (global ranks); `site`: file:line of the first caller outside this module."""

    op: str
    group: str
    ranks: tuple[int, ...]
    dtype: str
    numel: int
    shape: tuple[int, ...]
    reduce_op: str | None = None
    root: int | None = None
    peer: int | None = None
    site: str = ""

    def signature(self) -> tuple:
        """What every member of the group must issue alike (p2p: what the peer's side must mirror)."""
        if self.op in ("send", "recv"):
            return (self.op, self.dtype, self.shape)
        if self.op == "all_to_allv":  # each rank's row counts are its own: the row's width is shared
            return (self.op, self.dtype, self.shape[1:])
        return (self.op, self.dtype, self.numel, self.reduce_op, self.root)


def _reduce_name(op) -> str | None:
    if op is None:
        return None
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if op == getattr(dist.ReduceOp, name, None):
            return name.lower()
    return str(op)


# modules whose frames a call site skips
_WRAPPERS = ("megazero.core.comm", __name__, "megazero.zero.quantized_comm")


def _call_site() -> str:
    """file:line of the code that asked for the op (the first frame outside the comm wrappers)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in _WRAPPERS:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{source_paths.shown(frame.f_code.co_filename)}:{frame.f_lineno}"
