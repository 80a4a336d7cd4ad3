"""The numerics every ZeRO storage shares: the dtypes a run's precision settings mean (`Precision`:
weights, gradient accumulation and reduction, the Adam moments' storage,
made from `megazero.zero.config.PrecisionConfig`, the record the engine is built from), the float64
sum of squares the gradient norm is built from, and which parameters get weight decay.

The norm's sum of squares (`sum_of_squares_many`) takes fp32 norms of slices of every gradient,
all of a storage's slices in one `torch._foreach_norm` (a few multi-tensor launches on a GPU,
however many slices), and adds their squares in float64. Slices are 1M elements on a GPU, whose
kernel reduces each in a tree, and 64K on the CPU, whose fp32 norm runs one vector accumulator
down a slice (~2e-5 relative off on 1M elements, ~4e-7 on 64K; a float64 accumulation would be
exact but is 4x slower there). `sum_of_squares` is its reference: 1M-element slices, one fp32 dot
product each in float64 (three kernels per slice), which the engine used before.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import PrecisionConfig
from megazero.models.param_info import param_info, set_param_info

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes of a run: model weights (bf16/fp16 with fp32 master weights, or fp32), gradient
    accumulation across microbatches, and gradient reduction. As DeepSpeed's bf16 optimizer and
    Megatron's main_grad do, 16-bit runs accumulate and reduce gradients in fp32 by default."""

    param_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    gradient_accumulation_fusion: bool = True
    """16-bit weights with fp32 accumulation: the layers sum weight gradients in fp32 straight for
    the fp32 buffers (`take_grad`), not rounded to 16 bits first (Megatron-LM's default)."""
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    """The Adam moments' storage (fp32 or bf16: megazero.ops.adam steps them in fp32 either way)."""

    def state_dtype(self, kind: str) -> torch.dtype:
        """The dtype of an optimizer-state kind: "fp32" (the master), "exp_avg" or "exp_avg_sq"."""
        return {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype}.get(kind, torch.float32)

    @property
    def mixed(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def fp32_weight_grads(self) -> bool:
        """Whether the engine marks its parameters `fp32_grad` (see take_grad)."""
        return self.mixed and self.grad_accum_dtype == torch.float32 and self.gradient_accumulation_fusion

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.grad_accum_dtype

    @classmethod
    def from_config(cls, config: PrecisionConfig) -> "Precision":
        if config.bf16 and config.fp16:
            raise ValueError("choose one of bf16 and fp16")
        param = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
        for name, value in (
            ("gradient accumulation", config.grad_accum_dtype),
            ("gradient reduction", config.reduce_dtype),
        ):
            if _DTYPES[value] not in (torch.float32, param):
                raise ValueError(f"{name} in {value} needs {value} parameters (or fp32)")
        return cls(
            param,
            _DTYPES[config.grad_accum_dtype],
            _DTYPES[config.reduce_dtype],
            config.gradient_accumulation_fusion,
            _DTYPES[config.exp_avg_dtype],
            _DTYPES[config.exp_avg_sq_dtype],
        )


def take_grad(param: torch.Tensor) -> torch.Tensor | None:
    """`param`'s gradient since the last take, clearing it. A parameter the engine marked
    `fp32_grad` may have had (part of) it summed in fp32 by its layers (megazero.models.weight_grad,
    Megatron's gradient-accumulation fusion), left in its ParamInfo's `pending_fp32_grad`; the 16-bit `.grad`
    autograd accumulated beside it (zeros, or a tied weight's other use) is added to that."""
    pending = param_info(param).pending_fp32_grad
    if pending is not None:
        set_param_info(param, pending_fp32_grad=None)
    grad, param.grad = param.grad, None
    if pending is None:
        return grad
    return pending.add_(grad) if grad is not None else pending


NORM_SLICE = 1 << 20  # elements per fp32 norm on a GPU (its kernel reduces a slice in a tree)
CPU_NORM_SLICE = 1 << 16  # on the CPU (one accumulator runs down a slice: shorter is more exact)


def sum_of_squares(t: torch.Tensor, slice_elems: int = NORM_SLICE) -> torch.Tensor:
    """float64 sum of squares of a 1-D tensor, in slices: a whole-tensor `.double().pow(2)` would
    hold two float64 copies of a gradient partition at the step's memory peak. The reference of
    `sum_of_squares_many` (three kernels per slice)."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for start in range(0, t.numel(), slice_elems):
        piece = t[start : start + slice_elems].float()
        total += torch.dot(piece, piece).double()
    return total


def sum_of_squares_many(
    counted: list[torch.Tensor], uncounted: list[torch.Tensor] = (), *, device, slice_elems: int | None = None
) -> torch.Tensor:
    """float64 sum of squares of the 1-D tensors `counted`, plus 0 times that of `uncounted`, so a
    non-finite value anywhere makes the result non-finite (inf * 0 is nan) while a finite uncounted
    gradient adds nothing. Each tensor is cut into slices of `slice_elems` (default: see the module
    docstring), every slice's fp32 norm comes from one foreach call, and the squares add in float64.
    `device`: where the tensors live (and the result, when there is nothing to sum)."""
    if slice_elems is None:
        slice_elems = CPU_NORM_SLICE if torch.device(device).type == "cpu" else NORM_SLICE
    slices, split = [], 0
    for k, tensors in enumerate((counted, uncounted)):
        for t in tensors:
            slices.extend(t[s : s + slice_elems] for s in range(0, t.numel(), slice_elems))
        if k == 0:
            split = len(slices)
    if not slices:
        return torch.zeros((), dtype=torch.float64, device=device)
    squares = torch.stack(_fp32_norms(slices)).double().square()
    return squares[:split].sum() + squares[split:].sum() * 0.0


def _fp32_norms(slices: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of every slice, accumulated and returned in fp32 (16-bit slices too: a bf16
    result would keep 3 digits of the norm)."""
    if all(t.dtype == torch.float32 for t in slices):
        return list(torch._foreach_norm(slices, 2))
    try:
        return list(torch._foreach_norm(slices, 2, dtype=torch.float32))  # torch >= 2.4
    except TypeError:
        return [torch.linalg.vector_norm(t, dtype=torch.float32) for t in slices]


def uses_weight_decay(shape) -> bool:
    """Biases and norm scales (1-D) are not decayed, as in Megatron-LM and GPT-2 practice."""
    return len(shape) >= 2
