"""Attention on the dry run's device as a GPU computes it.

`F.scaled_dot_product_attention` picks its kernel by device: on CUDA, for bf16 / fp16 with a head
dim up to 256, the flash kernel, which keeps for the backward only the output and the log-sum-exp
(batch, heads, sequence) in fp32; on the meta device no fused kernel is chosen and the op decomposes
into the math path, which casts to fp32 and keeps the (batch, heads, sequence, sequence)
probabilities. A dry run on meta would then count, per layer, a sequence-squared tensor the GPU
never allocates (at sequence 8192 that is most of the activations).

`gpu_attention()` takes over `F.scaled_dot_product_attention` (through torch's TorchFunctionMode:
the models call torch's functions and import nothing of megazero's) so that on meta tensors it runs the
kernel CUDA's dispatcher would choose for the same inputs, through the kernel's own aten op (meta
kernels exist for both, forward and backward, and autograd knows their derivatives):
- flash (`aten._scaled_dot_product_flash_attention`): half precision, head dim <= 256, no mask,
  flash allowed (`torch.backends.cuda.flash_sdp_enabled()`); grouped-query heads as they are;
- memory-efficient (`aten._scaled_dot_product_efficient_attention`): otherwise, when allowed, for
  fp32 or a mask, without grouped-query heads (that kernel takes none);
- the math path (the real function, unchanged) for what neither takes, as on CUDA.
Other devices go to the real function untouched.

Packed documents (--reset-attention-mask, models/attention.py's `varlen_attention`): on CUDA the
varlen kernels (FlashAttention's, FlexAttention's) keep what the causal kernel over the whole
sequence keeps, the output and one log-sum-exp per query, and no (s x s) mask; `gpu_attention()`
runs meta's varlen call as that one causal call (models/attention.py takes meta for a GPU's
stand-in there, as models/weight_grad.py's matmul_fp32 does; the call goes through the SDPA stand-in
above). A simulated CPU counts the same call: the CPU's own path (one SDPA call per document,
recomputed in the backward) keeps the output alone, so there the dry run counts one fp32
log-sum-exp per query and head more than the CPU keeps.

The same holds for `F.rms_norm`: on CUDA it runs the fused kernel (`aten._fused_rms_norm`), which
keeps its input and one fp32 reciprocal RMS per row; on meta it decomposes into an fp32 copy of the
input, its square and products, each kept for the backward. `gpu_attention()` also makes meta's
rms_norm the fused kernel's: an output like the input, the fp32 (rows, 1) statistics, and in
backward the gradients of the input and the weight. And for the optimizer step: on a GPU
`ops/adam.py`'s `adam_step` sends the segments to torch's fused Adam(W) kernel (one multi-tensor
launch, nothing allocated but a widened fp32 slice of a 16-bit gradient, `WIDEN_SLICE` elements at
a time); meta has no such kernel registered as supported, so its segments would take the torch
reference ops and a partition-sized denominator. `gpu_attention()` routes meta segments to the
fused kernel, whose meta implementation allocates nothing (ops/adam.py's declared `route` seam,
megazero.core.kernels). And for dropout: on CUDA `F.dropout` in training (0 < p < 1) runs the fused
kernel (`aten.native_dropout`), which keeps a bool (1-byte) mask for the backward; on meta (as on the
CPU) it multiplies by a noise tensor of the input's dtype (2 bytes in bf16) and keeps that.
`gpu_attention()` makes meta's dropout CUDA's kernel: `aten.native_dropout` has a meta kernel and
autograd keeps its bool mask.

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
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megazero.core import comm, kernels
from megazero.ops import adam, quantize

aten = torch.ops.aten
FLASH_MAX_HEAD_DIM = 256


def kernel_for(q: torch.Tensor, k: torch.Tensor, attn_mask, enable_gqa: bool) -> str:
    """ "flash", "efficient" or "math": what CUDA's SDPA picks for these inputs (the rules that
    decide the memory it keeps; architecture checks aside: a recent GPU is assumed)."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    d = q.shape[-1]
    if (
        torch.backends.cuda.flash_sdp_enabled()
        and half
        and d <= FLASH_MAX_HEAD_DIM
        and attn_mask is None
        and d % 8 == 0
    ):
        return "flash"
    if (
        torch.backends.cuda.mem_efficient_sdp_enabled()
        and not (enable_gqa and k.shape[1] != q.shape[1])
        and d % (8 if half else 4) == 0
    ):
        return "efficient"
    return "math"


def _on_meta(real):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        extra = {"enable_gqa": True} if enable_gqa else {}
        if query.device.type != "meta":
            return real(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
            )
        kernel = kernel_for(query, key, attn_mask, enable_gqa)
        if kernel == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
        if kernel == "efficient":
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:  # the kernel takes an additive bias
                bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill(
                    bias.logical_not(), float("-inf")
                )
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, grad, dropout_p, is_causal, scale=scale
            )[0]
        return real(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
        )

    return sdpa


class _FusedRMSNorm(torch.autograd.Function):
    """What CUDA's fused RMSNorm allocates: its output and fp32 per-row statistics, kept for the
    backward with the input and the weight; the backward, the two gradients. Shapes only (meta)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        rows = x.shape[: x.dim() - len(normalized_shape)] + (1,) * len(normalized_shape)
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


def _dropout_on_meta(real):
    def dropout(input, p=0.5, training=True, inplace=False):
        if input.device.type != "meta" or not training or inplace or not 0 < p < 1 or input.numel() == 0:
            return real(input, p, training, inplace)
        return aten.native_dropout(input, p, True)[0]  # what at::dropout runs on CUDA

    return dropout


def _fused_route(real):
    def route(device):
        return "fused" if torch.device(device).type == "meta" else real(device)

    return route


class _TorchFunctions(TorchFunctionMode):
    """Runs `replacements[f]` for each call of torch function `f` (the models' attention, RMSNorm,
    dropout and fp32 GEMM), everything else as it is."""

    def __init__(self, replacements: dict):
        super().__init__()
        self.replacements = replacements

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.replacements.get(func, func)(*args, **(kwargs or {}))


def gpu_attention():
    """A context in which attention, RMSNorm, dropout and the optimizer step on meta tensors allocate what
    CUDA's kernels do (Adam: torch's fused multi-tensor kernel, as `adam_step` picks on a GPU)."""
    stack = contextlib.ExitStack()
    stack.enter_context(kernels.swapped((adam.route, _fused_route)))
    stack.enter_context(
        _TorchFunctions(
            {
                F.rms_norm: _rms_norm_on_meta(F.rms_norm),
                F.dropout: _dropout_on_meta(F.dropout),
                F.scaled_dot_product_attention: _on_meta(F.scaled_dot_product_attention),
            }
        )
    )
    return stack


def cpu_kernel_for(attn_mask, dropout_p: float) -> str:
    """ "flash" or "math": what the CPU's SDPA picks (torch's sdp_utils_cpp: its flash kernel takes
    no dropout and, here, no mask)."""
    return "flash" if attn_mask is None and not dropout_p else "math"


def _on_meta_as_cpu(real):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        extra = {"enable_gqa": True} if enable_gqa else {}
        if (
            query.device.type == "meta"
            and cpu_kernel_for(attn_mask, dropout_p) == "flash"
            and key.shape[1] == query.shape[1]
        ):
            return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)[0]
        return real(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
        )

    return sdpa


def _widened_fp32_mm(real):
    """models/weight_grad.matmul_fp32 on meta: the CPU's path (both inputs widened to fp32 copies)
    instead of the `mm(..., out_dtype=float32)` it takes on CUDA and meta."""

    def mm(a, b, *args, out_dtype=None, **kwargs):
        if out_dtype == torch.float32 and a.device.type == "meta":
            return a.float() @ b.float()
        extra = {} if out_dtype is None else {"out_dtype": out_dtype}
        return real(a, b, *args, **extra, **kwargs)

    return mm


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
        return None if work is None else _WorkHoldingCopy(work, copy)  # a sync op's copy dies here

    return collective


def _kernel_adam_on_meta(real):
    def adam_update(param, grad, exp_avg, exp_avg_sq, **kwargs):
        if param.device.type == "meta" and adam.kernel_available():
            return None  # the C++ kernel: in place through raw pointers, nothing allocated
        return real(param, grad, exp_avg, exp_avg_sq, **kwargs)

    return adam_update


def _cpu_route(real):
    def route(device):
        return "cpu" if torch.device(device).type == "meta" else real(device)

    return route


def cpu_kernels():
    """A context in which attention, the fp32 weight gradient, the collectives and the quantization
    kernels (the C++ path's row copies and staging, not Triton's) on meta allocate what the CPU's
    (and gloo's) do."""
    stack = contextlib.ExitStack()
    stack.enter_context(
        kernels.swapped(
            (adam.route, _cpu_route),
            (quantize.route, _cpu_route),
            (adam.adam_update, _kernel_adam_on_meta),
            (comm.reduce_scatter_single, lambda real: _with_gloo_copy(real, of_output=False)),
            (comm.all_gather_single, lambda real: _with_gloo_copy(real, of_output=True)),
        )
    )
    stack.enter_context(
        _TorchFunctions(
            {
                F.scaled_dot_product_attention: _on_meta_as_cpu(F.scaled_dot_product_attention),
                torch.mm: _widened_fp32_mm(torch.mm),
            }
        )
    )
    return stack


def device_kernels(device: str):
    """The kernels' context for the simulated device: "cuda" (the default) or "cpu"."""
    return gpu_attention() if device == "cuda" else cpu_kernels()
