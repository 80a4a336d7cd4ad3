"""The one line that ends a run which ran out of memory mid-step, on every rank that did.

An allocation that fails raises torch.OutOfMemoryError on a GPU ("CUDA out of memory. Tried to
allocate 2.00 GiB ...") and a RuntimeError from the CPU allocator on the host ("DefaultCPUAllocator:
can't allocate memory: you tried to allocate N bytes"). The line names the phase it failed in (the
training loop marks the exception with the phase it left: forward, backward, gradient reduction,
optimizer step; else set-up, evaluation or a checkpoint, from the traceback's frames), the bytes asked
(from the error) and the bytes free when it is caught (the GPU: torch.cuda.mem_get_info; the host: the
tightest of /proc/meminfo's MemAvailable, the cgroup's memory.max less memory.current, and the
address-space limit, RLIMIT_AS, less this process's size), and the flags that lower that phase's
memory. The driver (megazero.run.launch) prints it; this module reads no environment variable.
"""

from __future__ import annotations

import re
import resource
from pathlib import Path

import torch

_CPU = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes")
_CUDA = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)")
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}
_PHASES = {"forward": "forward", "backward": "backward", "reduce": "gradient reduction", "step": "optimizer step"}
# (file's tail, function) -> phase, innermost first wins, for failures outside the timed phases
# (module, or a package's name and a dot; function, None: any; phase), matched by the frame's module
# name, not its file's path (megazero.core.source_paths)
_FRAMES = (
    ("megazero.checkpoint.", None, "checkpoint"),
    ("megazero.training.loop", "evaluate", "evaluation"),
    ("megazero.training.assembly", "setup", "set-up (model and ZeRO engine)"),
)


def mark_phase(err: BaseException | None, name: str) -> None:
    """Records on `err` the innermost step phase (training.phases' name) it left."""
    if err is not None and is_out_of_memory(err) and getattr(err, "megazero_phase", None) is None:
        try:
            err.megazero_phase = _PHASES.get(name, name)
        except AttributeError:
            pass


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and _CPU.search(str(err)) is not None
    )


def asked_bytes(err: BaseException) -> int | None:
    found = _CPU.search(str(err))
    if found:
        return int(found.group(1))
    found = _CUDA.search(str(err))
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else None


def phase_of(err: BaseException) -> str:
    marked = getattr(err, "megazero_phase", None)
    found, tb = None, err.__traceback__
    while tb is not None:  # outermost to innermost: the last match is the innermost
        module, name = tb.tb_frame.f_globals.get("__name__", ""), tb.tb_frame.f_code.co_name
        for where, function, phase in _FRAMES:
            if (module.startswith(where) if where.endswith(".") else module == where) and function in (None, name):
                found = phase
        tb = tb.tb_next
    if marked and found == "evaluation":
        return f"{marked} of an evaluation"
    return marked or found or "training step"


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def host_free() -> tuple[int | None, str]:
    """(bytes this process may still allocate on the host, which limit says so)."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except OSError:
        pass
    cgroup_max, cgroup_now = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if cgroup_max is not None and cgroup_now is not None:
        limits.append((max(0, cgroup_max - cgroup_now), "the cgroup's memory.max"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        size = None
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmSize:"):
                    size = int(line.split()[1]) * 1024
        except OSError:
            pass
        if size is not None:
            limits.append((max(0, soft - size), f"the address-space limit (ulimit -v) of {_size(soft)}"))
    if not limits:
        return None, "unknown"
    return min(limits)


def device_free(device: torch.device) -> tuple[int | None, str]:
    try:
        free, total = torch.cuda.mem_get_info(device)
    except RuntimeError:
        return None, "unknown"
    return free, f"of {_size(total)} on {device}"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def lowering_flags(phase: str, cfg, on_host: bool, math_attention: bool) -> list[str]:
    """The flags that lower `phase`'s memory, for what this run does not use already."""
    if cfg is None:
        return ["--micro-batch-size", "--seq-length", "the model size"]
    par, zero, m = cfg.parallel, cfg.zero, cfg.model
    flags: list[str] = []
    activations = any(p in phase for p in ("forward", "backward", "evaluation", "training step"))
    if activations:
        flags += [f"--micro-batch-size (now {cfg.micro_batch_size})"]
        if math_attention:
            flags += ["--attention-dropout 0 (the flash kernel, no (b, heads, s, s) probabilities)"]
        if m.recompute_granularity != "full":
            flags += [
                "--recompute-granularity full"
                if m.recompute_granularity == "selective"
                else "--recompute-activations (or --recompute-granularity full)"
            ]
        if par.tensor_parallel > 1 and not par.sequence_parallel:
            flags += ["--sequence-parallel"]
    if on_host and (zero.offloads_optimizer or zero.offloads_params):
        flags += ["--zero-offload-optimizer nvme / --zero-offload-param nvme (host memory to disk)"]
    elif "backward" in phase or "reduction" in phase:
        if zero.stage < 2:
            flags += [f"--zero-stage 2 (gradients partitioned; now {zero.stage})"]
    elif "optimizer step" in phase or "set-up" in phase or "checkpoint" in phase:
        if zero.stage < 3:
            flags += [f"--zero-stage 3 (now {zero.stage})"]
        if not zero.offloads_optimizer:  # on the CPU host memory is the same memory: to disk
            flags += [
                "--zero-offload-optimizer nvme (optimizer states to disk)"
                if on_host
                else "--zero-offload-optimizer cpu"
            ]
    flags += ["--tensor-model-parallel-size / --pipeline-model-parallel-size (more ranks for the model)"]
    return flags


def out_of_memory_line(err: BaseException, rank: int | None, cfg, device) -> str | None:
    """The line for an allocation that failed (None for any other error); `device`: the rank's."""
    if not is_out_of_memory(err):
        return None
    on_host = not isinstance(err, torch.OutOfMemoryError)
    phase = phase_of(err)
    device = torch.device(device) if device is not None else None
    math_attention = False
    if cfg is not None and on_host == (device is None or device.type == "cpu"):
        from megazero.config.attention_memory import kernel_for

        math_attention = kernel_for(cfg, device.type if device is not None else "cpu") == "math"
    asked = asked_bytes(err)
    free, how = host_free() if on_host else device_free(device)
    where = "host" if on_host else f"device ({device})"
    asked_text = _size(asked) if asked is not None else "an unknown size"
    free_text = f"{_size(free)} free ({how})" if free is not None else "free memory unknown"
    who = f"rank {rank}: " if rank is not None else ""
    return (
        f"{who}out of {where} memory in the {phase}: asked for {asked_text} with {free_text}; lower it "
        f"with {', '.join(lowering_flags(phase, cfg, on_host, math_attention))}"
    )
