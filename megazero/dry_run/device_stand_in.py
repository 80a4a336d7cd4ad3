"""The meta device as a GPU for the dry run: what a GPU does that meta tensors cannot.

Meta kernels compute shapes only, and a copy out of a meta tensor fails ("no data"). A GPU's
device-to-host copies (optimizer states offloaded to the host, a checkpoint's host copy) are ordinary
there, so under `DeviceStandIn` a copy from meta into a host tensor leaves the host tensor as it was
(zeros where the dry run made it) and a `.to("cpu")` of a meta tensor gives host zeros of its shape.
Every such copy is counted (`d2h_copies`, `d2h_bytes`): host traffic the step pays.

It also keeps the device's memory as CUDA's caching allocator would hand it out: every meta storage
an op creates is one allocation, rounded up to the allocator's 512-byte blocks, held until torch
frees the storage (a finalizer on it: storages keep one Python object for their lifetime), and
placed in the allocator's segments by `megazero.dry_run.caching_allocator` (reserved beside allocated).
Each allocation gets an owner from what allocated it: the collectives' buffers (`communication`:
made inside megazero's comm layer, the stage-3 gathers, the quantized collectives), autograd's
backward (`backward`: gradients of activations and weight gradients before ZeRO takes them), the
forward of the model (`activations`; and whatever autograd saves for the backward: `saved`, its
pack hook), ZeRO's storages (`model states`: parameters, gradients, master weights, optimizer
states) and the rest (`workspace`). Host storages (offloaded optimizer states, host staging) are
kept the same way, in plain bytes. Simulating a CPU (`device="cpu"`) the device's storages are plain
bytes too (no caching allocator: glibc's malloc, no 512-byte blocks, no segments), and since device
and host memory are then one, `process_peak` counts both at once. `snapshot(phase)` notes the live bytes by owner and the peak so
far; the peak's own breakdown is kept as well.
"""
from __future__ import annotations

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.dry_run.caching_allocator import CachingAllocator, rounded
from megazero.dry_run.meta_memo import MetaMemo

aten = torch.ops.aten


def _is(t, kind: str) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == kind


OWNERS = ("model states", "activations", "backward", "communication", "workspace")
_COMM_FILES = ("/core/comm.py", "/zero/quantized_comm.py", "/zero/stage3/param_gather.py")


def meta_value(config, name: str, full_shape, seed: int) -> torch.Tensor:
    """models.gpt.initial_value's shape and dtype without its values (no draw on the host)."""
    return torch.empty(tuple(full_shape), dtype=torch.float32, device="meta")


def _owner() -> str:
    if torch._C._current_autograd_node() is not None:
        return "backward"
    frame, zero = sys._getframe(3), False
    for _ in range(40):
        if frame is None:
            break
        name = frame.f_code.co_filename
        if name.endswith(_COMM_FILES):
            return "communication"
        if "/megazero/zero/" in name:
            zero = True
        elif "/models/" in name and torch.is_grad_enabled() and not zero:
            return "activations"
        frame = frame.f_back
    return "model states" if zero else "workspace"


class DeviceStandIn(TorchDispatchMode):
    def __init__(self, memo: bool = True, device: str = "cuda"):
        super().__init__()
        if device not in ("cuda", "cpu"):
            raise ValueError(f"the dry run simulates a cuda or a cpu device, not {device!r}")
        self.device = device
        self.process_live, self.process_peak = 0, 0    # device and host bytes together
        self.memo = MetaMemo() if memo else None     # meta kernels' results remembered (dry_run_memo)
        self.d2h_copies = 0
        self.d2h_bytes = 0
        self.allocations = 0
        self.live = dict.fromkeys(OWNERS, 0)
        self.peak, self.peak_by_owner = 0, dict(self.live)
        self.allocator = CachingAllocator()      # the segments behind the device's allocations
        self.host_live = dict.fromkeys(OWNERS, 0)
        self.host_peak, self.host_peak_by_owner = 0, dict(self.host_live)
        self.phases: dict[str, dict] = {}
        self._held: dict[int, list] = {}      # storage id -> [owner, bytes, block], while it holds memory
        self._watched: set[int] = set()       # storages with a finalizer
        self._host_values: set[int] = set()   # storages of initial values: host data on a GPU
        self.read_marks: list[tuple[int, int]] = []
        self.counting = True           # off while the model chunks are built on meta (as on a GPU)
        self.in_setup = True           # until the first step: the model and ZeRO's storages
        self.backward_started = False  # in this step: the first backward allocation notes "forward"

    def phase_hooks(self, reads: list | None = None):
        """Patches that note the phases of every training step: "setup" before the first, "forward"
        at the step's first backward allocation (with pipelining: after the warm-up forwards),
        "backward" before the optimizer step, "step" after it. The last step's notes are kept.
        `reads` (host_read's open recording): each step's (first, end) positions in it go to `read_marks`."""
        import contextlib
        from unittest import mock
        from megazero.training import assembly, loop, model_builder
        from megazero.zero.engine import ZeroEngine
        real_step, real_engine_step = loop.train_step, ZeroEngine.step

        def train_step(*args, **kwargs):
            if self.in_setup:
                self.snapshot("setup")
                self.in_setup = False
            self.backward_started = False
            start = len(reads) if reads is not None else 0
            out = real_step(*args, **kwargs)
            self.snapshot("step")
            if reads is not None:
                self.read_marks.append((start, len(reads)))
            return out

        def engine_step(engine, *args, **kwargs):
            self.snapshot("backward")
            return real_engine_step(engine, *args, **kwargs)
        real_build = assembly.build_model_chunks

        def build_model_chunks(*args, **kwargs):
            # On a GPU these chunks are meta tensors too (materialised later by the engine): no memory.
            self.counting = False
            try:
                return real_build(*args, **kwargs)
            finally:
                self.counting = True
        real_init_fn = assembly.make_init_fn

        def make_init_fn(*args, **kwargs):
            # A GPU job draws each parameter's initial value on the host, one full tensor at a time,
            # and copies this rank's piece to the device. Values do not matter here, and drawing a
            # 70B model's full tensors on this CPU takes minutes: the value is a meta tensor of its
            # shape, made and cut with counting off (host memory on a GPU) and marked as host data,
            # so that its copies into host buffers (offloaded master weights) are no device reads.
            real = real_init_fn(*args, **kwargs)

            def init(name, param):
                self.counting = False
                try:
                    with mock.patch.object(model_builder, "initial_value", meta_value):
                        value = real(name, param)
                finally:
                    self.counting = True
                self._host_values.add(id(value.untyped_storage()))
                weakref.finalize(value.untyped_storage(), self._host_values.discard, id(value.untyped_storage()))
                return value
            return init
        real_resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = real_resize(storage, size)
            self.resized(storage)
            return out
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(torch.UntypedStorage, "resize_", resize_))
        stack.enter_context(mock.patch.object(assembly, "make_init_fn", make_init_fn))
        stack.enter_context(mock.patch.object(assembly, "build_model_chunks", build_model_chunks))
        stack.enter_context(mock.patch.object(loop, "train_step", train_step))
        stack.enter_context(mock.patch.object(ZeroEngine, "step", engine_step))
        return stack

    def snapshot(self, phase: str) -> None:
        self.phases[phase] = {"allocated": sum(self.live.values()), "peak": self.peak,
                              "reserved": self.allocator.reserved, "by_owner": dict(self.live),
                              "host": sum(self.host_live.values())}

    def record(self) -> dict:
        return {"allocations": self.allocations, "peak": self.peak, "peak_by_owner": dict(self.peak_by_owner),
                "reserved_peak": self.allocator.peak_reserved, "segments": self.allocator.segments,
                "phases": dict(self.phases), "d2h_copies": self.d2h_copies, "d2h_bytes": self.d2h_bytes,
                "host": {"peak": self.host_peak, "peak_by_owner": dict(self.host_peak_by_owner)},
                "simulated_device": self.device, "process_peak": self.process_peak}

    def _track(self, out) -> None:
        if not self.counting:
            return
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            kind = t.device.type
            if kind != "meta" and kind != "cpu":
                continue
            storage = t.untyped_storage()
            if id(storage) not in self._held and storage.nbytes():
                self._account(storage, kind == "cpu")

    def resized(self, storage) -> None:
        """After `UntypedStorage.resize_`: stage 3 frees a gathered unit's memory by resizing its
        storage to 0 and gathers into it again by resizing it back (tensor_memory.py), which no op
        shows; the storage's old bytes are freed and its new ones allocated, owned anew."""
        kind = storage.device.type
        if not self.counting or (kind != "meta" and kind != "cpu"):
            return
        if id(storage) in self._held:
            self._free(id(storage))
        if storage.nbytes():
            self._account(storage, kind == "cpu")

    def _account(self, storage, host: bool) -> None:
        key, nbytes = id(storage), storage.nbytes()
        owner = _owner()
        if self.in_setup and owner != "communication":
            owner = "model states"
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(storage, self._gone, key)
        if host:                   # host memory: plain bytes, no caching allocator in between
            self._held[key] = [owner, nbytes, None]
            self._process(nbytes)
            self.host_live[owner] += nbytes
            total = sum(self.host_live.values())
            if total > self.host_peak:
                self.host_peak, self.host_peak_by_owner = total, dict(self.host_live)
            return
        size = rounded(nbytes) if self.device == "cuda" else nbytes
        self._process(size)
        if owner == "backward" and not self.backward_started:
            self.backward_started = True
            self.snapshot("forward")
        self._held[key] = [owner, size, self.allocator.malloc(nbytes) if self.device == "cuda" else False]
        self.allocations += 1
        self.live[owner] += size
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.peak_by_owner = total, dict(self.live)

    def _process(self, nbytes: int) -> None:
        self.process_live += nbytes
        self.process_peak = max(self.process_peak, self.process_live)

    def _gone(self, key: int) -> None:
        self._watched.discard(key)
        if key in self._held:
            self._free(key)

    def _free(self, key: int) -> None:
        owner, size, block = self._held.pop(key)
        self.process_live -= size
        if block is None:
            self.host_live[owner] -= size
        else:
            self.live[owner] -= size
            if block is not False:         # False: a simulated CPU's storage, no allocator block
                self.allocator.free(block)

    def saved(self, t):
        """autograd's pack hook: a tensor kept for the backward is an activation, whatever made it
        (a custom Function's forward runs with autograd off: its outputs were counted as workspace)."""
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            held = self._held.get(id(t.untyped_storage()))
            if held is not None and held[0] == "workspace" and held[2] is not None:
                self.live["workspace"] -= held[1]
                self.live["activations"] += held[1]
                held[0] = "activations"
        return t

    def keeping_activations(self):
        """A context in which every tensor autograd saves for the backward goes through `saved`."""
        return torch.autograd.graph.saved_tensors_hooks(self.saved, lambda t: t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        if packet is aten.copy_ and _is(args[0], "cpu") and _is(args[1], "meta"):
            if id(args[1].untyped_storage()) not in self._host_values:
                self._count(args[1])
            return args[0]
        if packet is aten._to_copy and _is(args[0], "meta") and str(kwargs.get("device", "meta")) == "cpu":
            self._count(args[0])
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device="cpu")
        key = self.memo.key(func, args, kwargs) if self.memo is not None else None
        out = self.memo.replay(key) if key is not None else None
        if out is None:
            out = func(*args, **kwargs)
            if key is not None:
                self.memo.remember(key, out)
        self._track(out)
        return out

    def _count(self, t: torch.Tensor) -> None:
        self.d2h_copies += 1
        self.d2h_bytes += t.numel() * t.element_size()
