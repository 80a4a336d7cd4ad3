"""Values the host reads back from the device: the one way megazero turns a device tensor into Python
numbers (the loss, the gradient norm, the overflow check, the tables ranks agree through).

Each read is a host sync (the host waits for the device's queue), so they are few and named: every
call says what it reads (`what`) and what a healthy run reads there (`healthy`: every rank agreeing,
nothing overflowing). A tensor on the `meta` device (the dry run's stand-in for a GPU, see
megazero.dry_run) holds no values; for it `read` answers `healthy`, or the value the dry run forces
for that `what` (an overflowing gradient norm walks the skip path).

`recording()` collects every read with its call site while it is open: the dry run counts a step's
host syncs with it, and a test holds the steady-state step to the list in docs/dry_run.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch

from megazero.core import source_paths, streams


@dataclasses.dataclass(frozen=True)
class HostRead:
    what: str
    site: str  # file:line of the caller
    numel: int


class _Reads:
    """The open recording (None: nothing records) and the values forced on meta tensors."""

    recording: list[HostRead] | None = None
    forced: dict[str, object] = {}


def _zeros(shape, zero):
    if not shape:
        return zero
    return [_zeros(shape[1:], zero) for _ in range(shape[0])]


def read(tensor: torch.Tensor, what: str, healthy=None):
    """`tensor.tolist()` (a Python number for a 0-dim tensor). On a meta tensor: the forced value
    for `what` if the dry run set one, else `healthy` (a value, or a callable giving it; None:
    zeros of the tensor's shape)."""
    _note(tensor, what)
    if tensor.device.type != "meta":
        return tensor.tolist()
    value = _Reads.forced.get(what, healthy)
    value = value() if callable(value) else value
    zero = False if tensor.dtype == torch.bool else 0.0 if tensor.is_floating_point() else 0
    return _zeros(tuple(tensor.shape), zero) if value is None else value


def copy_into(host: torch.Tensor, tensor: torch.Tensor, what: str, healthy=None) -> torch.Tensor:
    """`host.copy_(tensor)`: a device tensor copied into the host tensor `host`, whose values the
    host then acts on (a selection it indexes with; a host sync, like `read`). On a meta tensor
    `host` gets the forced value for `what`, else `healthy` (a tensor, or a callable giving one;
    None: zeros). Returns `host`."""
    _note(tensor, what)
    if tensor.device.type != "meta":
        return host.copy_(tensor)
    value = _Reads.forced.get(what, healthy)
    value = value() if callable(value) else value
    return host.zero_() if value is None else host.copy_(value)


def _note(tensor: torch.Tensor, what: str) -> None:
    """Records the read at the caller of read / copy_into; under the dry run's stream check the
    host waits there for the current stream, as a GPU's copy to the host makes it."""
    if _Reads.recording is not None:
        frame = sys._getframe(2)
        site = f"{source_paths.shown(frame.f_code.co_filename)}:{frame.f_lineno}"
        _Reads.recording.append(HostRead(what, site, tensor.numel()))
    if tensor.device.type == "meta":
        checker = streams.checker_for(tensor.device)
        if checker is not None:
            checker.op([tensor], [], [], host_sync=True)


@contextlib.contextmanager
def recording():
    """Collects every `read` while open (into the list it yields)."""
    saved, _Reads.recording = _Reads.recording, []
    try:
        yield _Reads.recording
    finally:
        _Reads.recording = saved


@contextlib.contextmanager
def forcing(values: dict[str, object]):
    """Meta tensors read as `values[what]` (e.g. {"gradient norm": float("inf")}) while open."""
    saved, _Reads.forced = _Reads.forced, {**_Reads.forced, **values}
    try:
        yield
    finally:
        _Reads.forced = saved
