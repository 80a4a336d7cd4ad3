"""Weight gradients summed in fp32 for 16-bit weights (Megatron-LM's gradient-accumulation fusion).

Autograd hands a bf16/fp16 weight its gradient in the weight's dtype: the sum over the tokens of one
microbatch is rounded to 16 bits before anybody accumulates it in fp32. When those tokens are split
(microbatches, context or sequence parallel ranks), each part's sum is rounded on its own, so a
layout's gradient differs from one process's by 16-bit noise. A parameter marked `fp32_grad = True`
instead gets its gradient summed in fp32 by the layers below (linear, embedding, the norms, the fused
output layer), kept in the parameter's ParamInfo (`pending_fp32_grad`) until the code that owns the
parameter's fp32 gradient takes it (megazero.zero.precision.take_grad: that room may not import
this one, so the two attribute names are the protocol). Autograd still receives a zero 16-bit gradient
for the weight, so that per-parameter gradient hooks fire as before; contributions some other op
makes through autograd (a tied weight's other use) arrive there and the taker adds them.

Only code that takes every marked parameter's gradient may set the mark (the ZeRO engine does);
unmarked parameters and fp32 weights take the plain torch ops. Each function's reference is the
torch op it replaces: forward outputs and input gradients are the same ops, the weight gradient is the
same sum without the 16-bit rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from .param_info import param_info, set_param_info

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def marked(param: torch.Tensor | None) -> bool:
    """Whether `param` is a 16-bit parameter whose owner takes fp32 gradients."""
    return param is not None and param.dtype in _SIXTEEN_BIT and param_info(param).fp32_grad


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


def wants_fp32_grad(param: torch.Tensor | None) -> bool:
    """Whether this call should sum `param`'s gradient in fp32. Not inside torch.compile (--compile):
    dynamo cannot trace a backward that hands a tensor to the parameter's owner, so compiled layers
    give autograd's 16-bit gradient, which the owner takes as usual."""
    return marked(param) and param.requires_grad and torch.is_grad_enabled() and not _compiling()


def deposit(param: torch.Tensor, grad32: torch.Tensor) -> None:
    """Adds an fp32 gradient contribution to `param`'s pending one (a weight used twice gets both)."""
    pending = param_info(param).pending_fp32_grad
    if pending is None:
        set_param_info(param, pending_fp32_grad=grad32)
    else:
        pending.add_(grad32)


def zero_grad_for(param: torch.Tensor) -> torch.Tensor:
    """What a layer that deposited `param`'s gradient returns to autograd for it."""
    return torch.zeros_like(param)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (2-D, 16-bit) with an fp32 result: products of 16-bit numbers are exact in fp32, so
    this is the 16-bit GEMM's own fp32 accumulation without its final rounding. CUDA's GEMM writes
    fp32 directly (so does meta, a GPU's stand-in in the dry run: it allocates what CUDA does);
    elsewhere the inputs are widened first."""
    if a.device.type in ("cuda", "meta"):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def linear_param_grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       fp32: bool, wants_weight: bool, wants_bias: bool):
    """(weight's, bias's) gradients of y = x W^T + b for autograd, given y's gradient and x (any
    leading dims): with `fp32` (a marked weight) the sums are taken in fp32 and deposited, and
    autograd gets zeros; else autograd gets them in the weight's dtype. None where not wanted."""
    rows = _rows(grad)
    grad_w = grad_b = None
    if wants_weight:
        if fp32:
            deposit(weight, matmul_fp32(rows.t(), _rows(x)))
            grad_w = zero_grad_for(weight)
        else:
            grad_w = rows.t() @ _rows(x)
    if bias is not None and wants_bias:
        if fp32:
            deposit(bias, rows.float().sum(dim=0))
            grad_b = zero_grad_for(bias)
        else:
            grad_b = rows.sum(dim=0)
    return grad_w, grad_b


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        param, bias = ctx.params
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w, grad_b = linear_param_grads(grad, x, param, bias, True, *ctx.needs_input_grad[1:3])
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; a marked 16-bit weight (and its bias) get their gradients summed in fp32."""
    if wants_fp32_grad(weight):
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.param = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        weight = ctx.param
        grad32 = torch.zeros(weight.shape, dtype=torch.float32, device=grad.device)
        grad32.index_add_(0, ids.reshape(-1), _rows(grad).float())
        deposit(weight, grad32)
        return None, zero_grad_for(weight)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding (no padding row); a marked 16-bit table gets its gradient summed in fp32."""
    if wants_fp32_grad(weight):
        return _Embedding.apply(ids, weight)
    return F.embedding(ids, weight)


class _AddBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias):
        ctx.param = bias
        return y + bias

    @staticmethod
    def backward(ctx, grad):
        deposit(ctx.param, _rows(grad).float().sum(dim=0))
        return grad, zero_grad_for(ctx.param)


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y + bias (bias broadcast over the leading dims); a marked 16-bit bias gets an fp32 gradient."""
    if wants_fp32_grad(bias):
        return _AddBias.apply(y, bias)
    return y + bias


class Linear(nn.Linear):
    """nn.Linear whose marked 16-bit weight gets an fp32 gradient (module `linear`)."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose marked 16-bit table gets an fp32 gradient (module `embedding`)."""

    def forward(self, ids):
        return embedding(ids, self.weight)
