"""The ZeRO engine's split backward (zero-bubble pipeline schedules; models/split_backward.py).

A microbatch's backward runs as B, `backward_input(loss, ticket)`: input gradients only, the layers
defer every weight's gradient, so none arrives and nothing is reduced (one that does arrive raises:
its layer does not defer, and its reduction would go out before W); and later W,
`backward_weight(run, ticket, last_microbatch=...)`: the weights' gradients arrive, through the same
hooks, and are taken and reduced as `ZeroEngine.backward` does (stage 2/3 reduce at W, not at B).
Stage 3 holds every unit B gathered until its W has run (the gather coordinator's per-ticket hold):
W hands the gradients to the full parameters, and the output layer's W reads its weight. `ticket`
names the chunk and microbatch; Ws may run in any order after their Bs, one at a time. Owns nothing
but these passes: the engine (engine.py) keeps the storages, hooks and reductions.
"""

from __future__ import annotations

from megazero.models.param_info import param_info


class SplitBackward:
    """Mixed into ZeroEngine, which provides _backprop, _begin_gradients, _end_gradients, _gathers,
    _leaf_backward_done, names, and the `_input_pass` / `_leaves_of_pass` state."""

    def backward_input(self, loss, ticket) -> None:
        """B, from `loss` or by calling it (as `ZeroEngine.backward`); see the module docstring."""
        self._set_ticket(ticket)
        self._input_pass = True
        try:
            self._backprop(loss)
        finally:
            self._input_pass = False
            self._set_ticket(None)

    def backward_weight(self, run, ticket, *, last_microbatch: bool) -> None:
        """W: `run()` hands the weights' gradients of `ticket`'s B to autograd; then the leaves B saw
        end their backward (stage 3 reduces their units) and stage 3 lets go of what B held."""
        self._set_ticket(ticket)
        try:
            self._begin_gradients(last_microbatch)
            run()
            for domain, leaf in self._leaves_of_pass.pop(ticket, ()):
                self._leaf_backward_done(domain, leaf)
            self._end_gradients()
        finally:
            for gather in self._gathers():
                gather.end_ticket(ticket)
            self._set_ticket(None)

    def _set_ticket(self, ticket) -> None:
        for gather in self._gathers():
            gather.ticket = ticket

    def _outside_input_pass(self, on_grad, storage):
        """A parameter's gradient hook, which B (backward_input) must not reach with a gradient:
        autograd fires it there with none (the layer deferred it), which is ignored."""
        names = self.names

        def hook(param) -> None:
            if not self._input_pass:
                return on_grad(param)
            views = getattr(storage, "grads_are_views", False)  # .grad is always the buffer's view
            if not views and (param.grad is not None or param_info(param).pending_fp32_grad is not None):
                raise RuntimeError(
                    f"ZeRO: parameter {names.get(id(param), '?')!r} got its gradient in an input-gradient "
                    f"pass (B of a split backward): its layer does not defer its weight gradient to W "
                    f"(models/split_backward.py); it would be reduced before W"
                )

        return hook
