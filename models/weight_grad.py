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
from .split_backward import deferred_to, wanted

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


def linear_param_grads(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fp32: bool,
    wants_weight: bool,
    wants_bias: bool,
):
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
    """F.linear whose weight gradient is summed in fp32 (`fp32`), and/or deferred to `work`'s W
    (models/split_backward.py), which then holds x and y's gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp32, work):
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.fp32, ctx.work = (weight, bias), fp32, work
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        param, bias = ctx.params
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        wants = ctx.needs_input_grad[1:3]
        if ctx.work is not None:
            fp32 = ctx.fp32
            ctx.work.add(lambda _: wanted(zip((param, bias), linear_param_grads(grad, x, param, bias, fp32, *wants))))
            return grad_x, None, None, None, None
        grad_w, grad_b = linear_param_grads(grad, x, param, bias, ctx.fp32, *wants)
        return grad_x, grad_w, grad_b, None, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, sum_in_fp32: bool = True
) -> torch.Tensor:
    """F.linear; a marked 16-bit weight (and its bias) get their gradients summed in fp32 (unless
    `sum_in_fp32` is off: autograd's dtype, as F.linear), and in a split backward both are deferred
    to W."""
    fp32, work = sum_in_fp32 and wants_fp32_grad(weight), deferred_to(weight, bias)
    if fp32 or work is not None:
        return _Linear.apply(x, weight, bias, fp32, work)
    return F.linear(x, weight, bias)


class _Embedding(torch.autograd.Function):
    """F.embedding whose table gradient is summed in fp32 (`fp32`), and/or deferred to `work`'s W,
    which then holds the ids and the output's gradient."""

    @staticmethod
    def forward(ctx, ids, weight, fp32, work):
        ctx.save_for_backward(ids)
        ctx.param, ctx.fp32, ctx.work = weight, fp32, work
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        weight, fp32 = ctx.param, ctx.fp32
        if ctx.work is not None:
            ctx.work.add(lambda _: [(weight, _embedding_grad(ids, grad, weight, fp32))])
            return None, None, None, None
        return None, _embedding_grad(ids, grad, weight, fp32), None, None


def _embedding_grad(ids, grad, weight, fp32: bool) -> torch.Tensor:
    """The table's gradient for autograd: with `fp32` summed in fp32 and deposited (zeros returned),
    else F.embedding's own backward kernel."""
    if not fp32:
        return torch.ops.aten.embedding_dense_backward(grad, ids, weight.shape[0], -1, False)
    summed = torch.zeros(weight.shape, dtype=torch.float32, device=grad.device)
    summed.index_add_(0, ids.reshape(-1), _rows(grad).float())
    deposit(weight, summed)
    return zero_grad_for(weight)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding (no padding row); a marked 16-bit table gets its gradient summed in fp32, and in
    a split backward deferred to W."""
    fp32, work = wants_fp32_grad(weight), deferred_to(weight)
    if fp32 or work is not None:
        return _Embedding.apply(ids, weight, fp32, work)
    return F.embedding(ids, weight)


class _AddBias(torch.autograd.Function):
    """y + bias whose gradient is summed in fp32 (`fp32`); in a split backward B sums it (a vector:
    cheaper to keep than the output's gradient) and W hands it over."""

    @staticmethod
    def forward(ctx, y, bias, fp32, work):
        ctx.param, ctx.fp32, ctx.work = bias, fp32, work
        return y + bias

    @staticmethod
    def backward(ctx, grad):
        bias = ctx.param
        summed = _rows(grad).float().sum(dim=0) if ctx.fp32 else _rows(grad).sum(dim=0)
        if ctx.work is None:
            return grad, _bias_grad(bias, summed, ctx.fp32), None, None
        fp32 = ctx.fp32
        ctx.work.add(lambda _: [(bias, _bias_grad(bias, summed, fp32))])
        return grad, None, None, None


def _bias_grad(bias, summed, fp32: bool) -> torch.Tensor:
    if not fp32:
        return summed
    deposit(bias, summed)
    return zero_grad_for(bias)


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y + bias (bias broadcast over the leading dims); a marked 16-bit bias gets an fp32 gradient,
    and in a split backward its gradient is handed over at W."""
    fp32, work = wants_fp32_grad(bias), deferred_to(bias)
    if fp32 or work is not None:
        return _AddBias.apply(y, bias, fp32, work)
    return y + bias


class _Norm(torch.autograd.Function):
    """A LayerNorm / RMSNorm of a split backward: B recomputes the norm from its saved input and
    takes every gradient from autograd, the very ops and values of the plain backward, and keeps the
    weight's and bias's (vectors, cheaper to keep than their inputs) for W to hand over. Saves its
    input only (the plain norm saves more)."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec, work):
        ctx.save_for_backward(x)
        ctx.params, ctx.spec, ctx.work = (weight, bias), spec, work
        return _plain_norm(x, weight, bias, *spec)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        params = [p for p in ctx.params if p is not None]
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_()] + [p.detach().requires_grad_() for p in params]
            weight, bias = inputs[1], inputs[2] if len(inputs) > 2 else None
            grads = torch.autograd.grad(_plain_norm(inputs[0], weight, bias, *ctx.spec), inputs, grad)
        pairs = list(zip(params, grads[1:]))
        ctx.work.add(lambda _: pairs)
        return grads[0], None, None, None, None


def _plain_norm(x, weight, bias, kind: str, shape, eps: float, plus_one: bool):
    scale = weight + 1 if plus_one else weight
    if kind == "rmsnorm":
        return F.rms_norm(x, shape, scale, eps)
    return F.layer_norm(x, shape, scale, bias, eps)


def norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    shape,
    eps: float,
    plus_one: bool = False,
) -> torch.Tensor:
    """F.layer_norm / F.rms_norm (kind "layernorm" / "rmsnorm") scaled by weight (+ 1 with
    `plus_one`, a zero-centred norm); in a split backward its weight's and bias's gradients go to W."""
    work = deferred_to(weight, bias)
    if work is None:
        return _plain_norm(x, weight, bias, kind, tuple(shape), eps, plus_one)
    return _Norm.apply(x, weight, bias, (kind, tuple(shape), eps, plus_one), work)


class Linear(nn.Linear):
    """nn.Linear whose marked 16-bit weight gets an fp32 gradient (module `linear`)."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose marked 16-bit table gets an fp32 gradient (module `embedding`)."""

    def forward(self, ids):
        return embedding(ids, self.weight)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose weight and bias gradients a split backward defers to W (module `norm`);
    `zero_centered_gamma` scales by weight + 1 (Megatron's --apply-layernorm-1p)."""

    zero_centered_gamma = False

    def forward(self, x):
        return norm(x, self.weight, self.bias, "layernorm", self.normalized_shape, self.eps, self.zero_centered_gamma)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose weight gradient a split backward defers to W (module `norm`)."""

    zero_centered_gamma = False

    def forward(self, x):
        return norm(x, self.weight, None, "rmsnorm", self.normalized_shape, self.eps, self.zero_centered_gamma)
