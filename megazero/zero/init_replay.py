"""Deferred initialisation for zero.Init: parameters built on the meta device, their initialisation
recorded and replayed one parameter at a time, with the random numbers the eager build would draw.

While recording, a parameter registered on a module is swapped for a meta one (its real tensor,
usually an untouched `torch.empty`, kept only until something overwrites it), and every op touching
a meta tensor is logged (`torch.utils._python_dispatch.TorchDispatchMode`). Everything else of the
construction (buffers, rotary tables, Python state) runs for real, as it would outside. A random op
on a meta tensor saves the CPU generator's state and advances the generator exactly as the eager op
would (by running it on a scratch tensor of the same size, strides and dtype, in one buffer reused
by every such op: fresh buffers, freed at once, left the allocator holding most of a model), so the
draws of the ops that do run eagerly, and of later modules, stay where they would be. The few
torch.nn.init functions that skip a meta tensor without dispatching anything (SKIPS_META) are
recorded as one call each, the same way.

`replay(log, keep)` then runs the log on real CPU tensors. A parameter's storage is materialised at
its last complete overwrite (its last `normal_`, `uniform_`, `fill_`, `zero_`, `copy_` of the whole
tensor; an earlier value that nothing else reads is dead) and, after the last op that touches it,
handed to `keep(param_meta_tensor, value)` and dropped: at any time only the parameters whose final
initialisation is under way exist in full (for a Hugging Face model: one module's, inside its
`_init_weights`). A random op replays from its saved generator state, so values equal the eager
build's, seed for seed.

Owns the log and the replay; where the values go (shards) is init.py's.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.core.errors import UsageError

# torch.nn.init functions that return at once on a meta tensor ("sampling is a no-op") instead of
# dispatching ops: recorded as one call each, replayed whole. Each overwrites its tensor completely.
# trunc_normal_ is reached through its helper (what torch's public function calls at call time, so
# a copy imported early is caught too); the others by their public names, in torch.nn.init and in
# transformers' table of them when it is loaded.
SKIPS_META = ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_")

# Ops that turn a tensor's value into a Python number (a meta tensor has none: refused).
READS_VALUE = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}

# In-place ops that write every element of their first argument without reading it.
OVERWRITES = {
    "uniform_",
    "normal_",
    "fill_",
    "zero_",
    "random_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "copy_",
}


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclasses.dataclass
class Op:
    func: object
    args: tuple
    kwargs: dict
    out: object
    rng: torch.Tensor | None = None  # the generator's state before a random op
    dead: bool = False
    overwrites: bool = False  # a whole-tensor initialiser call (SKIPS_META)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _written(op: Op) -> list[torch.Tensor]:
    """The tensor arguments the op writes (its schema's mutable arguments)."""
    schema = getattr(op.func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = op.args[i] if i < len(op.args) else op.kwargs.get(arg.name)
            out += _tensors(value)
    return out


def _random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _covers(t: torch.Tensor) -> bool:
    """Whether `t` views every byte of its storage."""
    return (
        t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


class Recorder(TorchDispatchMode):
    """Logs every op that touches a meta tensor; see the module docstring."""

    def __init__(self):
        super().__init__()
        self.log: list[Op] = []
        self.pending_value: dict[int, int] = {}  # storage key -> log index of its initial value
        self._scratch = torch.UntypedStorage(0)

    def scratch_like(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor with `t`'s size, strides, offset and dtype over the reused scratch buffer
        (grown to the largest storage asked for)."""
        nbytes = t.untyped_storage().nbytes()
        if self._scratch.nbytes() < nbytes:
            self._scratch = torch.UntypedStorage(0)  # the old one goes before the new one comes
            self._scratch = torch.UntypedStorage(nbytes)
        return torch.empty(0, dtype=t.dtype).set_(self._scratch, t.storage_offset(), t.size(), t.stride())

    def initial_value(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        """Records that `meta`'s storage starts as `value` (a parameter's real tensor, swapped out)."""
        op = Op(torch.ops.aten.copy_.default, (meta, value), {}, meta)
        self.pending_value[storage_key(meta)] = len(self.log)
        self.log.append(op)

    def __enter__(self):
        self._patched = []
        tables = [vars(torch.nn.init)]
        if "transformers.initialization" in sys.modules:
            tables.append(sys.modules["transformers.initialization"].TORCH_INIT_FUNCTIONS)
        for name in SKIPS_META:
            real = getattr(torch.nn.init, name)
            for table in tables:
                for key, value in list(table.items()):
                    if value is real:
                        self._patched.append((table, key, real))
                        table[key] = self._recording_call(real)
        return super().__enter__()

    def __exit__(self, *exc):
        for table, key, real in reversed(self._patched):
            table[key] = real
        self._scratch = torch.UntypedStorage(0)
        return super().__exit__(*exc)

    def _recording_call(self, real):
        """`real` (an initialiser in SKIPS_META) logged as one op when its tensor is meta: run once on
        a scratch tensor now for its random draws, and for real on the value at the replay."""

        def call(tensor, *args, **kwargs):
            if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
                return real(tensor, *args, **kwargs)
            rng = torch.get_rng_state()
            real(self.scratch_like(tensor), *args, **kwargs)
            op = Op(lambda t: real(t, *args, **kwargs), (tensor,), {}, tensor, rng=rng, overwrites=True)
            self._drop_overwritten(op)
            self.log.append(op)
            return tensor

        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if func in READS_VALUE and any(t.is_meta for t in inputs):
            raise UsageError(
                "zero.Init: the model's construction reads a value of a parameter (.item(), or a "
                "Python condition on it), which has no value yet under zero.Init; build the model "
                "outside zero.Init, or compute that value from the config"
            )
        out = func(*args, **kwargs)
        if not any(t.is_meta for t in inputs + _tensors(out)):
            return out
        op = Op(func, args, kwargs, out)
        if _random(func):
            op.rng = torch.get_rng_state()
            metas = [t for t in inputs if t.is_meta]
            scratch = {
                id(t): self.scratch_like(t) if i == 0 else torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
                for i, t in enumerate(metas)
            }
            swap = lambda t: scratch.get(id(t), t) if isinstance(t, torch.Tensor) else t  # noqa: E731
            func(
                *pytree.tree_map(swap, args),
                **{k: (torch.device("cpu") if k == "device" else swap(v)) for k, v in kwargs.items()},
            )
        for key in _escapes(op):
            self.pending_value.pop(key, None)  # read into something else: its value must stay
        self._drop_overwritten(op)
        self.log.append(op)
        return out

    def _drop_overwritten(self, op: Op) -> None:
        """A complete overwrite kills a parameter's initial value: let its real tensor go now."""
        target = _full_overwrite(op)
        if target is not None:
            index = self.pending_value.pop(storage_key(target), None)
            if index is not None:
                self.log[index] = dataclasses.replace(self.log[index], args=(target, None), dead=True)


def _full_overwrite(op: Op) -> torch.Tensor | None:
    """The meta tensor the op overwrites whole without reading it, if it does."""
    name = getattr(op.func, "__name__", "").split(".")[0]
    target = op.args[0] if op.args else None
    overwrites = op.overwrites or name in OVERWRITES
    if overwrites and isinstance(target, torch.Tensor) and target.is_meta and _covers(target):
        sources = [t for t in _tensors((op.args[1:], op.kwargs)) if t.is_meta]
        if all(storage_key(t) != storage_key(target) for t in sources):
            return target
    return None


def _effects(op: Op) -> tuple[set[int], set[int]]:
    """(meta storages the op reads, meta storages it writes or creates)."""
    inputs = {storage_key(t) for t in _tensors((op.args, op.kwargs)) if t.is_meta}
    outputs = {storage_key(t) for t in _tensors(op.out) if t.is_meta}
    written = _tensors(op.args[0]) if op.overwrites else _written(op)
    return inputs, {storage_key(t) for t in written if t.is_meta} | (outputs - inputs)


def _escapes(op: Op) -> set[int]:
    """Meta storages whose values the op carries into another storage."""
    inputs, effects = _effects(op)
    return {key for key in inputs if effects - {key}}


def _plan(log: list[Op], params: set[int]) -> tuple[dict[int, int], dict[int, int]]:
    """(start, last): for a parameter storage the op index its value starts at (its last complete
    overwrite before anything carried its value elsewhere), and for every storage the last op
    touching it."""
    last: dict[int, int] = {}
    start: dict[int, int] = {}
    escaped: set[int] = set()
    for i, op in enumerate(log):
        if op.dead:
            continue
        inputs, effects = _effects(op)
        for key in inputs | {storage_key(t) for t in _tensors(op.out) if t.is_meta}:
            last[key] = i
        for key in effects - inputs:
            if key in params:
                start.setdefault(key, i)
        target = _full_overwrite(op)
        if target is not None and storage_key(target) in params and storage_key(target) not in escaped:
            start[storage_key(target)] = i
        escaped |= _escapes(op) & params
    return start, last


def replay(log: list[Op], params: list[torch.Tensor], keep) -> None:
    """Runs `log` for real (see the module docstring); `keep(meta_param, value)` for each parameter
    in `params` (meta tensors) once its value is final. The generator's state is left as it was."""
    by_key = {storage_key(p): p for p in params}
    start, last = _plan(log, set(by_key))
    real: dict[int, torch.UntypedStorage] = {}
    saved = torch.get_rng_state()

    def realize(t):
        if not (isinstance(t, torch.Tensor) and t.is_meta):
            return t
        key = storage_key(t)
        if key not in real:
            real[key] = torch.UntypedStorage(t.untyped_storage().nbytes())
        return torch.empty(0, dtype=t.dtype).set_(real[key], t.storage_offset(), t.size(), t.stride())

    try:
        with torch.no_grad():
            for i, op in enumerate(log):
                if op.dead or _is_dead(op, i, start):
                    continue
                if op.rng is not None:
                    torch.set_rng_state(op.rng)
                kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in op.kwargs.items()}
                out = op.func(*pytree.tree_map(realize, op.args), **pytree.tree_map(realize, kwargs))
                for meta, value in zip(_tensors(op.out), _tensors(out)):
                    if meta.is_meta and storage_key(meta) not in real:
                        real[storage_key(meta)] = value.untyped_storage()
                for key in [k for k in real if last.get(k) == i]:
                    if key in by_key:
                        keep(by_key[key], realize(by_key[key]))
                    del real[key]
            for key, p in by_key.items():  # never touched after being created
                if key in real or key not in last:
                    keep(p, realize(p))
                    real.pop(key, None)
    finally:
        torch.set_rng_state(saved)


def _is_dead(op: Op, i: int, start: dict[int, int]) -> bool:
    """Whether every storage the op writes or creates is a parameter whose value starts later (its
    random draws, if any, were taken while recording)."""
    touched = _effects(op)[1] | {storage_key(t) for t in _tensors(op.out) if t.is_meta}
    return bool(touched) and all(key in start and i < start[key] for key in touched)
