"""Model-parallel gradient duties once data parallelism has reduced the gradients (the step Megatron
calls finalize_model_grads). ZeRO reduces over data parallelism only; what tensor and pipeline
parallelism add to a gradient lives here, once per step rather than once per microbatch:

- a tied embedding held by the first and the last pipeline stage: the two stages' gradients are
  summed over the embedding group (or on the stage itself, where a V schedule puts the first and
  the last virtual stage both on stage 0);
- sequence-parallel parameters (norm weights and biases, row-parallel biases) see only this rank's
  sequence shard: their gradients are summed over the tensor-parallel group;
- which copy of a replicated parameter counts in the global gradient norm: a TP-replicated
  parameter on TP rank 0 only, a tied embedding on the first stage only. ZeRO gets this as data.

Parameters carry the facts as attributes set where they are made: `tensor_parallel` (split over
TP), `sequence_parallel` (gradient partial per sequence shard), `shared_embedding` (tied copy).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megazero.core import comm
from .process_groups import ProcessGroups
from megazero.models.param_info import param_info


def counts_in_norm(param: nn.Parameter, groups: ProcessGroups) -> bool:
    """Whether this rank counts `param` in the global gradient norm."""
    # expert weights count on every rank: their groups sum them (zero/experts.py), whole experts
    # (etp 1) being different experts on the tensor-parallel ranks
    info = param_info(param)
    if not (info.tensor_parallel or info.expert_parallel) and groups.coords.tp != 0:
        return False
    # the input embedding's copy counts (the first stage holds it), the output layer's never
    if info.shared_embedding and (not groups.is_first_stage or info.init_name is not None):
        return False
    return True


def summed_across_stages(param: nn.Parameter) -> bool:
    """Parameters whose reduced gradients are summed with another stage's copy: ZeRO must lay
    their partitions out identically on both stages (see ZeroEngine's `isolated`)."""
    return param_info(param).shared_embedding


def finalize_model_grads(
    params: list[nn.Parameter], grad_pieces: Callable[[list], list[torch.Tensor]], groups: ProcessGroups
) -> None:
    """Sums tied-embedding gradients over the embedding group and sequence-parallel gradients over
    the TP group. `grad_pieces(params)` returns the tensors holding this rank's (reduced) gradient
    of each parameter: ZeroEngine.grad_pieces, or `.grad` of plain modules."""
    sum_tied_embedding_grads(params, grad_pieces, groups.embedding)
    sum_sequence_parallel_grads(params, grad_pieces, groups.tp)


def sum_tied_embedding_grads(params, grad_pieces, embedding_group: comm.Group) -> None:
    tied = [p for p in params if param_info(p).shared_embedding]
    if len(tied) == 2:  # a V schedule: both copies here, laid out alike (ZeRO's isolated)
        pieces = grad_pieces(tied)
        pieces[0].add_(pieces[1])
        pieces[1].copy_(pieces[0])
    elif tied and embedding_group.size > 1:
        _all_reduce_coalesced(grad_pieces(tied), embedding_group)


def sum_sequence_parallel_grads(params, grad_pieces, tp_group: comm.Group) -> None:
    partial = [p for p in params if param_info(p).sequence_parallel]
    if partial and tp_group.size > 1:
        _all_reduce_coalesced(grad_pieces(partial), tp_group)


def plain_grads(params) -> list[torch.Tensor]:
    """`grad_pieces` for modules outside ZeRO: their `.grad` tensors."""
    return [p.grad for p in params]


def _all_reduce_coalesced(tensors: list[torch.Tensor], group: comm.Group) -> None:
    """One all-reduce for many small tensors (norm weights are a few hundred elements each)."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
