"""The process groups and precision settings a ZeRO optimizer needs, handed in from outside.

ZeRO knows nothing of tensor or pipeline layers: it gets parameters, these groups and a few flags
per parameter (`tensor_parallel`, `shared_embedding`) that say how to count them in norms.
"""
from __future__ import annotations

import dataclasses

import torch

from megazero.comm import Group


@dataclasses.dataclass
class ZeroGroups:
    dp: Group            # the whole data-parallel group
    shard: Group         # where states are partitioned (the DP group, or a MiCS shard group)
    replica: Group       # ranks holding the same partition (MiCS replicas; a group of one otherwise)
    model_parallel: Group  # TP x PP: norms and overflow flags are summed/maxed over it
    embedding: Group     # first + last pipeline stage: tied embedding gradients are summed over it
    tp_rank: int = 0
    is_last_stage: bool = True
    is_first_stage: bool = True


@dataclasses.dataclass(frozen=True)
class Precision:
    """Low-precision model weights/grads with fp32 master weights, or everything in fp32."""
    param_dtype: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.param_dtype

    @classmethod
    def from_flags(cls, bf16: bool = False, fp16: bool = False) -> "Precision":
        if bf16 and fp16:
            raise ValueError("choose one of bf16 and fp16")
        return cls(torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32)


def counts_in_norm(param, groups: ZeroGroups) -> bool:
    """Whether this rank counts `param` in the global gradient norm: TP-replicated parameters are
    counted on TP rank 0 only, and a tied embedding living on two pipeline stages on the first only."""
    if not getattr(param, "tensor_parallel", False) and groups.tp_rank != 0:
        return False
    if getattr(param, "shared_embedding", False) and not groups.is_first_stage:
        return False
    return True


def drop_storage(t: torch.Tensor) -> None:
    """Frees a tensor's memory but keeps the tensor (and views of it) for `ensure_storage`."""
    t.untyped_storage().resize_(0)


def ensure_storage(t: torch.Tensor) -> None:
    """Gives a tensor emptied by `drop_storage` its memory back, zero-filled."""
    if t.untyped_storage().nbytes() == 0 and t.numel() > 0:
        t.untyped_storage().resize_(t.numel() * t.element_size())
        t.zero_()


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
