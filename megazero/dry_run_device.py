"""The meta device as a GPU for the dry run: what a GPU does that meta tensors cannot.

Meta kernels compute shapes only, and a copy out of a meta tensor fails ("no data"). A GPU's
device-to-host copies (optimizer states offloaded to the host, a checkpoint's host copy) are ordinary
there, so under `DeviceStandIn` a copy from meta into a host tensor leaves the host tensor as it was
(zeros where the dry run made it) and a `.to("cpu")` of a meta tensor gives host zeros of its shape.
Every such copy is counted (`d2h_copies`, `d2h_bytes`): host traffic the step pays.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _is(t, kind: str) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == kind


class DeviceStandIn(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.d2h_copies = 0
        self.d2h_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        if packet is aten.copy_ and _is(args[0], "cpu") and _is(args[1], "meta"):
            self._count(args[1])
            return args[0]
        if packet is aten._to_copy and _is(args[0], "meta") and str(kwargs.get("device", "meta")) == "cpu":
            self._count(args[0])
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device="cpu")
        return func(*args, **kwargs)

    def _count(self, t: torch.Tensor) -> None:
        self.d2h_copies += 1
        self.d2h_bytes += t.numel() * t.element_size()
