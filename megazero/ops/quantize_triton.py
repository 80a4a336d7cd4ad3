"""The block quantization kernels of megazero.ops.quantize for GPUs, in Triton: quantize rows into
codes and scales, dequantize rows, and the fused dequantize-and-reduce of k quantized rows.

This module owns the kernels and their launch. The format, the argument checks and the choice of
implementation are quantize.py's (which imports this module only when a GPU tensor, or a meta one,
meets a kernel, so Triton stays an optional dependency: `pip install megazero[triton]`).

Numerics: op for op those of csrc/quantize_kernels.h and of quantize.py's torch references, so the
codes, scales and values are bitwise theirs (tests/ops/test_quantize_triton.py runs the kernels under
Triton's interpreter, TRITON_INTERPRET=1, on the CPU). What that takes:
- divisions by `tl.math.div_rn` (IEEE, correctly rounded; Triton's `/` is approximate on a GPU);
- no multiply-add fused by the compiler (`enable_fp_fusion=False` at every launch);
- round half to even by adding and subtracting 1.5 * 2^23, as the C++ loops do;
- bf16 read by shifting its bits up (exact) and written by rounding the fp32 bits to nearest even
  in integer ops (the C++ kernels' float_to_bf16, NaN made quiet with its top payload bits):
  Triton's interpreter truncates in `.to(tl.bfloat16)`, a GPU rounds; the integer ops agree everywhere;
- the non-finite policy of quantize.py (a block holding a NaN or an infinity gets scale NaN and
  codes 0) decided by a flag, not by what a float-to-int conversion of NaN happens to give.

Memory: a kernel writes its outputs, which the caller allocated, and allocates nothing itself; a
source may be any strided [rows, segments, elements] view (qgZ's chunks of every node, taken in
place), and codes and scales may be row-strided views of one packed send buffer. So the quantized
collectives hold no fp32 or int32 copy of a bucket. On the meta device (the dry run's GPU) there is
nothing to compute: the launch is skipped, and the memory is what the caller allocated.
"""

from __future__ import annotations

import triton
import triton.language as tl

_MAGIC = 12582912.0  # 1.5 * 2^23: adding it rounds |v| < 2^22 to an integer, ties to even


@triton.jit
def _load_f32(ptr, offsets, mask, BF16: tl.constexpr):
    """fp32 values at ptr + offsets; bf16 (read through an int16 view) widened exactly."""
    if BF16:
        bits = tl.load(ptr + offsets, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (bits << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _store_f32(ptr, offsets, value, mask, BF16: tl.constexpr):
    """Stores fp32 `value`; into bf16 (an int16 view) rounded to nearest even on the bits."""
    if BF16:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = (bits >> 16) | 0x40
        half = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded)
        tl.store(ptr + offsets, half.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offsets, value, mask=mask)


@triton.jit
def _quantize_kernel(
    src,
    stride_r,
    stride_s,
    stride_e,
    seg,
    m,
    codes,
    codes_stride,
    scales,
    scales_stride,
    mins,
    block_size,
    blocks_per_row,
    BITS: tl.constexpr,
    SYM: tl.constexpr,
    SRC_BF16: tl.constexpr,
    QMAX: tl.constexpr,
    LANES: tl.constexpr,
):
    """One program per block: row r's elements [b * block_size, ...) of the strided source."""
    PER: tl.constexpr = 8 // BITS  # values per code byte
    pid = tl.program_id(0).to(tl.int64)
    r = pid // blocks_per_row
    b = pid - r * blocks_per_row
    j = tl.arange(0, LANES)
    k = tl.arange(0, PER)
    i = j[:, None] * PER + k[None, :]  # element of the block, [LANES, PER]
    e = b * block_size + i  # element of the row
    valid = (i < block_size) & (e < m)
    x = _load_f32(src, r * stride_r + (e // seg) * stride_s + (e % seg) * stride_e, valid, SRC_BF16)
    finite = (x - x) == 0.0
    bad = tl.max(tl.max(tl.where(valid & (finite == 0), 1, 0), axis=1), axis=0) > 0
    x = tl.where(valid & finite, x, 0.0)
    lo = tl.min(tl.min(tl.where(valid, x, float("inf")), axis=1), axis=0)
    hi = tl.max(tl.max(tl.where(valid, x, float("-inf")), axis=1), axis=0)
    if SYM:
        mn = 0.0
        scale = tl.math.div_rn(tl.where(-lo > hi, -lo, hi), QMAX * 1.0)
    else:
        mn = lo + 0.0  # -0 becomes +0
        scale = tl.math.div_rn(hi - mn, QMAX * 1.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    bad = bad | ((scale - scale) != 0.0)  # a non-finite range (asymmetric overflow)
    safe = tl.where(bad, 1.0, scale)
    v = tl.math.div_rn(x, safe) if SYM else tl.math.div_rn(x - mn, safe)
    q = ((v + _MAGIC) - _MAGIC).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -QMAX if SYM else 0), QMAX)
    q = tl.where(valid & (bad == 0), q, 0)
    byte = tl.sum((q & ((1 << BITS) - 1)) << (k * BITS)[None, :], axis=1)
    per_block = block_size // PER
    tl.store(codes + r * codes_stride + b * per_block + j, byte.to(tl.uint8), mask=j < per_block)
    tl.store(scales + r * scales_stride + b, tl.where(bad, float("nan"), scale))
    if not SYM:
        tl.store(mins + r * scales_stride + b, tl.where(bad, float("nan"), mn))


@triton.jit
def _dequantize_kernel(
    codes,
    codes_stride,
    scales,
    scales_stride,
    mins,
    rows,
    m,
    block_size,
    blocks_per_row,
    out,
    out_stride,
    BITS: tl.constexpr,
    SYM: tl.constexpr,
    OUT_BF16: tl.constexpr,
    REDUCE: tl.constexpr,
    LANES: tl.constexpr,
):
    """REDUCE: one program per block, the sum over `rows` rows in row order ((0 + x'_0) + x'_1 ...);
    else one program per (row, block), the row's values."""
    PER: tl.constexpr = 8 // BITS
    pid = tl.program_id(0).to(tl.int64)
    if REDUCE:
        first, count = pid * 0, rows
    else:
        first, count = pid // blocks_per_row, 1
    b = pid - first * blocks_per_row
    j = tl.arange(0, LANES)
    k = tl.arange(0, PER)
    i = j[:, None] * PER + k[None, :]
    e = b * block_size + i
    valid = (i < block_size) & (e < m)
    per_block = block_size // PER
    acc = tl.zeros([LANES, PER], dtype=tl.float32)
    for c in range(0, count):
        r = first + c
        byte = tl.load(codes + r * codes_stride + b * per_block + j, mask=j < per_block, other=0).to(tl.int32)
        q = (byte[:, None] >> (k * BITS)[None, :]) & ((1 << BITS) - 1)
        if SYM:
            q = (q ^ (1 << (BITS - 1))) - (1 << (BITS - 1))  # sign-extend the two's complement
        value = q.to(tl.float32) * tl.load(scales + r * scales_stride + b)
        if not SYM:
            value = value + tl.load(mins + r * scales_stride + b)
        acc = acc + value if REDUCE else value
    _store_f32(out, first * out_stride + e, acc, valid, OUT_BF16)


def _lanes(bits: int, block_size: int) -> int:
    return triton.next_power_of_2(max(1, block_size // (8 // bits)))


def _bits_view(t):
    """What a kernel is handed for a fp32 / bf16 tensor: bf16 through an int16 view of its bits."""
    import torch

    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def quantize_rows(src, q, blocks_per_row: int) -> None:
    """Quantizes the rows of `src` ([rows, segments, elements], any strides: row r is
    src[r].reshape(-1)) into `q` (codes [rows, bytes] and scales / mins [rows, blocks], each row
    contiguous, rows any stride), with q.numel the row length."""
    import torch

    if src.device.type == "meta" or q.codes.numel() == 0:
        return
    qmax = (1 << (q.bits - 1)) - 1 if q.symmetric else (1 << q.bits) - 1
    mins = q.scales if q.mins is None else q.mins
    grid = (src.shape[0] * blocks_per_row,)
    _quantize_kernel[grid](
        _bits_view(src),
        src.stride(0),
        src.stride(1),
        src.stride(2),
        src.shape[2],
        q.numel,
        q.codes,
        q.codes.stride(0),
        q.scales,
        q.scales.stride(0),
        mins,
        q.block_size,
        blocks_per_row,
        BITS=q.bits,
        SYM=q.symmetric,
        SRC_BF16=src.dtype == torch.bfloat16,
        QMAX=qmax,
        LANES=_lanes(q.bits, q.block_size),
        enable_fp_fusion=False,
    )


def dequantize_rows(q, out, blocks_per_row: int, reduce: bool) -> None:
    """out[r] = the values of row r of `q` (reduce: out = their sum over the rows, fp32 adds in row
    order), out fp32 or bf16 with contiguous rows of q.numel elements."""
    import torch

    rows = q.codes.shape[0]
    if out.device.type == "meta" or out.numel() == 0:
        return
    mins = q.scales if q.mins is None else q.mins
    grid = (blocks_per_row if reduce else rows * blocks_per_row,)
    _dequantize_kernel[grid](
        q.codes,
        q.codes.stride(0),
        q.scales,
        q.scales.stride(0),
        mins,
        rows,
        q.numel,
        q.block_size,
        blocks_per_row,
        _bits_view(out),
        0 if reduce else out.stride(0),
        BITS=q.bits,
        SYM=q.symmetric,
        OUT_BF16=out.dtype == torch.bfloat16,
        REDUCE=reduce,
        LANES=_lanes(q.bits, q.block_size),
        enable_fp_fusion=False,
    )
