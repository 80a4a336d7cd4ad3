"""Attention on the dry run's device as a GPU computes it.

`F.scaled_dot_product_attention` picks its kernel by device: on CUDA, for bf16 / fp16 with a head
dim up to 256, the flash kernel, which keeps for the backward only the output and the log-sum-exp
(batch, heads, sequence) in fp32; on the meta device no fused kernel is chosen and the op decomposes
into the math path, which casts to fp32 and keeps the (batch, heads, sequence, sequence)
probabilities. A dry run on meta would then count, per layer, a sequence-squared tensor the GPU
never allocates (at sequence 8192 that is most of the activations).

`gpu_attention()` patches `F.scaled_dot_product_attention` so that on meta tensors it runs the
kernel CUDA's dispatcher would choose for the same inputs, through the kernel's own aten op (meta
kernels exist for both, forward and backward, and autograd knows their derivatives):
- flash (`aten._scaled_dot_product_flash_attention`): half precision, head dim <= 256, no mask,
  flash allowed (`torch.backends.cuda.flash_sdp_enabled()`); grouped-query heads as they are;
- memory-efficient (`aten._scaled_dot_product_efficient_attention`): otherwise, when allowed, for
  fp32 or a mask, without grouped-query heads (that kernel takes none);
- the math path (the real function, unchanged) for what neither takes, as on CUDA.
Other devices go to the real function untouched.

The same holds for `F.rms_norm`: on CUDA it runs the fused kernel (`aten._fused_rms_norm`), which
keeps its input and one fp32 reciprocal RMS per row; on meta it decomposes into an fp32 copy of the
input, its square and products, each kept for the backward. `gpu_attention()` also makes meta's
rms_norm the fused kernel's: an output like the input, the fp32 (rows, 1) statistics, and in
backward the gradients of the input and the weight. And for the optimizer step: on a GPU
`ops/adam.py`'s `adam_step` sends the segments to torch's fused Adam(W) kernel (one multi-tensor
launch, nothing allocated but a widened fp32 slice of a 16-bit gradient, `WIDEN_SLICE` elements at
a time); meta has no such kernel registered as supported, so its segments would take the torch
reference ops and a partition-sized denominator. `gpu_attention()` routes meta segments to the
fused kernel, whose meta implementation allocates nothing.

`cpu_kernels()` is the same for a simulated CPU (the dry run's `--simulate-device cpu`, to compare
with a real CPU run's measured memory): SDPA on the CPU runs its flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`: the output and an fp32 log-sum-exp) when there
is no dropout and no mask, else the math path (meta's own decomposition, unchanged); and
models/weight_grad.py's fp32 weight gradient widens both 16-bit inputs to fp32 copies first, as it
does on the CPU (meta otherwise takes CUDA's `mm(..., out_dtype=float32)`). A CPU job's collectives
run on gloo, which (torch's ProcessGroupGloo) reduce-scatters a flat copy of its input and
all-gathers into a flat copy of its output before copying it out, where NCCL works on the tensors
themselves: the fake backend allocates nothing, so under `cpu_kernels()` each reduce-scatter and
all-gather of meta tensors allocates that copy, held by an async op's work until the comm
layer's Handle lets the work go after its wait (as torch's gloo work holds it), a sync op's freed
when the call returns. The optimizer step on CPU segments runs megazero's C++
Adam kernel (ops/adam.py), in place, no temporaries; meta segments would take torch's reference
ops, whose denominator (and scaled gradient) are temporaries the size of the partition: under
`cpu_kernels()` meta segments take the CPU's route, where the kernel's step allocates nothing.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F

aten = torch.ops.aten
FLASH_MAX_HEAD_DIM = 256


def kernel_for(q: torch.Tensor, k: torch.Tensor, attn_mask, enable_gqa: bool) -> str:
    """"flash", "efficient" or "math": what CUDA's SDPA picks for these inputs (the rules that
    decide the memory it keeps; architecture checks aside: a recent GPU is assumed)."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    d = q.shape[-1]
    if (torch.backends.cuda.flash_sdp_enabled() and half and d <= FLASH_MAX_HEAD_DIM and attn_mask is None
            and d % 8 == 0):
        return "flash"
    if torch.backends.cuda.mem_efficient_sdp_enabled() and not (enable_gqa and k.shape[1] != q.shape[1]) \
            and d % (8 if half else 4) == 0:
        return "efficient"
    return "math"


def _on_meta(real):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        extra = {"enable_gqa": True} if enable_gqa else {}
        if query.device.type != "meta":
            return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **extra)
        kernel = kernel_for(query, key, attn_mask, enable_gqa)
        if kernel == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                           scale=scale)[0]
        if kernel == "efficient":
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:      # the kernel takes an additive bias
                bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill(
                    bias.logical_not(), float("-inf"))
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p,
                                                               is_causal, scale=scale)[0]
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, **extra)
    return sdpa


class _FusedRMSNorm(torch.autograd.Function):
    """What CUDA's fused RMSNorm allocates: its output and fp32 per-row statistics, kept for the
    backward with the input and the weight; the backward, the two gradients. Shapes only (meta)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        rows = x.shape[:x.dim() - len(normalized_shape)] + (1,) * len(normalized_shape)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        ctx.has_weight = weight is not None
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        return torch.empty_like(x), None, (torch.empty_like(weight) if ctx.has_weight else None), None


def _rms_norm_on_meta(real):
    def rms_norm(input, normalized_shape, weight=None, eps=None):
        if input.device.type != "meta":
            return real(input, normalized_shape, weight, eps)
        return _FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps)
    return rms_norm


def _fused_route(real):
    def route(device):
        return "fused" if torch.device(device).type == "meta" else real(device)
    return route


def gpu_attention():
    """A context in which attention, RMSNorm and the optimizer step on meta tensors allocate what
    CUDA's kernels do (Adam: torch's fused multi-tensor kernel, as `adam_step` picks on a GPU)."""
    from megazero.ops import adam
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(adam, "_route", _fused_route(adam._route)))
    stack.enter_context(mock.patch.object(F, "rms_norm", _rms_norm_on_meta(F.rms_norm)))
    stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention",
                                          _on_meta(F.scaled_dot_product_attention)))
    return stack


def cpu_kernel_for(attn_mask, dropout_p: float) -> str:
    """"flash" or "math": what the CPU's SDPA picks (torch's sdp_utils_cpp: its flash kernel takes
    no dropout and, here, no mask)."""
    return "flash" if attn_mask is None and not dropout_p else "math"


def _on_meta_as_cpu(real):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        extra = {"enable_gqa": True} if enable_gqa else {}
        if query.device.type == "meta" and cpu_kernel_for(attn_mask, dropout_p) == "flash" \
                and key.shape[1] == query.shape[1]:
            return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal,
                                                                   scale=scale)[0]
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, **extra)
    return sdpa


def _widened_matmul_fp32(real):
    def matmul_fp32(a, b):
        if a.device.type == "meta":
            return a.float() @ b.float()
        return real(a, b)
    return matmul_fp32


class _WorkHoldingCopy:
    """An async op's work that keeps gloo's flat copy alive until the work is let go (the comm
    layer's Handle drops its works after their wait): torch's gloo work holds its copy that long."""

    def __init__(self, work, copy):
        self.work, self.copy = work, copy

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)


def _with_gloo_copy(real, of_output: bool):
    def collective(output, input, *args, **kwargs):
        if output.device.type != "meta":
            return real(output, input, *args, **kwargs)
        copy = torch.empty((output if of_output else input).numel(), dtype=input.dtype, device="meta")
        work = real(output, input, *args, **kwargs)
        return None if work is None else _WorkHoldingCopy(work, copy)   # a sync op's copy dies here
    return collective


def _kernel_adam_on_meta(real):
    from megazero.ops import adam

    def adam_update(param, grad, exp_avg, exp_avg_sq, **kwargs):
        if param.device.type == "meta" and adam.kernel_available():
            return None        # the C++ kernel: in place through raw pointers, nothing allocated
        return real(param, grad, exp_avg, exp_avg_sq, **kwargs)
    return adam_update


def _cpu_route(real):
    def route(device):
        return "cpu" if torch.device(device).type == "meta" else real(device)
    return route


def cpu_kernels():
    """A context in which attention, the fp32 weight gradient and the collectives on meta allocate
    what the CPU's (and gloo's) do."""
    from megazero.core import comm
    from megazero.models import loss, weight_grad
    from megazero.ops import adam
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(adam, "_route", _cpu_route(adam._route)))
    stack.enter_context(mock.patch.object(adam, "adam_update", _kernel_adam_on_meta(adam.adam_update)))
    stack.enter_context(mock.patch.object(comm, "_reduce_scatter_single",
                                          _with_gloo_copy(comm._reduce_scatter_single, of_output=False)))
    stack.enter_context(mock.patch.object(comm, "_all_gather_single",
                                          _with_gloo_copy(comm._all_gather_single, of_output=True)))
    stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention",
                                          _on_meta_as_cpu(F.scaled_dot_product_attention)))
    for module in (weight_grad, loss):        # loss.py imported the function by name
        stack.enter_context(mock.patch.object(module, "matmul_fp32", _widened_matmul_fp32(module.matmul_fp32)))
    return stack


def device_kernels(device: str):
    """The kernels' context for the simulated device: "cuda" (the default) or "cpu"."""
    return gpu_attention() if device == "cuda" else cpu_kernels()
