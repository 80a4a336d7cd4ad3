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
far; the peak's own breakdown is kept as well. `requests` logs what the caching allocator was asked, in
order (caching_allocator.replay's form), so that a step counted from fewer microbatches
(steady_state.py) can replay its allocator at the full count.
"""

from __future__ import annotations

import bisect
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
_COMM_MODULES = ("megazero.core.comm", "megazero.zero.quantized_comm", "megazero.zero.stage3.param_gather")


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
        module = frame.f_globals.get("__name__", "")  # the module, not its path (source_paths)
        if module in _COMM_MODULES:
            return "communication"
        if module.startswith("megazero.zero."):
            zero = True
        elif module.startswith("megazero.models.") and torch.is_grad_enabled() and not zero:
            return "activations"
        frame = frame.f_back
    return "model states" if zero else "workspace"


class DeviceStandIn(TorchDispatchMode):
    def __init__(self, memo: bool = True, device: str = "cuda"):
        super().__init__()
        if device not in ("cuda", "cpu"):
            raise ValueError(f"the dry run simulates a cuda or a cpu device, not {device!r}")
        self.device = device
        self.process_live, self.process_peak = 0, 0  # device and host bytes together
        self.memo = MetaMemo() if memo else None  # meta kernels' results remembered (dry_run_memo)
        self.d2h_copies = 0
        self.d2h_bytes = 0
        self.allocations = 0
        self.live = dict.fromkeys(OWNERS, 0)
        self.peak, self.peak_by_owner = 0, dict(self.live)
        self.allocator = CachingAllocator()  # the segments behind the device's allocations
        self.host_live = dict.fromkeys(OWNERS, 0)
        self.host_peak, self.host_peak_by_owner = 0, dict(self.host_live)
        self.phases: dict[str, dict] = {}
        self._held: dict[int, list] = {}  # storage id -> [owner, bytes, block, serial], while it holds memory
        self.requests: list = []  # the allocator's requests (caching_allocator.replay)
        self._live_serials: list[int] = []  # the allocator's live blocks' serials, oldest first
        self._serials = 0
        self._watched: set[int] = set()  # storages with a finalizer
        self._host_values: set[int] = set()  # storages of initial values: host data on a GPU
        self.read_marks: list[tuple[int, int]] = []
        self.counting = True  # off while the model chunks are built on meta (as on a GPU)
        self.initializing = False  # an initial value is being made: host data on a GPU
        self._reads, self._step_reads_start = None, 0
        self.in_setup = True  # until the first step: the model and ZeRO's storages
        self.backward_started = False  # in this step: the first backward allocation notes "forward"

    def phase_hooks(self, reads: list | None = None):
        """A context in which this stand-in hears the run's phases (megazero.training.phases) and
        notes the phases of every training step: "setup" before the first, "forward" at the step's
        first backward allocation (with pipelining: after the warm-up forwards), "backward" before
        the optimizer step, "step" after it. The last step's notes are kept. `reads` (host_read's
        open recording): each step's (first, end) positions in it go to `read_marks`. It also takes
        the declared seams it needs: initial values as shapes (`model_builder.initial_value`) and
        stage 3's storage resizes (`kernels.resize_storage`)."""
        import contextlib
        from megazero.core import kernels
        from megazero.training import model_builder, phases

        def resize_storage(real):
            def resize(storage, size):
                out = real(storage, size)
                self.resized(storage)
                return out

            return resize

        self._reads = reads
        stack = contextlib.ExitStack()
        stack.enter_context(
            kernels.swapped(
                (kernels.resize_storage, resize_storage), (model_builder.initial_value, lambda real: meta_value)
            )
        )
        stack.enter_context(phases.listening(self))
        return stack

    # --- the run's phases (megazero.training.phases' listener) ---------------------------------------
    def phase_started(self, name: str) -> None:
        if name == "train step":
            if self.in_setup:
                self.snapshot("setup")
                self.in_setup = False
            self.backward_started = False
            self._step_reads_start = len(self._reads) if self._reads is not None else 0
        elif name == "step":
            self.snapshot("backward")
        elif name in ("build", "initial value"):
            # On a GPU the chunks are meta tensors too (materialised later by the engine), and each
            # parameter's initial value is drawn on the host, one full tensor at a time, and this
            # rank's piece copied to the device: no device memory. Drawing a 70B model's full tensors
            # on this CPU would take minutes: the value is a meta tensor of its shape (meta_value),
            # made and cut with counting off and marked as host data, so that its copies into host
            # buffers (offloaded master weights) are no device reads.
            self.counting = False
            self.initializing = name == "initial value"

    def phase_ended(self, name: str, error) -> None:
        if name == "train step" and error is None:
            self.snapshot("step")
            if self._reads is not None:
                self.read_marks.append((self._step_reads_start, len(self._reads)))
        elif name in ("build", "initial value"):
            self.counting, self.initializing = True, False

    def snapshot(self, phase: str) -> None:
        if self.device == "cuda":
            self.requests.append(phase)
        self.phases[phase] = {
            "allocated": sum(self.live.values()),
            "peak": self.peak,
            "reserved": self.allocator.reserved,
            "by_owner": dict(self.live),
            "host": sum(self.host_live.values()),
        }

    def record(self) -> dict:
        return {
            "allocations": self.allocations,
            "peak": self.peak,
            "peak_by_owner": dict(self.peak_by_owner),
            "reserved_peak": self.allocator.peak_reserved,
            "segments": self.allocator.segments,
            "phases": dict(self.phases),
            "d2h_copies": self.d2h_copies,
            "d2h_bytes": self.d2h_bytes,
            "host": {"peak": self.host_peak, "peak_by_owner": dict(self.host_peak_by_owner)},
            "simulated_device": self.device,
            "process_peak": self.process_peak,
        }

    def _track(self, out) -> None:
        if not self.counting:
            if self.initializing:
                self._mark_host_values(out)
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

    def _mark_host_values(self, out) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                key = id(t.untyped_storage())
                if key not in self._host_values:
                    self._host_values.add(key)
                    weakref.finalize(t.untyped_storage(), self._host_values.discard, key)

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
        if host:  # host memory: plain bytes, no caching allocator in between
            self._held[key] = [owner, nbytes, None, None]
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
        block, serial = False, None
        if self.device == "cuda":
            block, serial = self.allocator.malloc(nbytes), self._serials
            self._serials += 1
            self._live_serials.append(serial)
            self.requests.append(nbytes)
        self._held[key] = [owner, size, block, serial]
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
        owner, size, block, serial = self._held.pop(key)
        self.process_live -= size
        if block is None:
            self.host_live[owner] -= size
        else:
            self.live[owner] -= size
            if block is not False:  # False: a simulated CPU's storage, no allocator block
                self.allocator.free(block)
                # (the block named by its place among the live ones counted from the newest: a
                # steady block's frees then read alike in every repetition)
                live = self._live_serials
                at = bisect.bisect_left(live, serial)
                self.requests.append(at - len(live))
                del live[at]

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
