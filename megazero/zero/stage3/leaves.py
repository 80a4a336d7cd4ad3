"""Stage 3's leaf modules: which modules are one unit each, gathered whole when entered and never
traced inside (DeepSpeed's `leaf_module` / `set_z3_leaf_modules`).

Owns the matching of `zero_optimization.leaf_module`'s three selectors against the model's modules:
`classes` (a class's own name, or its module-qualified name), `names` (a name as `named_modules()`
gives it) and `name_suffixes` (the end of such a name); `stage3_granularity: "layer"` is the case
classes ["TransformerLayer"]. A selector the user wrote that matches no module on any rank of the
model-parallel group (a pipeline stage holds only some of the names) is a UsageError naming it, the
same on every rank. Must not touch: units, hooks, gathers (engine.py and coordinator.py use the
modules found here).
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.core import comm, host_read
from megazero.core.errors import UsageError
from ..config import ZeroConfig

LAYER_CLASS = "TransformerLayer"  # stage3_granularity "layer": one unit per transformer layer


def selectors(zero: ZeroConfig) -> list[tuple[str, str, bool]]:
    """(kind, value, checked) of every selector: `checked` for those that must match something (the
    user's own, and the layer class of "layer" granularity; not DeepSpeed's default classes)."""
    config = zero.leaf_module
    own = config.customised()
    out = [("classes", c, "classes" in own) for c in config.classes]
    if zero.stage3_granularity == "layer" and LAYER_CLASS not in config.classes:
        out.append(("classes", LAYER_CLASS, True))
    out += [("names", n, True) for n in config.names]
    out += [("name_suffixes", n, True) for n in config.name_suffixes]
    return out


def _matches(kind: str, value: str, name: str, module: nn.Module) -> bool:
    if kind == "classes":
        cls = type(module)
        return value in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
    if kind == "names":
        return name == value
    return name.endswith(value)


def find_leaf_modules(modules: list[nn.Module], zero: ZeroConfig, group: comm.Group) -> list[nn.Module]:
    """The leaf modules among `modules` and their submodules, in module order. Collective over
    `group` (one tiny all-reduce) when a selector must match, so a selector that matches nothing
    anywhere fails on every rank alike."""
    if zero.stage != 3:
        return []
    found, seen = [], set()
    wanted = selectors(zero)
    counts = torch.zeros(len(wanted), dtype=torch.float64, device=group.device)
    local = [0.0] * len(wanted)  # this rank's counts: what every rank finding the same reads
    for root in modules:
        for name, module in root.named_modules():
            for k, (kind, value, _) in enumerate(wanted):
                if _matches(kind, value, name, module):
                    counts[k] += 1
                    local[k] += 1
                    if id(module) not in seen:
                        seen.add(id(module))
                        found.append(module)
    checked = [k for k, (_, _, must) in enumerate(wanted) if must]
    if checked:
        comm.all_reduce(counts, group)
        agreed = host_read.read(counts, "leaf-module selector matches", healthy=local)
        missing = [f"{wanted[k][0]} {wanted[k][1]!r}" for k in checked if agreed[k] == 0]
        if missing == [f"classes {LAYER_CLASS!r}"] and zero.stage3_granularity == "layer":
            raise UsageError(
                f'stage3_granularity "layer" found no {LAYER_CLASS} among the model\'s '
                f'modules; use "module" granularity for this model'
            )
        if missing:
            raise UsageError(
                f"zero_optimization.leaf_module: {', '.join(missing)} matches no module of "
                f"the model; check the spelling against the model's module classes and "
                f"named_modules() names"
            )
    return found


class OnBackward(torch.autograd.Function):
    """Identity on `tensors`; its backward calls `callback(module)` once the gradients reaching
    them arrive. On a module's outputs that is just before the module's backward (stage 3 gathers
    its units there); on a leaf's inputs, just after it (every gradient of the leaf's own parameters
    from this backward is then computed)."""

    @staticmethod
    def forward(ctx, callback, module, *tensors):
        ctx.callback, ctx.module = callback, module
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback(ctx.module)
        return (None, None, *grads)


def on_leaf_backward(leaves, done) -> None:
    """Calls `done(leaf)` when each leaf's backward is over (a leaf whose inputs need no gradient
    has no such point: its units are reduced at the end of the backward instead)."""
    from torch.utils import _pytree as pytree

    @torch.compiler.disable
    def wrap_inputs(module, args):
        if not torch.is_grad_enabled():
            return None
        leaves_, spec = pytree.tree_flatten(args)
        at = [i for i, a in enumerate(leaves_) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not at:
            return None
        wrapped = OnBackward.apply(done, module, *(leaves_[i] for i in at))
        for i, t in zip(at, wrapped):
            leaves_[i] = t
        return pytree.tree_unflatten(leaves_, spec)

    for leaf in leaves:
        leaf.register_forward_pre_hook(wrap_inputs)
