"""Activation offload: the tensors chosen transformer layers save for their backward go to host memory
after their forward and come back before their backward (Megatron-LM's --cpu-offloading
--cpu-offloading-num-layers N, DeepSpeed's activation_checkpointing.cpu_checkpointing).

Owns the hooks that do it, put on a model chunk from outside (models/ never sees them): the first N
transformer layers of each model chunk each form a "unit", one forward of which saves a group of
tensors. A layer run without recomputation is a unit by itself: torch.autograd.graph.saved_tensors_hooks
entered in its forward pre-hook and left in its forward hook see every tensor it saves. A layer under
full recomputation is the checkpoint that runs it (one layer, or a uniform group of them): the hooks
wrap the checkpoint call, where torch's non-reentrant checkpoint saves only its inputs through them
(the checkpointed input goes to the host, which is DeepSpeed's cpu_checkpointing), and the tensors
saved inside it are dropped and recomputed as before.

Orders, on a GPU (on CPU the streams are no-ops, or the stream checker's modelled streams):
- end of a unit's forward: the copy stream waits for the compute stream (the tensors are written),
  copies every saved tensor into pinned host memory, and `keep_alive` records both streams on the
  device tensor, so the caching allocator does not reuse its block before the copy has read it; the
  unit then drops the device tensor.
- the backward of a unit starts when the gradient of its output arrives (a hook on that tensor): the
  unit's group is fetched (host -> device on the copy stream) if it is not yet, and the group before it
  is fetched ahead, so its copy overlaps this unit's backward. The first layer after the offloaded ones
  fetches the last offloaded group the same way.
- the first unpack of a group makes the compute stream wait for its fetch's event.
Several microbatches may be in flight (pipelines): a group belongs to one forward, never to a layer.

Must not touch: parameters (ZeRO owns them: a saved parameter, or a view of one such as the transposed
weight of a linear layer, stays as it is), the model's arithmetic (a tensor comes back bit for bit, in
its layout).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megazero.core.streams import Event, Streams


class _Group:
    """The tensors one forward of one unit saved: on the device until the forward ends, on the host
    until its backward is near, then on the device again until autograd lets them go."""

    def __init__(self, previous: "_Group | None"):
        self.previous = previous  # the unit before, in the same forward: fetched ahead
        self.saved: list[torch.Tensor] = []
        self.index: dict[int, int] = {}  # id of a saved tensor -> its slot (saved twice: one copy)
        self.uses: list[int] = []  # unpacks left per slot: the slot is let go at the last
        self.host: list[torch.Tensor] | None = None
        self.devices: list[torch.device] = []  # where each came from (and goes back to)
        self.back: list[torch.Tensor] | None = None
        self.stored: Event | None = None
        self.fetched: Event | None = None
        self.waited = False


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class ActivationOffload:
    """Moves the saved activations of the first `num_layers` layers of each model chunk given to
    `apply` to the host and back (see the module notes). One per rank: its device and side streams."""

    def __init__(self, device, streams: Streams, num_layers: int):
        self.device = torch.device(device)
        self.streams = streams
        self.num_layers = num_layers
        self.pin = self.device.type == "cuda"
        self.host_bytes = 0  # on the host now
        self.peak_host_bytes = 0

    # --- putting the hooks on ---------------------------------------------------------------

    def apply(self, chunk) -> None:
        """Hooks the first `num_layers` layers of `chunk` (a GPT: models.gpt), and the one after them
        to fetch the last offloaded group ahead of its backward."""
        layers = list(chunk.layers.values())
        chosen = layers[: self.num_layers]
        cfg = chunk.config
        recomputed = set()
        if cfg.recompute_granularity == "full":
            whole = cfg.recompute_method == "uniform"
            recomputed = {id(layer) for i, layer in enumerate(layers) if whole or i < cfg.recompute_num_layers}
        state = {"last": None}  # this chunk's latest group in this forward
        chunk.register_forward_pre_hook(lambda module, args: state.update(last=None))
        for layer in chosen:
            if id(layer) not in recomputed:
                layer.register_forward_pre_hook(lambda module, args: self._enter(state))
                layer.register_forward_hook(lambda module, args, out: self._leave(state))
        if any(id(layer) in recomputed for layer in chosen):
            chunk.set_checkpoint_fn(self._checkpoint_fn(chunk.checkpoint_fn, {id(x) for x in chosen}, state))
        for i, layer in enumerate(layers[: self.num_layers + 1]):
            layer.register_forward_hook(self._fetch_hook(state, ahead_only=i == self.num_layers))

    def _checkpoint_fn(self, checkpoint_fn, chosen: set[int], state: dict):
        def checkpoint(function, *args):
            layers = getattr(function, "layers", ())
            if not any(id(layer) in chosen for layer in layers) or not torch.is_grad_enabled():
                return checkpoint_fn(function, *args)
            self._enter(state)
            try:
                out = checkpoint_fn(function, *args)
            finally:
                self._leave(state)
            return out

        checkpoint.layers_offloaded = chosen
        return checkpoint

    # --- forward: collect, then store ------------------------------------------------------------

    def _enter(self, state: dict) -> None:
        if not torch.is_grad_enabled() or _in_backward():
            state["hooks"] = contextlib.nullcontext()
        else:
            group = _Group(state["last"])
            state["last"] = group
            state["hooks"] = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, t), self._unpack)
        state["hooks"].__enter__()

    def _leave(self, state: dict) -> None:
        hooks = state.pop("hooks")
        hooks.__exit__(None, None, None)
        if not isinstance(hooks, contextlib.nullcontext):
            self._store(state["last"])

    def _pack(self, group: _Group, t: torch.Tensor):
        if t.device.type != self.device.type or _is_parameter(t):
            return t
        slot = group.index.get(id(t))
        if slot is None:
            slot = group.index[id(t)] = len(group.saved)
            group.saved.append(t)
            group.uses.append(0)
        group.uses[slot] += 1
        return group, slot

    def _store(self, group: _Group) -> None:
        """Copies the group's tensors to the host on the copy stream and lets the device ones go."""
        copy = self.streams.copy
        copy.wait_current()
        with copy:
            group.host, group.devices = [], [t.device for t in group.saved]
            for t in group.saved:
                host = torch.empty_like(t, device="cpu", pin_memory=self.pin)
                host.copy_(t, non_blocking=self.pin)
                copy.keep_alive(t)
                group.host.append(host)
                self.host_bytes += host.numel() * host.element_size()
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        group.stored = Event(self.device).record(copy)
        group.saved, group.index = [], {}

    # --- backward: fetch ahead, then use ---------------------------------------------------------

    def _fetch_hook(self, state: dict, ahead_only: bool):
        def on_forward(module, args, out):
            if not isinstance(out, torch.Tensor) or not out.requires_grad or _in_backward():
                return
            group = state["last"]
            if group is None:
                return

            def on_grad(grad):
                self._fetch(group)
                if not ahead_only:
                    self._fetch(group.previous)
                    group.previous = None  # a finished forward's chain is not kept

            out.register_hook(on_grad)

        return on_forward

    def _fetch(self, group: _Group | None) -> None:
        if group is None or group.back is not None or group.host is None:
            return
        copy = self.streams.copy
        with copy:
            group.back = [
                host.to(device, non_blocking=self.pin, copy=True) for host, device in zip(group.host, group.devices)
            ]
            for t in group.back:
                copy.keep_alive(t)
        group.fetched = Event(self.device).record(copy)
        self.host_bytes -= sum(h.numel() * h.element_size() for h in group.host)
        group.host = None

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        group, slot = packed
        if group.back is None:
            self._fetch(group)
        if not group.waited:
            group.fetched.wait()
            group.waited = True
        t = group.back[slot]
        if t is None:
            raise RuntimeError(
                "an offloaded activation was read twice: --cpu-offloading lets each saved "
                "tensor go after its backward (no backward with retain_graph=True)"
            )
        # The last read lets it go: autograd holds it while its node runs, then frees it.
        group.uses[slot] -= 1
        if group.uses[slot] == 0:
            group.back[slot] = None
        return t


def _in_backward() -> bool:
    """True while autograd runs a backward node (a checkpoint's recomputation happens there)."""
    return torch._C._current_autograd_node() is not None
