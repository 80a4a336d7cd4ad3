"""Where a ZeroEngine's memory is, and DeepSpeed's API to move it: the memory report by category,
where each category lives (device, host, nvme), and `offload_states` / `reload_states` /
`empty_partition_cache` between steps.

An object the engine holds (`engine.memory`); it owns the states offload_states moved (`HostCopies`),
reads the engine's storages and shard domains (their stage-3 units, gather coordinators and
offloaded-parameter homes), and never decides when anything is gathered or stepped.
"""

from __future__ import annotations

import torch

from megazero.core.errors import UsageError
from .offload import REPORT_CATEGORY, HostCopies, check_state_names


class EngineMemory:
    def __init__(self, engine):
        self.engine = engine
        self.host_copies = HostCopies()  # states moved by offload_states

    # --- states off the device (DeepSpeed's offload_states API) ------------------------------
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Between steps, moves the named states (default all of "optim_states", "hp_params",
        "lp_params", "lp_grads", "contiguous_grad_buffer") to host memory, freeing their device
        memory; `reload_states()` brings them back bitwise before training goes on. States that
        offload_optimizer already keeps off the device stay where they are."""
        if str(device) != "cpu":
            raise UsageError(
                f'offload_states(device={device!r}): states can be offloaded to host memory only; pass device="cpu"'
            )
        check_state_names(include)
        engine = self.engine
        if engine.grads_ready or engine.has_grads:
            raise UsageError(
                "offload_states() was called inside a training step (after backward); call it after engine.step()"
            )
        self.empty_partition_cache()
        self.host_copies.offload(engine.storages(), include, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Brings every state moved by offload_states back to the device, bitwise."""
        self.host_copies.reload(non_blocking)
        for domain in self.engine.domains:
            domain.states_reloaded()

    def empty_partition_cache(self) -> None:
        """Releases every gathered stage-3 unit (each keeps only its partition), writes back and
        drops the host cache of swapped optimizer states, and frees the device's cached blocks."""
        engine = self.engine
        if any(domain.in_pass() for domain in engine.domains):
            raise UsageError(
                "empty_partition_cache() was called during a forward/backward pass; call it between training steps"
            )
        for domain in engine.domains:
            domain.release_gathered()
        for storage in engine.storages():
            if storage.offload is not None:
                storage.offload.flush_cache()
        for domain in engine.domains:
            domain.drop_param_cache()
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()

    def check_states_home(self) -> None:
        if self.host_copies:
            raise UsageError(
                f"engine.offload_states() moved {', '.join(self.host_copies.moved)} off "
                f"the device; call engine.reload_states() before the next training step"
            )

    def locations(self) -> dict[str, str]:
        """Where each report() category lives now: the device (e.g. "cuda:0"), "cpu" (host memory)
        or "nvme" (swap files)."""
        zero = self.engine.zero
        where = {k: str(self.engine.device) for k in ("params", "grads", "master", "optimizer_states", "buffers")}
        offload = zero.offload_optimizer
        if zero.offloads_optimizer and offload.ratio < 1.0:  # partial: both places
            tier = "host" if offload.device == "cpu" else "nvme"
            where[f"{tier}_master"] = where[f"{tier}_optimizer_states"] = offload.device
        elif zero.offloads_optimizer:
            where["master"] = where["optimizer_states"] = offload.device
        if zero.offloads_params:  # "params" keeps the persistent ones, on the device
            device = zero.offload_param.device
            where["host_params" if device == "cpu" else "nvme_params"] = device
        for name in self.host_copies.moved:
            where[REPORT_CATEGORY[name]] = "cpu"
        return where

    def report(self) -> dict[str, int]:
        """Bytes held by this rank, by category: low-precision params (stage 3: partitions plus
        persistent ones), grads, fp32 master, optimizer states, live (gathered) params now and at
        peak, buffers (module buffers and gradient staging); model_states sums the first four."""
        engine = self.engine
        report = {"params": 0, "grads": 0, "master": 0, "optimizer_states": 0, "live_params": 0}
        for storage in engine.storages():
            for key, value in storage.memory_bytes().items():
                report[key] = report.get(key, 0) + value
        units = [d.units for d in engine.domains if d.units is not None]
        if units:  # each domain's own peak: their sum bounds the peak of what is live together
            report["peak_live_params"] = sum(u.peak_live_numel * u.partition.element_size() for u in units)
        # Module buffers, and gradient staging buckets alive right now (in flight or filling).
        report["buffers"] = sum(b.numel() * b.element_size() for m in engine.modules for b in m.buffers())
        report["buffers"] += sum(s.staging_bytes() for s in engine.storages()) + engine.queue.staged_bytes()
        # States moved by offload_states count as host bytes (host_<category>), not device bytes.
        for category, moved in self.host_copies.bytes_by_category().items():
            report[category] -= moved
            report[f"host_{category}"] = report.get(f"host_{category}", 0) + moved
        report["model_states"] = sum(report[k] for k in ("params", "grads", "master", "optimizer_states"))
        return report
