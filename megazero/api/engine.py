"""The engine megazero.initialize returns: DeepSpeed's engine API over megazero's ZeroEngine.

    loss = engine(batch)            # the model's forward (any args, kwargs, outputs)
    engine.backward(loss)           # the loss of this rank's micro batch, as it is
    engine.step()                   # the optimizer steps at each gradient-accumulation boundary

DeepSpeed's meaning, kept: the micro batch's loss is averaged over the accumulation steps and the
data-parallel ranks (megazero's reductions sum, so backward scales it by 1 / (accumulation x dp)
before the ZeroEngine's backward); `step()` applies the optimizer only at the boundary (every
`gradient_accumulation_steps` backward calls), clips to `gradient_clipping`, steps the lr
scheduler after an applied step (not after one skipped on fp16 overflow) and counts `global_steps`
at every boundary. What ZeRO does (stages 0-3, offload, MiCS, hpZ, ZeRO++, ZenFlow) is the same
ZeroEngine pretrain_gpt.py trains with, over the user's module.

Owns the step's bookkeeping (micro steps, the boundary, the checks that a step follows a backward
and that the model keeps the parameters it was built with) and delegates everything else.
"""

from __future__ import annotations

import torch
from torch import nn

from megazero.core.errors import UsageError
from megazero.zero.engine import ZeroEngine
from megazero.zero.state_access import safe_get_full_fp32_param


class Engine(nn.Module):
    def __init__(
        self, module: nn.Module, zero: ZeroEngine, optimizer, lr_scheduler, settings, groups, device: torch.device
    ):
        super().__init__()
        self.module = module
        self.zero, self.optimizer, self.lr_scheduler = zero, optimizer, lr_scheduler
        self.settings, self.groups, self.device = settings, groups, device
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._in_step = False  # a training pass (begin_step) is open
        self._backwards = 0  # backward calls in the current accumulation window
        self._last_norm = None
        self._param_ids = {id(p) for p in zero.parameters()}
        self._param_count = len(self._param_ids)

    # --- DeepSpeed's accessors ----------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        return self.device.index or 0

    @property
    def global_rank(self) -> int:
        return self.groups.rank

    @property
    def world_size(self) -> int:
        return self.groups.dp.size

    @property
    def dp_world_size(self) -> int:
        return self.groups.dp.size

    def train_batch_size(self) -> int:
        return self.settings.global_batch

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.settings.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.settings.accumulation

    def zero_optimization_stage(self) -> int:
        return self.settings.zero.stage

    def gradient_clipping(self) -> float:
        return self.settings.clip_grad

    def bfloat16_enabled(self) -> bool:
        return self.settings.precision.bf16

    def fp16_enabled(self) -> bool:
        return self.settings.precision.fp16

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        """The gradient norm of the last applied or skipped step (before clipping), None before any."""
        return self._last_norm

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next backward is the last of its accumulation window (as DeepSpeed's)."""
        return (self.micro_steps + 1) % self.settings.accumulation == 0

    def get_loss_scale(self) -> float:
        return self.zero.loss_scaler.scale

    def train(self, mode: bool = True):
        self.module.train(mode)
        self.training = mode
        return self

    # --- the step -----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.module.training and not self._in_step:
            self._check_parameters()
            self.zero.begin_step()
            self._in_step = True
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward of this rank's micro-batch loss, averaged over accumulation steps (as DeepSpeed's
        scale_wrt_gas) and data-parallel ranks; the gradients are reduced at the boundary (stages 0/1)
        or per micro batch (2/3)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise UsageError(
                "engine.backward(loss) needs the scalar loss tensor of the forward, with its graph "
                "(not a float, and not computed under torch.no_grad)"
            )
        if not self._in_step:
            raise UsageError(
                "engine.backward(loss) with no training forward before it: run loss = engine(batch) "
                "with the engine in train() mode and gradients enabled"
            )
        divide = self.groups.dp.size * (self.settings.accumulation if scale_wrt_gas else 1)
        last = self.is_gradient_accumulation_boundary()
        self.zero.backward(loss / divide if divide != 1 else loss, last_microbatch=last)
        self._backwards += 1
        return loss

    def step(self, lr_kwargs=None) -> None:
        """Counts a micro step; at the accumulation boundary, clips, applies the optimizer, steps the lr
        scheduler and counts the global step (DeepSpeed's engine.step)."""
        if self._backwards == 0:
            raise UsageError(
                "engine.step() before engine.backward(loss): each micro step is forward, "
                "engine.backward(loss), engine.step()"
            )
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.global_samples += self.settings.micro_batch * self.groups.dp.size
        if not boundary:
            return
        if self._backwards != self.settings.accumulation:
            raise UsageError(
                f"engine.step() at the accumulation boundary after {self._backwards} backward "
                f"calls; each of the {self.settings.accumulation} micro steps calls "
                f"engine.backward(loss) once, then engine.step()"
            )
        self._check_parameters()
        stats = self.zero.step(self.optimizer.lrs())
        self._in_step, self._backwards = False, 0
        self._last_norm = stats.grad_norm
        self.global_steps += 1
        if stats.skipped:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def zero_grad(self) -> None:
        """Gradients are zeroed by each optimizer step; between steps there is nothing to clear."""

    def _check_parameters(self) -> None:
        """The engine owns the parameters it was built with: one added, replaced or removed since
        would train outside ZeRO (or not at all), so it is refused."""
        ids = {id(p) for p in self.module.parameters()}
        if ids != self._param_ids:
            new = [n for n, p in self.module.named_parameters() if id(p) not in self._param_ids]
            gone = self._param_count - len(ids & self._param_ids)
            raise UsageError(
                f"the model's parameters changed after megazero.initialize ({len(new)} new"
                + (f", e.g. {new[0]!r}" if new else "")
                + f", {gone} gone): the engine owns the "
                f"parameters it was built with; finish building (and resizing) the model before "
                f"megazero.initialize, or initialize again"
            )

    # --- states -------------------------------------------------------------------------------
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False):
        self.zero.offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False):
        self.zero.reload_states(non_blocking)

    def empty_partition_cache(self):
        self.zero.empty_partition_cache()

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full fp32 weights by name (collective: every rank calls it), as a state dict."""
        out = {name: safe_get_full_fp32_param(p) for name, p in self.module.named_parameters()}
        out.update({name: b.detach().clone() for name, b in self.module.named_buffers()})
        return out

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True, **_):
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag, client_state or {}, save_latest)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        **_,
    ):
        from .checkpoint import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag,
            load_optimizer_states and not load_module_only,
            load_lr_scheduler_states and not load_module_only,
        )
