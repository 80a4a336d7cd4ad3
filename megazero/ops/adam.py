"""Adam / AdamW on flat fp32 partitions: the optimizer math every ZeRO stage shares.

The moments (exp_avg, exp_avg_sq) are fp32 or bf16, each on its own (Megatron-LM's precision-aware
optimizer, --exp-avg-dtype / --exp-avg-sq-dtype). A bf16 moment is widened exactly, the step is the
fp32 step below (the parameter update reads this step's fp32 moments), and the new moment is stored
rounded to nearest even, as `.to(torch.bfloat16)` rounds and Transformer Engine's FusedAdam stores
its bf16 states. Round to nearest even rather than stochastic rounding: it is deterministic and
needs nothing from the layout, so every ZeRO partitioning and every implementation below stores
the same bits (a stochastic rounding would need a random stream keyed by each element's global
position to stay layout-invariant). The parameter stays fp32.

Three implementations of one update, all in place:

- `adam_update_reference`: torch ops in torch.optim.AdamW's exact order, so a single-process run
  matches torch's AdamW elementwise. It is the oracle for the two kernels and the last fallback.
- the fused C++ kernel in the optional extension `megazero._C` (csrc/cpu_adam*.cpp): one pass over
  memory, OpenMP threads, AVX-512 / AVX2+FMA / scalar copies of the loop chosen at run time. Against
  the reference on torch's AVX2/AVX-512 CPU kernels, exp_avg and exp_avg_sq are bitwise equal and
  param is within a few ulps, because torch's MKL sqrt is not correctly rounded and the kernel's is
  (tests/ops/test_adam.py states the bound). Every copy of the loop gives the same bits.
- torch's fused Adam(W) kernel (`torch._fused_adamw_` / `torch._fused_adam_`, what
  torch.optim.AdamW(fused=True) runs; CUDA since torch 2.0, CPU since 2.4): one multi-tensor launch
  per list of segments, no temporaries. Its moments equal the reference's bitwise; its parameter
  update computes the bias corrections and the step size in its own order, so param agrees to a
  few ulps (~2e-7 relative; tests/ops/test_adam_fused.py). It writes the scaled gradient back into
  `grad` (as torch's unscale does): the step consumes the gradients.

`adam_update` (one segment; what zero/offload.py calls on host states) picks the C++ kernel when
it is built, not disabled by `MEGAZERO_DISABLE_CPP_ADAM=1`, and every tensor is a contiguous CPU
tensor of a supported dtype; otherwise the reference. `adam_step` (many segments; what
zero/storage.py calls) sends CPU segments through `adam_update` and the segments of any other device
(a GPU) to torch's fused kernel, grouped by weight decay, when torch has one for that device; else
the reference. `MEGAZERO_CPU_ADAM_ISA=avx512|avx2|scalar` forces one copy of the C++ loop (read at
every call; an unsupported name is a UsageError). With `param_copy` the updated parameter is also
written rounded to a 16-bit dtype: by the C++ kernel in the same pass when it can; torch's fused
kernel has no such output, so there it is one multi-tensor copy after the update. This module does
not decide which segments get weight decay or how the grad scale is formed; the callers do.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from megazero.core import kernels
from megazero.core.errors import UsageError
from megazero.ops.adam_config import AdamConfig

try:
    # Import after torch: the extension's OpenMP runtime then resolves to the libgomp torch already
    # loaded, so the process keeps one thread pool instead of two competing ones.
    import megazero._C as _cpp

    CPP_IMPORT_ERROR = ""
except ImportError as error:  # not built (no compiler at install time): the torch reference serves
    _cpp = None
    CPP_IMPORT_ERROR = str(error)

# Must match the Dtype enum in csrc/cpu_adam.h; the fused parameter copy takes the 16-bit ones.
_GRAD_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_COPY_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2}
STATE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the Adam moments' dtypes, and their codes
_NO_COPY = -1
ISA_ENV = "MEGAZERO_CPU_ADAM_ISA"


def kernel_available() -> bool:
    """True when the C++ kernel is built and not switched off with MEGAZERO_DISABLE_CPP_ADAM=1."""
    return _cpp is not None and os.environ.get("MEGAZERO_DISABLE_CPP_ADAM", "0") != "1"


def kernel_info() -> dict:
    """What the installed kernel is, for logs and benchmarks: built / enabled / the loop copy a
    call takes now (`isa`), those this CPU can run (`isas`) / OpenMP."""
    if _cpp is None:
        return {"built": False, "enabled": False, "error": CPP_IMPORT_ERROR}
    return {
        "built": True,
        "enabled": kernel_available(),
        "isa": selected_isa() or _cpp.kernel_isa(),
        "isas": list(_cpp.supported_isas()),
        "openmp": _cpp.built_with_openmp(),
    }


def selected_isa() -> str:
    """The loop copy forced by MEGAZERO_CPU_ADAM_ISA, or "" (the best this CPU supports)."""
    name = os.environ.get(ISA_ENV, "").strip().lower()
    if name in ("", "auto") or _cpp is None:
        return ""
    supported = list(_cpp.supported_isas())
    if name not in supported:
        raise UsageError(
            f"{ISA_ENV}={name} is not available on this CPU/build; use one of {', '.join(supported)} or unset it"
        )
    return name


@kernels.kernel("adam update")
def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    config: AdamConfig,
    weight_decay: float,
    grad_scale: float = 1.0,
    param_copy: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """One Adam(W) step on fp32 `param` in place; `grad` (fp32, bf16 or fp16) is multiplied by
    `grad_scale` first (loss-scale removal and clipping folded into one multiply). Uses the C++
    kernel when it can (see module docstring); results agree to a few ulps either way.

    `param_copy`, if given, receives the updated `param` converted to its dtype with round to
    nearest even, i.e. exactly `param_copy.copy_(param)` after the step, whatever its dtype or
    device. It must have param's number of elements and must not overlap param or the states.
    When it is a contiguous CPU bf16/fp16 tensor and the kernel runs, the kernel writes it in the
    same pass as the update (no second read of param); otherwise it is copied afterwards.
    `num_threads`: the kernel's OpenMP threads (default torch.get_num_threads()), for a caller
    stepping in a background thread beside the training's own."""
    if param_copy is not None:
        _check_param_copy(param_copy, (param, grad, exp_avg, exp_avg_sq))
    if not (kernel_available() and _kernel_accepts(param, grad, exp_avg, exp_avg_sq)):
        adam_update_reference(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=lr,
            config=config,
            weight_decay=weight_decay,
            grad_scale=grad_scale,
        )
        if param_copy is not None:
            param_copy.copy_(param)
        return
    fused_copy = param_copy if param_copy is not None and _fusable_copy(param_copy) else None
    _cpp.adam_update(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        param.numel(),
        _GRAD_DTYPE_CODES[grad.dtype],
        int(step),
        float(lr),
        float(config.beta1),
        float(config.beta2),
        float(config.eps),
        float(weight_decay),
        bool(config.decoupled_weight_decay),
        float(grad_scale),
        int(num_threads or torch.get_num_threads()),
        0 if fused_copy is None else fused_copy.data_ptr(),
        _NO_COPY if fused_copy is None else _COPY_DTYPE_CODES[fused_copy.dtype],
        selected_isa(),
        STATE_DTYPES[exp_avg.dtype],
        STATE_DTYPES[exp_avg_sq.dtype],
    )
    # The kernel writes through raw pointers, which autograd cannot see; bump the version
    # counters as torch's in-place ops would, so a stale saved tensor is still caught.
    written = (param, exp_avg, exp_avg_sq)
    torch.autograd.graph.increment_version(written if fused_copy is None else written + (fused_copy,))
    if param_copy is not None and fused_copy is None:
        param_copy.copy_(param)


def _check_param_copy(param_copy: torch.Tensor, others: tuple) -> None:
    """param_copy must match param's size and share memory with none of the step's buffers."""
    param = others[0]
    if param_copy.numel() != param.numel():
        raise UsageError(
            f"adam_update: param_copy has {param_copy.numel()} elements and param "
            f"{param.numel()}; pass a copy of the same size"
        )
    if any(t.device == param_copy.device and _overlaps(t, param_copy) for t in others):
        raise UsageError("adam_update: param_copy overlaps param, grad or an Adam state; give it its own buffer")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte address a tensor can touch (its strided extent, a superset for views);
    on meta, whose storages have no memory (every pointer is 0), from its storage's start."""
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size() if t.device.type == "meta" else t.data_ptr()
    return start, start + (extent + 1) * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.device.type == "meta" and a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False
    (a_begin, a_end), (b_begin, b_end) = _byte_span(a), _byte_span(b)
    return a_begin < b_end and b_begin < a_end


def _fusable_copy(param_copy: torch.Tensor) -> bool:
    """The kernel writes bf16/fp16 contiguous CPU copies itself, unless autograd would record
    the write (then copy_ runs, and raises where torch's in-place ops raise)."""
    return (
        param_copy.device.type == "cpu"
        and param_copy.dtype in _COPY_DTYPE_CODES
        and param_copy.is_contiguous()
        and not (torch.is_grad_enabled() and param_copy.requires_grad)
    )


def _kernel_accepts(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """The kernel sees four flat buffers of one length; anything else goes to the reference.
    So do updates autograd would record (grad mode on, a state requiring grad): its checks and
    graph then behave exactly as with torch's in-place ops."""
    states = (param, exp_avg, exp_avg_sq)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in states) or param.dtype != torch.float32:
        return False
    if exp_avg.dtype not in STATE_DTYPES or exp_avg_sq.dtype not in STATE_DTYPES:
        return False
    if grad.device.type != "cpu" or grad.dtype not in _GRAD_DTYPE_CODES or not grad.is_contiguous():
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in states):
        return False
    return grad.numel() == param.numel() == exp_avg.numel() == exp_avg_sq.numel()


def adam_update_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    config: AdamConfig,
    weight_decay: float,
    grad_scale: float = 1.0,
    sqrt=torch.sqrt,
) -> None:
    """The torch reference for `adam_update`, op for op torch.optim.AdamW (or Adam with L2 when
    `config.decoupled_weight_decay` is False). It allocates temporaries the size of its input
    (the fp32 grad, the denominator, an fp32 copy of a bf16 moment); the kernel allocates none.
    `sqrt` is replaceable so a test can swap in a correctly rounded one and show it is the only
    difference from the kernel. bf16 moments: widened, stepped in fp32, stored rounded (module
    docstring)."""
    wide = [t if t.dtype == torch.float32 else t.float() for t in (exp_avg, exp_avg_sq)]
    _fp32_step(
        param, grad, *wide, step=step, lr=lr, config=config, weight_decay=weight_decay, grad_scale=grad_scale, sqrt=sqrt
    )
    for state, value in zip((exp_avg, exp_avg_sq), wide):
        if state is not value:
            state.copy_(value)  # round to nearest even


def _fp32_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, config, weight_decay, grad_scale, sqrt):
    if grad.dtype != torch.float32 or grad_scale != 1.0:
        grad = grad.float().mul_(grad_scale) if grad.dtype != torch.float32 else grad * grad_scale
    if weight_decay != 0.0:
        if config.decoupled_weight_decay:
            param.mul_(1.0 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    beta1, beta2 = config.beta1, config.beta2
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1**step)
    # `** 0.5` rather than math.sqrt: torch's AdamW calls pow, and the two may round differently.
    denom = sqrt(exp_avg_sq).div_((1.0 - beta2**step) ** 0.5).add_(config.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


# --- many segments at once: the engine's step ------------------------------------------------------
class AdamSegment(NamedTuple):
    """One contiguous piece of a partition: fp32 `param` (the master), its gradient and moments, the
    weight decay it takes, optionally the 16-bit copy of `param` to refresh (see adam_update), and
    its own learning rate (None: the step's)."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    weight_decay: float
    param_copy: torch.Tensor | None = None
    lr: float | None = None


def lr_of(lr, group: int) -> float:
    """Group `group`'s learning rate from a step's `lr`: one float for every parameter, or a
    sequence with one per lr group (Megatron's --decoupled-lr: the embedding and output layer's)."""
    return float(lr) if isinstance(lr, (int, float)) else float(lr[group])


# Gradients and moments in another dtype than fp32 are widened for torch's fused kernel in slices of
# this many elements (its lists take one dtype, and it refuses bf16 moments beside an fp32
# parameter), so the step never holds an fp32 copy of a whole partition: at most three slices.
WIDEN_SLICE = 1 << 24


def fused_available(device) -> bool:
    """Whether torch has a fused Adam kernel for `device`'s type (torch.optim.AdamW(fused=True)'s)."""
    kind = torch.device(device).type
    if getattr(torch, "_fused_adamw_", None) is None:
        return False
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return kind in _get_fused_kernels_supported_devices()
    except ImportError:  # torch < 2.2 names no list: its fused kernel is CUDA's
        return kind == "cuda"


@kernels.kernel("adam route")
def route(device: torch.device) -> str:
    """Which implementation `adam_step` uses for segments on `device`: "cpu" (adam_update: the C++
    kernel or the reference), "fused" (torch's kernel) or "reference"."""
    if device.type == "cpu":
        return "cpu"
    return "fused" if fused_available(device) else "reference"


def adam_step(
    segments: list[AdamSegment], *, step: int, lr: float, config: AdamConfig, grad_scale: float = 1.0
) -> None:
    """One Adam(W) step on every segment (see the module docstring for who computes it)."""
    by_route: dict[str, list[AdamSegment]] = {}
    for seg in segments:
        by_route.setdefault(route(seg.param.device), []).append(seg)
    for way, group in by_route.items():
        if way == "fused":
            adam_update_fused(group, step=step, lr=lr, config=config, grad_scale=grad_scale)
            continue
        for seg in group:
            kw = dict(
                step=step,
                lr=lr if seg.lr is None else seg.lr,
                config=config,
                weight_decay=seg.weight_decay,
                grad_scale=grad_scale,
            )
            if way == "cpu":
                adam_update(*seg[:4], param_copy=seg.param_copy, **kw)
            else:
                adam_update_reference(*seg[:4], **kw)
                if seg.param_copy is not None:
                    seg.param_copy.copy_(seg.param)


def adam_update_fused(
    segments: list[AdamSegment], *, step: int, lr: float, config: AdamConfig, grad_scale: float = 1.0
) -> None:
    """`adam_update` on every segment with torch's fused kernel: one call per (device, weight decay, lr),
    the bias corrections from a step tensor, then the 16-bit copies in one multi-tensor copy. Runs
    on any device torch has the kernel for (CPU included, where it is tested).

    The kernel unscales by dividing by a grad-scale tensor (and writes the quotient into `grad`).
    For a power of two (the fp16 loss scale alone) that is the reference's multiply, bit for bit;
    any other scale (clipping) is multiplied into the fp32 gradients first, in place, as the
    reference does, so the moments stay bitwise the reference's either way."""
    fused = torch._fused_adamw_ if config.decoupled_weight_decay else torch._fused_adam_
    groups: dict[tuple, list[AdamSegment]] = {}
    for seg in segments:
        if seg.param.numel() == 0:
            continue
        if seg.param_copy is not None:
            _check_param_copy(seg.param_copy, seg[:4])
        key = (seg.param.device, seg.weight_decay, lr if seg.lr is None else seg.lr)
        groups.setdefault(key, []).append(seg)
    for (device, weight_decay, group_lr), group in groups.items():
        # Scalars made on the device by a fill (no host-to-device copy, no sync).
        steps = torch.full((), float(step), dtype=torch.float32, device=device)
        divide = grad_scale != 1.0 and math.frexp(grad_scale)[0] == 0.5
        divisor = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=device) if divide else None
        multiply = grad_scale != 1.0 and not divide
        kw = dict(
            lr=float(group_lr),
            beta1=float(config.beta1),
            beta2=float(config.beta2),
            weight_decay=float(weight_decay),
            eps=float(config.eps),
            amsgrad=False,
            maximize=False,
            grad_scale=divisor,
            found_inf=None,
        )
        lists = ([], [], [], [])  # params, grads, exp_avgs, exp_avg_sqs
        for seg in group:
            for start, end in _slices(seg):
                piece = [t[start:end] for t in seg[:4]]
                if any(t.dtype != torch.float32 for t in piece[1:]):
                    _fused_widened(fused, piece, steps, grad_scale if multiply else 1.0, kw)
                    continue
                for items, t in zip(lists, piece):
                    items.append(t)
        if lists[0]:
            if multiply:
                torch._foreach_mul_(lists[1], grad_scale)
            fused(*lists, [], [steps] * len(lists[0]), **kw)
        _copy_all(
            [s.param_copy for s in group if s.param_copy is not None],
            [s.param for s in group if s.param_copy is not None],
        )


def _fused_widened(fused, piece: list[torch.Tensor], steps: torch.Tensor, multiply: float, kw: dict) -> None:
    """The fused kernel on one slice whose gradient or moments are not fp32: each of those widened
    to a WIDEN_SLICE temporary, stepped at once, and the moments stored back rounded."""
    wide = [piece[0]] + [t if t.dtype == torch.float32 else t.float() for t in piece[1:]]
    if multiply != 1.0:
        wide[1].mul_(multiply)  # in place on an fp32 gradient, as the multi-tensor path does
    fused(*([t] for t in wide), [], [steps], **kw)
    for state, value in zip(piece[2:], wide[2:]):
        if state is not value:
            state.copy_(value)  # round to nearest even


def _slices(seg: AdamSegment) -> list[tuple[int, int]]:
    n = seg.param.numel()
    if all(t.dtype == torch.float32 for t in seg[1:4]):
        return [(0, n)]
    return [(s, min(s + WIDEN_SLICE, n)) for s in range(0, n, WIDEN_SLICE)]


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i].copy_(sources[i]) for all i, as one multi-tensor copy where torch has it."""
    if not targets:
        return
    foreach_copy = getattr(torch, "_foreach_copy_", None)  # torch >= 2.1
    if foreach_copy is not None:
        foreach_copy(targets, sources)
        return
    for target, source in zip(targets, sources):
        target.copy_(source)
