"""The numerics every ZeRO storage shares: the dtypes of a run (`Precision`), the float64 sum of
squares the gradient norm is built from, and which parameters get weight decay.

The norm's sum of squares (`sum_of_squares_many`) takes the norms of 1M-element slices, all of a
storage's slices in one `torch._foreach_norm` (a few multi-tensor launches on a GPU, however many
slices), accumulated in float64 inside the kernel: torch's CPU fp32 norm runs one vector
accumulator down the slice (~2e-5 relative off on 1M elements), float64 is exact to ~1e-13, and
on a GPU the pass is memory-bound either way. `sum_of_squares` is its reference: the same slices,
one fp32 dot product each in float64 (three kernels per slice), which the engine used before.
"""
from __future__ import annotations

import dataclasses

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes of a run: model weights (bf16/fp16 with fp32 master weights, or fp32), gradient
    accumulation across microbatches, and gradient reduction. As DeepSpeed's bf16 optimizer and
    Megatron's main_grad do, 16-bit runs accumulate and reduce gradients in fp32 by default."""
    param_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.grad_accum_dtype

    @classmethod
    def from_flags(cls, bf16: bool = False, fp16: bool = False, grad_accum: str = "fp32",
                   reduce: str = "fp32") -> "Precision":
        if bf16 and fp16:
            raise ValueError("choose one of bf16 and fp16")
        param = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
        for name, value in (("gradient accumulation", grad_accum), ("gradient reduction", reduce)):
            if _DTYPES[value] not in (torch.float32, param):
                raise ValueError(f"{name} in {value} needs {value} parameters (or fp32)")
        return cls(param, _DTYPES[grad_accum], _DTYPES[reduce])


NORM_SLICE = 1 << 20


def sum_of_squares(t: torch.Tensor, slice_elems: int = NORM_SLICE) -> torch.Tensor:
    """float64 sum of squares of a 1-D tensor, in slices: a whole-tensor `.double().pow(2)` would
    hold two float64 copies of a gradient partition at the step's memory peak. The reference of
    `sum_of_squares_many` (three kernels per slice)."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for start in range(0, t.numel(), slice_elems):
        piece = t[start:start + slice_elems].float()
        total += torch.dot(piece, piece).double()
    return total


def sum_of_squares_many(counted: list[torch.Tensor], uncounted: list[torch.Tensor] = (), *, device,
                        slice_elems: int = NORM_SLICE) -> torch.Tensor:
    """float64 sum of squares of the 1-D tensors `counted`, plus 0 times that of `uncounted`, so a
    non-finite value anywhere makes the result non-finite (inf * 0 is nan) while a finite uncounted
    gradient adds nothing. Each tensor is cut into slices of `slice_elems` (as `sum_of_squares`
    does), every slice's norm comes from one foreach call (float64 accumulation), and the squares
    add in float64.
    `device`: where the result lives when there is nothing to sum (the tensors' device)."""
    slices, split = [], 0
    for k, tensors in enumerate((counted, uncounted)):
        for t in tensors:
            slices.extend(t[s:s + slice_elems] for s in range(0, t.numel(), slice_elems))
        if k == 0:
            split = len(slices)
    if not slices:
        return torch.zeros((), dtype=torch.float64, device=device)
    squares = torch.stack(_float64_norms(slices)).square()
    return squares[:split].sum() + squares[split:].sum() * 0.0


def _float64_norms(slices: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of every slice, accumulated and returned in float64."""
    try:
        return list(torch._foreach_norm(slices, 2, dtype=torch.float64))   # torch >= 2.4
    except TypeError:
        return [torch.linalg.vector_norm(t, dtype=torch.float64) for t in slices]


def uses_weight_decay(shape) -> bool:
    """Biases and norm scales (1-D) are not decayed, as in Megatron-LM and GPT-2 practice."""
    return len(shape) >= 2
