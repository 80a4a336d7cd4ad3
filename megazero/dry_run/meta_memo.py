"""Meta kernels' results remembered: most of a dry run's time is torch's Python meta kernels
(shape inference through torch._refs and decompositions, e.g. a layer norm's backward), and a
training step repeats the same few hundred calls, layer after layer and microbatch after
microbatch. A call of a functional aten op (no argument written, no result aliasing an input) is
fully described, as far as its results' metadata go, by the op, its tensors' shapes, strides and
dtypes and its other arguments' values; its results are then fresh tensors of known shape, stride
and dtype, which `torch.empty_strided` on meta makes without running the kernel again.

Only calls whose every argument is a plain value (numbers, strings, dtypes, devices, lists of
them) or a meta / CPU tensor are remembered, and only when the kernel's results were exactly
what empty_strided would make (storage offset 0, the storage's size the strides' extent).
"""

from __future__ import annotations

import torch

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _fresh_results(func) -> bool:
    schema = func._schema
    return (
        func.namespace == "aten"
        and not schema.is_mutable
        and schema.returns
        and all(r.alias_info is None for r in schema.returns)
    )


def _part(x):
    if isinstance(x, torch.Tensor):
        if x.device.type not in ("meta", "cpu") or x.is_sparse or x.is_quantized:
            raise TypeError
        return (x.shape, x.stride(), x.dtype, x.device.type, x.storage_offset())
    if isinstance(x, _PLAIN):
        return x
    if isinstance(x, (list, tuple)):
        return tuple(_part(y) for y in x)
    raise TypeError


class MetaMemo:
    def __init__(self):
        self.results: dict = {}
        self._fresh: dict = {}
        self.hits = self.misses = 0

    def key(self, func, args, kwargs):
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = bool(_fresh_results(func))
        if not fresh:
            return None
        try:
            return (func, _part(args), tuple((k, _part(v)) for k, v in kwargs.items()))
        except TypeError:
            return None

    def replay(self, key):
        """The remembered results, made anew; None if this call was not seen (or not rememberable)."""
        made = self.results.get(key)
        if made is None:
            return None
        self.hits += 1
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in made[1]]
        return outs[0] if made[0] else tuple(outs)

    def remember(self, key, out) -> None:
        self.misses += 1
        single = isinstance(out, torch.Tensor)
        outs = (out,) if single else out
        if not isinstance(outs, (tuple, list)):
            return
        made = []
        for t in outs:
            if not isinstance(t, torch.Tensor) or t.device.type != "meta" or t.storage_offset() != 0:
                return
            twin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if twin.untyped_storage().nbytes() != t.untyped_storage().nbytes():
                return
            made.append((tuple(t.shape), tuple(t.stride()), t.dtype))
        self.results[key] = (single, made)
