"""The process groups and precision settings a ZeRO optimizer needs, handed in from outside.

ZeRO knows nothing of tensor or pipeline layers: it gets parameters, these groups and, as data,
which parameters count in the gradient norm (megazero.parallel.finalize decides that).
"""
from __future__ import annotations

import dataclasses

import torch

from megazero.core.comm import Group


@dataclasses.dataclass
class ZeroGroups:
    dp: Group              # the whole data-parallel group
    shard: Group           # where states are partitioned (the DP group, or a MiCS shard group)
    replica: Group         # ranks holding the same partition (MiCS replicas; a group of one otherwise)
    model_parallel: Group  # TP x PP: gradient norms are summed over it
    gather: Group | None = None  # same ranks as `shard`, its own communicator, so stage-3 parameter
    #                               gathers never queue behind gradient reductions (None: `shard`)
    # Stage 3 across nodes (ZeRO++, hierarchical MiCS gather): the ranks of `shard` on this rank's
    # node, and the ranks of `shard` at this rank's position on the other nodes (None: not built).
    node_local: Group | None = None
    cross_node: Group | None = None
    hpz: Group | None = None   # hpZ: the node-local ranks sharing a secondary partition (None: off)

    @property
    def shard_gather(self) -> Group:
        return self.gather if self.gather is not None else self.shard


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
