"""Muon's math: the momentum on flat pieces, the Newton-Schulz orthogonalisation of a whole matrix, the
update's scale from the matrix's shape, and the step on the weights. Usable without the engine; the
distributed step (which rank orthogonalises which matrix) is megazero.zero.muon's.

One step of one matrix W with gradient G (torch.optim.Muon's algorithm, Megatron-LM's flags):

    M <- lerp(M, G, 1 - mu)                       the momentum, an exponential average
    U  = lerp(G, M, mu) if nesterov else M
    O  = NS(U) * scale(rows, cols) * extra        Newton-Schulz, then the shape's factor
    W <- W (1 - lr wd) - lr O                     decoupled weight decay, then the update

`newton_schulz` runs torch.optim.Muon's ops in its order (a bf16 copy, transposed when tall, divided by
its Frobenius norm floored at eps, then `steps` rounds of X <- a X + (b A + c A A) X with A = X X^T,
each an addmm as torch writes it), so that with the "simple" coefficients, 5 steps and
matmul_precision "medium" one process reproduces torch.optim.Muon; "high" runs the same ops in fp32.
The "quintic" coefficients cycle through five (a, b, c) sets (Megatron-LM's default type).

`scale_factor`'s modes are Megatron-LM's (--muon-scale-mode): spectral sqrt(max(rows, cols)),
unit_rms_norm sqrt(rows / cols), shape_scaling sqrt(max(1, rows / cols)), rows being the output
features. torch.optim.Muon's adjust_lr_fn "original" is shape_scaling, its "match_rms_adamw" is
spectral with an extra factor of 0.2.
"""

from __future__ import annotations

import itertools
import math

import torch

from .muon_config import MuonConfig

# (a, b, c) per Newton-Schulz round, cycled: the published coefficient sets.
COEFFICIENTS = {
    "simple": ((3.4445, -4.775, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
}


def ns_dtype(config: MuonConfig) -> torch.dtype:
    return torch.bfloat16 if config.matmul_precision == "medium" else torch.float32


def newton_schulz(matrix: torch.Tensor, config: MuonConfig) -> torch.Tensor:
    """The orthogonalised `matrix` (2-D), in fp32 (computed in ns_dtype(config))."""
    x = matrix.to(ns_dtype(config), copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:  # the Gram matrix of the short side is the smaller one
        x = x.T
    x = x / x.norm().clamp(min=config.eps)
    for a, b, c in itertools.islice(itertools.cycle(COEFFICIENTS[config.coefficient_type]), config.ns_steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    if tall:
        x = x.T
    return x.to(torch.float32)


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """The update's factor for a matrix of `rows` output and `cols` input features."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if mode == "shape_scaling":
        return math.sqrt(max(1, rows / cols))
    raise ValueError(f"unknown Muon scale mode {mode!r}")


def orthogonalized(matrix: torch.Tensor, config: MuonConfig, transposed: bool = False) -> torch.Tensor:
    """NS(matrix) times its shape's scale and the extra factor (fp32). `transposed`: the matrix is
    stored (in, out), as x @ W uses it; it is orthogonalised as its (out, in) transpose, the form of a
    linear's weight, so that a square one rounds in bf16 as that weight does (NS(X^T) = NS(X)^T only in
    exact arithmetic; newton_schulz puts a non-square one in its wide form either way)."""
    if transposed:
        return orthogonalized(matrix.T, config).T
    rows, cols = matrix.size(0), matrix.size(1)
    return newton_schulz(matrix, config).mul_(scale_factor(rows, cols, config.scale_mode) * config.extra_scale_factor)


def orthogonalized_tensor(
    full: torch.Tensor,
    config: MuonConfig,
    *,
    row_blocks: tuple[int, ...] = (),
    batched: bool = False,
    transposed: bool = False,
) -> torch.Tensor:
    """The update of a whole (tensor-parallel-complete) weight: one matrix; with `batched` one per
    index of dim 0 (grouped experts); with `row_blocks` (split QKV, Megatron-LM's --muon-split-qkv)
    the rows of each group are cut into blocks of these sizes and each block, taken over all groups,
    is a matrix of its own (queries, keys, values)."""
    if batched:
        return torch.stack(
            [orthogonalized_tensor(m, config, row_blocks=row_blocks, transposed=transposed) for m in full]
        )
    if not row_blocks:
        return orthogonalized(full, config, transposed)
    width = full.size(-1)
    grouped = full.view(-1, sum(row_blocks), width)
    parts = [
        orthogonalized(block.reshape(-1, width), config, transposed).view(grouped.size(0), -1, width)
        for block in grouped.split(list(row_blocks), dim=1)
    ]
    return torch.cat(parts, dim=1).view_as(full)


def momentum_update(momentum: torch.Tensor, grad: torch.Tensor, config: MuonConfig) -> torch.Tensor:
    """Advances `momentum` in place by `grad` (any shape, elementwise: a flat piece will do) and
    returns what is orthogonalised: the momentum itself, or Nesterov's look-ahead (a new tensor)."""
    momentum.lerp_(grad, 1 - config.momentum)
    return grad.lerp(momentum, config.momentum) if config.nesterov else momentum


def apply_update(weights: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> None:
    """W <- W (1 - lr wd) - lr O, in place (torch.optim.Muon's order: the decay, then the update)."""
    if weight_decay:
        weights.mul_(1 - lr * weight_decay)
    weights.add_(update, alpha=-lr)
