"""What an aten op reads and writes, from its schema, for the CPU stream sanitizer
(megazero.core.stream_check): a `TorchDispatchMode` hands every op to the checker with the tensors
it reads (its inputs), writes (the arguments its schema marks mutated) and creates (its fresh
outputs; views touch no data). Collectives (the c10d namespace) pass through: megazero.core.comm
declares them to the checker itself.

Owns the schema reading only; the model of streams, the accesses' order and the violations are
stream_check's. Must not touch the tensors it sees (only their metadata is read).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR = torch.ops.aten._local_scalar_dense.default  # .item(): the host waits for the stream
_NO_DATA = {
    torch.ops.aten.resize_.default,
    torch.ops.aten.set_.source_Storage,
    torch.ops.aten.set_.source_Storage_storage_offset,
    torch.ops.aten.set_.source_Tensor,
    torch.ops.aten.set_.default,
}


class _Plan:
    """What an op's schema says of its arguments, worked out once per op: which positions and
    keywords it reads, which it writes, which returns are fresh memory (not views, not in place)."""

    __slots__ = ("passthrough", "reads", "writes", "read_names", "write_names", "fresh")

    def __init__(self, func):
        schema = func._schema
        self.passthrough = func.namespace == "c10d" or torch.Tag.inplace_view in func.tags or func in _NO_DATA
        kinds = [
            "read" if a.alias_info is None else "write" if a.alias_info.is_write else None for a in schema.arguments
        ]
        self.reads = tuple(i for i, k in enumerate(kinds) if k == "read")
        self.writes = tuple(i for i, k in enumerate(kinds) if k == "write")
        self.read_names = {a.name: i for i, a in enumerate(schema.arguments) if kinds[i] == "read"}
        self.write_names = {a.name: i for i, a in enumerate(schema.arguments) if kinds[i] == "write"}
        self.fresh = tuple(i for i, r in enumerate(schema.returns) if r.alias_info is None)

    def split(self, args, kwargs):
        """(tensors read, tensors written) by a call with `args` and `kwargs`."""
        reads = [t for i in self.reads if i < len(args) for t in _tensors(args[i])]
        writes = [t for i in self.writes if i < len(args) for t in _tensors(args[i])]
        for name, value in kwargs.items():
            index = self.read_names.get(name)
            if index is not None and index >= len(args):
                reads.extend(_tensors(value))
            index = self.write_names.get(name)
            if index is not None and index >= len(args):
                writes.extend(_tensors(value))
        return reads, writes


_PLANS: dict = {}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or isinstance(value, (int, float, bool, str, torch.dtype, torch.device)):
        return []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in ((v,) if isinstance(v, torch.Tensor) else _tensors(v))]
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class AccessMode(TorchDispatchMode):
    """Every aten op, handed to `checker.op` with the tensors it reads and writes and the fresh
    ones it returns (megazero.core.stream_check attributes them to the current modelled stream)."""

    def __init__(self, checker):
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plan = _PLANS.get(func)
        if plan is None:
            plan = _PLANS[func] = _Plan(func)
        if plan.passthrough:
            return func(*args, **kwargs)  # collectives are declared by megazero.core.comm
        reads, writes = plan.split(args, kwargs)
        out = func(*args, **kwargs)
        results = out if isinstance(out, tuple) else (out,)
        fresh = [t for i in plan.fresh if i < len(results) for t in _tensors(results[i])]
        self.accessed(func, args, kwargs, out, reads, writes, fresh)
        return out

    def accessed(self, func, args, kwargs, out, reads, writes, fresh) -> None:
        """An op ran (`out` its result): the hook a subclass extends (the dry run's trace)."""
        self.checker.op(reads, writes, fresh, host_sync=func is _SCALAR)


def span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor (or view) can touch: [lo, hi)."""
    size = t.element_size()
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    lo = t.storage_offset() * size
    return lo, lo + (extent + 1) * size
