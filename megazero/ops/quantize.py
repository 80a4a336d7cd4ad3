"""Block-wise int8 / int4 quantization for ZeRO++'s quantized weight gathers (qwZ) and gradient
reductions (qgZ): `quantize`, `dequantize`, `dequantize_reduce`, their row forms for the collectives
(`quantize_rows`, `dequantize_rows`: many rows at once, from strided views and into a packed send or
receive buffer, `packed_rows`), and a pure-torch reference of each.

This module owns the operations' argument checks and the choice of implementation; the format
(QuantizedTensor, its blocks, codes, scales and packed rows) is megazero/ops/quantize_format.py's.
It does not decide what gets quantized or when (that is the ZeRO engine's business) and moves no
data between ranks.

Non-finite values. A block holding a NaN or an infinity, or whose max - min overflows (asymmetric),
gets scale NaN (and min NaN), codes 0: every value it dequantizes to is NaN, so a gradient that
overflowed reaches the step's non-finite check through qgZ's reduction (before this rule a NaN was
skipped by the min and max and came out finite, -max|block|). Which NaN (sign, payload) is not part
of the format.

Error: |x - x'| <= scale / 2 from the rounding of the code, plus fp32 rounding of the ops above
(a few ulps of the block's largest magnitude) and, for a bf16 output, the bf16 rounding of x'.

Implementations, by the tensors' device (`route`, a declared seam: the dry run simulating a CPU takes the C++ path's), all bitwise equal to the references here:
- CPU: the C++ extension `megazero._quant` (csrc/quantize*.cpp: AVX-512, AVX2 or scalar loops picked
  at run time, `torch.get_num_threads()` OpenMP threads). When it is not built, asking for
  quantization of a CPU tensor is an error naming the build command, never a silent slow path.
  `MEGAZERO_QUANT_ISA=avx512|avx2|scalar` (or the `isa` argument) forces one loop. Its row forms
  copy strided rows and gather codes into packed buffers around the kernels.
- any other device (a GPU): the Triton kernels of megazero/ops/quantize_triton.py, which read the
  strided rows and write the packed buffers in place and allocate nothing of their own. Triton is an
  optional dependency (`pip install megazero[triton]`); without it, a GPU tensor is an error naming
  that command.
- the meta device (the dry run's GPU): the Triton route with nothing to compute, so its launches are
  skipped and the memory is what the callers allocate (the dry run simulating a CPU routes meta to
  the CPU's path, whose C++ calls are skipped alike).
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import torch

from megazero.core import kernels
from megazero.core.errors import UsageError
from megazero.ops.quantize_format import (  # noqa: F401 - the format's names, re-exported: callers take them from here
    QuantizedTensor,
    _check_format,
    _check_quantized,
    _empty_quantized,
    packed_row_bytes,
    packed_rows,
    stack,
)

ISA_ENV = "MEGAZERO_QUANT_ISA"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
BUILD_HINT = "build it with `pip install --no-deps -e .` in the megazero checkout (needs a C++ compiler)"
TRITON_HINT = "install Triton with `pip install megazero[triton]` (torch's CUDA wheels bring it)"


def quantize(
    x: torch.Tensor, bits: int = 8, block_size: int = 2048, symmetric: bool = True, isa: str | None = None
) -> QuantizedTensor:
    """Block-quantizes the flattened fp32 or bf16 tensor `x`; the result lives on x's device."""
    _check_format(bits, block_size)
    if x.dtype not in _DTYPE_CODES:
        raise UsageError(f"quantize: x is {x.dtype}; pass fp32 or bf16 (convert with .float())")
    flat = x.reshape(-1)
    out = _empty_quantized(flat.numel(), bits, block_size, symmetric, (), flat.device)
    if route(flat.device) == "triton":
        _triton("quantize_rows", flat.view(1, 1, -1), _as_rows(out), out.num_blocks)
        return out
    flat = flat.contiguous()
    _cpp(
        "quantize",
        flat,
        flat.data_ptr(),
        _DTYPE_CODES[flat.dtype],
        flat.numel(),
        out.codes.data_ptr(),
        out.scales.data_ptr(),
        _ptr(out.mins),
        bits,
        block_size,
        symmetric,
        torch.get_num_threads(),
        _isa(isa),
    )
    return out


def dequantize(
    q: QuantizedTensor, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None, isa: str | None = None
) -> torch.Tensor:
    """The numel values of the 1-D quantized tensor `q` as a 1-D fp32 or bf16 tensor (into `out`
    when given: contiguous, numel long, of `dtype`, on q's device)."""
    _check_quantized(q, chunks=None)
    if dtype not in _DTYPE_CODES:
        raise UsageError(f"dequantize: dtype {dtype} is not supported; use torch.float32 or torch.bfloat16")
    out = _check_out(out, q.numel, dtype, q.codes.device, "dequantize")
    if route(out.device) == "triton":
        _triton("dequantize_rows", _as_rows(q), out.view(1, -1), q.num_blocks, False)
        return out
    _cpp(
        "dequantize",
        out,
        q.codes.data_ptr(),
        q.scales.data_ptr(),
        _ptr(q.mins),
        q.numel,
        q.bits,
        q.block_size,
        q.symmetric,
        out.data_ptr(),
        _DTYPE_CODES[dtype],
        torch.get_num_threads(),
        _isa(isa),
    )
    return out


def dequantize_reduce(q: QuantizedTensor, out: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """Sum over k of the dequantized chunks of the stacked `q` (codes [k, bytes]: rows contiguous, at
    any distance), in fp32, added in chunk order: ((0 + x'_0) + x'_1) + ...; the reduction step of a
    quantized reduce-scatter. `out` (default: new fp32) may be fp32 or bf16: the sum rounded once."""
    if q.codes.dim() != 2:
        raise UsageError(
            f"dequantize_reduce: codes must be [k, bytes], got shape {tuple(q.codes.shape)}; "
            f"stack the chunks first (megazero.ops.quantize.stack)"
        )
    chunks = q.codes.shape[0]
    _check_quantized(q, chunks=chunks, rows=True)
    dtype = torch.float32 if out is None else out.dtype
    if dtype not in _DTYPE_CODES:
        raise UsageError(f"dequantize_reduce: out is {dtype}; pass fp32 or bf16")
    out = _check_out(out, q.numel, dtype, q.codes.device, "dequantize_reduce")
    if chunks == 0:
        return out.zero_()
    if route(out.device) == "triton":
        _triton("dequantize_rows", q, out.view(1, -1), q.num_blocks, True)
        return out
    q = dataclasses.replace(
        q, codes=q.codes.contiguous(), scales=q.scales.contiguous(), mins=None if q.symmetric else q.mins.contiguous()
    )
    total = out if dtype == torch.float32 else torch.empty(q.numel, dtype=torch.float32, device=out.device)
    _cpp(
        "dequantize_reduce",
        total,
        q.codes.data_ptr(),
        q.scales.data_ptr(),
        _ptr(q.mins),
        chunks,
        q.numel,
        q.bits,
        q.block_size,
        q.symmetric,
        total.data_ptr(),
        torch.get_num_threads(),
        _isa(isa),
    )
    return out if total is out else out.copy_(total)


def quantize_rows(rows: torch.Tensor, out: QuantizedTensor) -> QuantizedTensor:
    """Quantizes each row of `rows` ([R, segments, elements], any strides: row r is rows[r] read in
    order, out.numel = segments x elements values) into row r of `out` (codes [R, bytes], scales
    [R, blocks], rows contiguous: a `packed_rows` view, or `quantize`'s fields stacked)."""
    if rows.dim() != 3 or rows.shape[1] * rows.shape[2] != out.numel or rows.dtype not in _DTYPE_CODES:
        raise UsageError(
            f"quantize_rows: rows is {rows.dtype} {tuple(rows.shape)}; give fp32 or bf16 "
            f"[rows, segments, elements] with segments x elements = {out.numel}"
        )
    _check_quantized(out, chunks=rows.shape[0], rows=True)
    if route(rows.device) == "triton":
        _triton("quantize_rows", rows, out, out.num_blocks)
        return out
    for r in range(rows.shape[0]):  # each row quantized as its own tensor, then placed
        q = quantize(rows[r].reshape(-1), out.bits, out.block_size, out.symmetric)
        out.codes[r].copy_(q.codes)
        out.scales[r].copy_(q.scales)
        if not out.symmetric:
            out.mins[r].copy_(q.mins)
    return out


def dequantize_rows(q: QuantizedTensor, out: torch.Tensor) -> torch.Tensor:
    """out[r] = the values of row r of `q` (codes [R, bytes], rows contiguous: a `packed_rows` view
    of a receive buffer); `out` fp32 or bf16 [R, q.numel], its rows contiguous."""
    if (
        out.dim() != 2
        or out.shape != (q.codes.shape[0], q.numel)
        or out.dtype not in _DTYPE_CODES
        or out.stride(1) != 1
    ):
        raise UsageError(
            f"dequantize_rows: out is {out.dtype} {tuple(out.shape)}; give fp32 or bf16 "
            f"[{q.codes.shape[0]}, {q.numel}] with contiguous rows"
        )
    _check_quantized(q, chunks=q.codes.shape[0], rows=True)
    if route(out.device) == "triton":
        _triton("dequantize_rows", q, out, q.num_blocks, False)
        return out
    for r in range(out.shape[0]):
        row = dataclasses.replace(q, codes=q.codes[r], scales=q.scales[r], mins=None if q.symmetric else q.mins[r])
        out[r].copy_(dequantize(row, out.dtype))
    return out


def kernel_info() -> dict:
    """What the C++ path would do here: the loops this CPU can run, best first, and OpenMP."""
    ext = _extension()
    return {"isas": list(ext.supported_isas()), "openmp": ext.built_with_openmp()}


def triton_info(device) -> dict:
    """What the Triton path needs on `device`: a UsageError naming the install when Triton is missing
    (checked where the engine is built rather than at the first reduction)."""
    if torch.device(device).type in ("cpu", "meta"):
        return {}
    module = _triton_module()
    return {"triton": module.triton.__version__}


# ---- the torch references (test oracles) ----


def _qmax(bits: int, symmetric: bool) -> int:
    return (1 << (bits - 1)) - 1 if symmetric else (1 << bits) - 1


def quantize_reference(x: torch.Tensor, bits: int, block_size: int, symmetric: bool) -> QuantizedTensor:
    """`quantize` in torch ops, op for op what the C++ loops compute."""
    flat = x.reshape(-1).float()
    numel = flat.numel()
    out = _empty_quantized(numel, bits, block_size, symmetric, (), flat.device)
    if numel == 0:
        return out
    blocks = out.num_blocks
    # Pad with a value of the last block itself, so its min and max do not change.
    pad = flat[(blocks - 1) * block_size].expand(blocks * block_size - numel)
    padded = torch.cat([flat, pad]).view(blocks, block_size)
    finite = torch.isfinite(padded)
    padded = torch.where(finite, padded, 0.0)  # a non-finite block's values do not matter
    lo, hi = padded.amin(dim=1), padded.amax(dim=1)
    qmax = _qmax(bits, symmetric)
    mn = torch.zeros_like(lo) if symmetric else lo + 0.0  # -0 becomes +0, as in the kernel
    scale = (torch.maximum(-lo, hi) if symmetric else hi - mn) / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    bad = ~finite.all(dim=1) | ~torch.isfinite(scale)
    safe = torch.where(bad, torch.ones_like(scale), scale)
    shifted = padded if symmetric else padded - mn[:, None]
    codes = torch.round(shifted / safe[:, None]).to(torch.int32).clamp(-qmax if symmetric else 0, qmax)
    codes = torch.where(bad[:, None], 0, codes)
    out.scales.copy_(torch.where(bad, torch.nan, scale))
    if not symmetric:
        out.mins.copy_(torch.where(bad, torch.nan, mn))
    codes = codes.view(-1)
    codes[numel:] = 0
    if bits == 8:
        packed = codes.to(torch.int8).view(torch.uint8) if symmetric else codes.to(torch.uint8)
    else:
        nibbles = (codes & 0xF).view(-1, 2)
        packed = (nibbles[:, 0] | (nibbles[:, 1] << 4)).to(torch.uint8)
    out.codes.copy_(packed)
    return out


def _reference_values(q: QuantizedTensor) -> torch.Tensor:
    """fp32 values of q, shaped [..., numel] like q.scales' leading dimensions."""
    lead = q.codes.shape[:-1]
    if q.bits == 8:
        ints = q.codes.view(torch.int8).to(torch.int32) if q.symmetric else q.codes.to(torch.int32)
    else:
        byte = q.codes.to(torch.int32)
        ints = torch.stack([byte & 0xF, byte >> 4], dim=-1).flatten(-2)
        if q.symmetric:
            ints = (ints ^ 8) - 8
    values = ints.view(*lead, q.num_blocks, q.block_size).float() * q.scales[..., None]
    if not q.symmetric:
        values = values + q.mins[..., None]
    return values.flatten(-2)[..., : q.numel]


def dequantize_reference(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize` in torch ops."""
    return _reference_values(q).to(dtype)


def dequantize_reduce_reference(q: QuantizedTensor) -> torch.Tensor:
    """`dequantize_reduce` in torch ops, adding the chunks in the kernel's order."""
    values = _reference_values(q)
    total = torch.zeros(q.numel, dtype=torch.float32, device=q.codes.device)
    for chunk in values:
        total = total + chunk
    return total


# ---- routes, checks and plumbing ----


@kernels.kernel("quantize route")
def route(device: torch.device) -> str:
    """Which kernels run on `device`: "cpu" (the C++ loops) or "triton" (any other device; on meta, the
    dry run's GPU, launches are skipped)."""
    return "cpu" if device.type == "cpu" else "triton"


def _cpp(kernel: str, written: torch.Tensor, *args) -> None:
    """megazero._quant's `kernel` writing into `written`'s device; on meta (the dry run simulating a
    CPU) nothing is computed: the loops write in place and allocate nothing."""
    ext = _extension()
    if written.device.type != "meta":
        getattr(ext, kernel)(*args)


def _triton_module():
    try:
        return importlib.import_module("megazero.ops.quantize_triton")
    except ImportError as err:
        raise UsageError(
            f"quantization of GPU tensors runs Triton kernels, and Triton is not importable ({err}); {TRITON_HINT}"
        ) from None


def _triton(kernel: str, *args) -> None:
    """quantize_triton's `kernel`; on meta skipped without importing Triton (nothing to compute)."""
    if all(t.device.type == "meta" for t in args if isinstance(t, torch.Tensor)):
        return
    getattr(_triton_module(), kernel)(*args)


def _as_rows(q: QuantizedTensor) -> QuantizedTensor:
    """1-D q as one row."""
    return dataclasses.replace(
        q, codes=q.codes.view(1, -1), scales=q.scales.view(1, -1), mins=None if q.symmetric else q.mins.view(1, -1)
    )


def _extension():
    try:
        quant = importlib.import_module("megazero._quant")  # cached by Python after the first call
    except ImportError as err:
        raise UsageError(
            f"quantization needs the C++ extension megazero._quant, which is not built ({err}); {BUILD_HINT}"
        ) from None
    return quant


def _isa(isa: str | None) -> str:
    return os.environ.get(ISA_ENV, "") if isa is None else isa


def _ptr(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _check_out(out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device, op: str) -> torch.Tensor:
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if out.numel() != numel or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise UsageError(
            f"{op}: out is {out.dtype} {tuple(out.shape)} on {out.device}; it must be a "
            f"contiguous {dtype} tensor of {numel} elements on {device}"
        )
    return out.view(-1)
