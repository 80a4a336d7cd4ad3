"""Split backward: a layer's input gradient now (B), its weights' gradients later (W).

A zero-bubble pipeline schedule (Qi et al. 2024, "Zero Bubble Pipeline Parallelism";
parallel/pipeline/zero_bubble.py) runs a microbatch's backward in two halves: B computes what the
previous stage waits for, the gradient of the chunk's input; W computes the weights' gradients,
which nothing downstream waits for, so the schedule may run it later, where a stage would idle.

While `deferring(work)` is active (the schedule holds it around one chunk's forward of one
microbatch and around its B), every layer that owns a weight remembers `work` at forward time:
weight_grad.py's linear, embedding, bias and norms, loss.py's fused output layer, moe.py's experts,
parallel/layers.py's sequence-parallel GEMM. Their backward returns the input gradient only and
hands `work` what W needs:

  work.add(compute)            compute(None) -> [(tensor, gradient), ...], run at W: a GEMM's
                               weight gradient from the tensors its closure holds until then (its
                               input and its output's gradient: the deferred W inputs), or a
                               gradient B already computed (a norm's or a bias's sum over tokens,
                               cheaper to keep than its inputs)
  work.add(compute, prepare)   prepare() starts what compute needs (a gather) and returns what
                               compute gets: W starts the next item's before it computes this one,
                               so the communication runs during the previous GEMM

`work.run()` is W: it computes every item in the order B added them and hands the gradients over
through autograd (`torch.autograd.backward` from the tensors the layers took their weights as), so
each parameter's AccumulateGrad runs, and its post-accumulate hooks fire, at W, once per parameter,
as they would in a plain backward: whoever owns the parameters (the ZeRO engine) sees W's
gradients through the hooks it already has. A weight whose gradient is summed in fp32
(weight_grad.py) gets its deposit at W and autograd zeros, as in the plain backward. B leaves the
weights' gradients undefined: autograd still runs their AccumulateGrad then, and the
post-accumulate hooks fire with `.grad` None (torch 2.13), which an owner must read as "nothing came".

The active work is one module-level slot, as torch's grad mode is one switch: autograd runs a CUDA
backward, and the forward a recomputation replays inside it, on its own thread, where neither a
thread-local nor a context variable set by the schedule would be seen; the schedule's thread waits
for that backward. Nothing here knows of pipelines or processes.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch

Handover = Iterable[tuple[torch.Tensor, torch.Tensor]]


class WeightGradWork:
    """The W half of one model chunk's backward for one microbatch (see the module docstring)."""

    def __init__(self):
        self._items: list[tuple[Callable, Callable | None]] = []
        self.done = False

    def add(self, compute: Callable[[object], Handover], prepare: Callable[[], object] | None = None) -> None:
        if self.done:
            raise RuntimeError("a weight gradient was deferred to a W that has already run")
        self._items.append((compute, prepare))

    def __len__(self) -> int:
        return len(self._items)

    def run(self) -> None:
        """W: computes the deferred weight gradients and hands them to autograd, once per tensor."""
        if self.done:
            raise RuntimeError("this W has already run")
        items, self._items, self.done = self._items, [], True
        tensors: dict[int, list] = {}
        # Without a graph, as autograd's own backward computes: the saved inputs and the weights
        # require grad, so with grad mode on each GEMM would record one and keep what it read
        # (the output layer's recomputed logits, its fp32 copy and exp) until the handover.
        with torch.no_grad():
            ahead = items[0][1]() if items and items[0][1] is not None else None
            for k, (compute, _) in enumerate(items):
                state, ahead = ahead, None
                if k + 1 < len(items) and items[k + 1][1] is not None:
                    ahead = items[k + 1][1]()  # the next item's communication, during this GEMM
                for tensor, grad in compute(state):
                    held = tensors.get(id(tensor))
                    if held is None:
                        tensors[id(tensor)] = [tensor, grad]
                    else:  # a weight used twice in the chunk: one handover
                        held[1] = held[1] + grad
        if tensors:
            torch.autograd.backward([t for t, _ in tensors.values()], [g for _, g in tensors.values()])


_ACTIVE: list[WeightGradWork | None] = [None]  # the module docstring says why a module slot


@contextlib.contextmanager
def deferring(work: WeightGradWork | None):
    """Inside, the layers defer their weight gradients into `work` (None: they do not)."""
    previous, _ACTIVE[0] = _ACTIVE[0], work
    try:
        yield work
    finally:
        _ACTIVE[0] = previous


def deferred_to(*weights: torch.Tensor | None) -> WeightGradWork | None:
    """The work a layer running now defers its weights' gradients to: the active one when grad mode
    is on and one of `weights` wants a gradient, else None (a plain backward)."""
    work = _ACTIVE[0]
    if work is None or not torch.is_grad_enabled():
        return None
    if not any(w is not None and w.requires_grad for w in weights):
        return None
    if _compiling():
        raise RuntimeError(
            "a split backward (zero-bubble pipeline schedules) cannot run inside "
            "torch.compile; drop --compile or choose another --pipeline-schedule"
        )
    return work


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


def wanted(pairs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (tensor, gradient) pairs of `pairs` whose gradient exists."""
    return [(t, g) for t, g in pairs if t is not None and g is not None]
