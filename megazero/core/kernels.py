"""The operations another implementation may stand in for: megazero's declared seams.

A GPU run and the dry run's meta device (megazero.dry_run) take different kernels for the same
step: torch's fused Adam or the C++ one, NCCL's tensor collectives or gloo's flat copies. The dry
run must make each choice as the simulated device would, and the CPU stream sanitizer must see every
storage the ZeRO stages resize. Rather than patching private names at run time (a rename would then
break the simulator silently), every such operation is a `Kernel` declared here or where it lives;
callers call it like the function it wraps, and `swapped` puts another implementation in force for
the duration of a `with` block. `declared()` lists them all (a test holds the list to the seams the
dry run and the sanitizer use). Model code (megazero.models) imports nothing of megazero's: its
kernels (attention, RMSNorm, the fp32 weight-gradient GEMM) are torch functions, which the dry run
takes over through torch's own TorchFunctionMode instead.

Must not: import anything of megazero's (every room imports this one).
"""

from __future__ import annotations

import contextlib
from typing import Callable


class Kernel:
    """A named operation: calling it calls the implementation in force (its default unless swapped)."""

    def __init__(self, name: str, default: Callable):
        self.name, self.default, self.impl = name, default, default
        self.__doc__ = default.__doc__
        self.__wrapped__ = default

    def __call__(self, *args, **kwargs):
        return self.impl(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


_DECLARED: dict[str, Kernel] = {}


def declare(name: str, default: Callable) -> Kernel:
    """The seam `name` with `default` as its implementation (one declaration per name)."""
    if name in _DECLARED:
        raise ValueError(f"kernel {name!r} is declared twice")
    _DECLARED[name] = kernel = Kernel(name, default)
    return kernel


def kernel(name: str):
    """Decorator form of `declare`: the decorated function becomes the seam's default."""
    return lambda fn: declare(name, fn)


def declared() -> dict[str, Kernel]:
    """Every seam declared so far (by the modules imported), by name."""
    return dict(_DECLARED)


@contextlib.contextmanager
def swapped(*replacements: tuple[Kernel, Callable[[Callable], Callable]]):
    """`with swapped((kernel, make), ...):` each kernel runs `make(impl)` while the block runs,
    `impl` being the implementation in force before (so a replacement can fall back to it); on
    leaving, every kernel gets its previous implementation back, in reverse order."""
    previous = []
    try:
        for k, make in replacements:
            if not isinstance(k, Kernel):
                raise TypeError(f"{k!r} is no declared kernel (megazero.core.kernels.declare)")
            previous.append((k, k.impl))
            k.impl = make(k.impl)
        yield
    finally:
        for k, impl in reversed(previous):
            k.impl = impl


def _resize(storage, nbytes: int):
    return storage.resize_(nbytes)


# ZeRO-3 frees a gathered unit by resizing its storage to 0 bytes and gathers into it again by
# resizing it back (zero/tensor_memory.py, zero/stage3/units.py, zero/offload.py): no tensor op shows
# it, so the sanitizer and the dry run's allocator watch it here.
resize_storage = declare("storage resize", _resize)
