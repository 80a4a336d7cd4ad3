"""The numerics every ZeRO storage shares: the dtypes of a run (`Precision`), the float64 sum of
squares the gradient norm is built from, and which parameters get weight decay.

Pure tensor arithmetic and records; no process groups, no storage of its own.
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


def sum_of_squares(t: torch.Tensor, slice_elems: int = 1 << 20) -> torch.Tensor:
    """float64 sum of squares of a 1-D tensor, in slices: a whole-tensor `.double().pow(2)` would
    hold two float64 copies of a gradient partition at the step's memory peak."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for start in range(0, t.numel(), slice_elems):
        piece = t[start:start + slice_elems].float()
        total += torch.dot(piece, piece).double()
    return total


def uses_weight_decay(shape) -> bool:
    """Biases and norm scales (1-D) are not decayed, as in Megatron-LM and GPT-2 practice."""
    return len(shape) >= 2
