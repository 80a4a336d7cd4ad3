"""Block-wise int8 / int4 quantization for ZeRO++'s quantized weight gathers (qwZ) and gradient
reductions (qgZ): `quantize`, `dequantize`, `dequantize_reduce`, and a pure-torch reference of each.

This module owns the format, the argument checks and the choice of implementation. It does not
decide what gets quantized or when (that is the ZeRO engine's business) and moves no data between
ranks.

Format. The flattened input is cut into blocks of `block_size` elements; the last block is shorter
when numel is not a multiple (its elements are quantized like any other, never dropped). Each block
has an fp32 `scale` and, when asymmetric, an fp32 `min`:

- symmetric:  scale = max|x| / qmax, code = clamp(round(x / scale), -qmax, qmax), x' = code * scale
- asymmetric: scale = (max x - min x) / qmax, code = clamp(round((x - min) / scale), 0, qmax),
  x' = code * scale + min

with qmax 127 / 7 (symmetric int8 / int4) or 255 / 15 (asymmetric), round half to even, and scale 1
for a block whose range is 0. Codes are bytes (`torch.uint8`): int8 one per byte (two's complement
when symmetric), int4 two per byte, element 2j in the low nibble and 2j+1 in the high one. A block
always takes block_size (int8) or block_size / 2 (int4) bytes, so int4 needs an even block size;
codes past numel are 0. Inputs are fp32 or bf16 and outputs fp32 or bf16, converted directly
(bf16 widens exactly; results round to nearest even). Inputs must be finite, and so must each
block's max - min (below ~3.4e38); otherwise that block's codes and values are meaningless.

Error: |x - x'| <= scale / 2 from the rounding of the code, plus fp32 rounding of the ops above
(a few ulps of the block's largest magnitude) and, for a bf16 output, the bf16 rounding of x'.

Implementations. CPU tensors go to the C++ extension `megazero._quant` (csrc/quantize*.cpp:
AVX-512, AVX2 or scalar loops picked at run time, `torch.get_num_threads()` OpenMP threads); its
codes, scales and values are bitwise equal to the references here. When it is not built, asking
for quantization of a CPU tensor is an error naming the build command, never a silent slow path.
Tensors on other devices (GPUs) run the torch reference on their own device until CUDA kernels
exist. `MEGAZERO_QUANT_ISA=avx512|avx2|scalar` (or the `isa` argument) forces one CPU loop.
"""
from __future__ import annotations

import dataclasses
import importlib
import os

import torch

from megazero.core.errors import UsageError

ISA_ENV = "MEGAZERO_QUANT_ISA"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
BUILD_HINT = "build it with `pip install --no-deps -e .` in the megazero checkout (needs a C++ compiler)"


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """Codes and per-block parameters of `numel` quantized values (see the module docstring).

    `quantize` gives 1-D fields. `dequantize_reduce` takes k such tensors stacked (`stack`), or a
    receive buffer laid out the same way: codes [k, bytes], scales and mins [k, num_blocks]."""
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    numel: int
    bits: int
    block_size: int

    @property
    def symmetric(self) -> bool:
        return self.mins is None

    @property
    def num_blocks(self) -> int:
        return -(-self.numel // self.block_size)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size if self.bits == 8 else self.block_size // 2


def stack(quantized: list[QuantizedTensor]) -> QuantizedTensor:
    """k quantized tensors of one shape and format as one with a leading k dimension."""
    if not quantized:
        raise UsageError("stack: got no quantized tensors; pass at least one")
    first = quantized[0]
    if any((q.numel, q.bits, q.block_size, q.symmetric) != (first.numel, first.bits, first.block_size,
                                                            first.symmetric) for q in quantized):
        raise UsageError("stack: every quantized tensor needs the same numel, bits, block_size and "
                         "symmetry; quantize the chunks with one setting")
    mins = None if first.symmetric else torch.stack([q.mins for q in quantized])
    return dataclasses.replace(first, codes=torch.stack([q.codes for q in quantized]),
                               scales=torch.stack([q.scales for q in quantized]), mins=mins)


def quantize(x: torch.Tensor, bits: int = 8, block_size: int = 2048, symmetric: bool = True,
             isa: str | None = None) -> QuantizedTensor:
    """Block-quantizes the flattened fp32 or bf16 tensor `x`; the result lives on x's device."""
    _check_format(bits, block_size)
    if x.dtype not in _DTYPE_CODES:
        raise UsageError(f"quantize: x is {x.dtype}; pass fp32 or bf16 (convert with .float())")
    flat = x.reshape(-1).contiguous()
    if flat.device.type != "cpu":
        return quantize_reference(flat, bits, block_size, symmetric)
    out = _empty_quantized(flat.numel(), bits, block_size, symmetric, (), flat.device)
    _extension().quantize(flat.data_ptr(), _DTYPE_CODES[flat.dtype], flat.numel(),
                          out.codes.data_ptr(), out.scales.data_ptr(), _ptr(out.mins), bits,
                          block_size, symmetric, torch.get_num_threads(), _isa(isa))
    return out


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
               isa: str | None = None) -> torch.Tensor:
    """The numel values of the 1-D quantized tensor `q` as a 1-D fp32 or bf16 tensor (into `out`
    when given: contiguous, numel long, of `dtype`, on q's device)."""
    _check_quantized(q, chunks=None)
    if dtype not in _DTYPE_CODES:
        raise UsageError(f"dequantize: dtype {dtype} is not supported; use torch.float32 or torch.bfloat16")
    out = _check_out(out, q.numel, dtype, q.codes.device, "dequantize")
    if q.codes.device.type != "cpu":
        return out.copy_(dequantize_reference(q, dtype))
    _extension().dequantize(q.codes.data_ptr(), q.scales.data_ptr(), _ptr(q.mins), q.numel, q.bits,
                            q.block_size, q.symmetric, out.data_ptr(), _DTYPE_CODES[dtype],
                            torch.get_num_threads(), _isa(isa))
    return out


def dequantize_reduce(q: QuantizedTensor, out: torch.Tensor | None = None,
                      isa: str | None = None) -> torch.Tensor:
    """Sum over k of the dequantized chunks of the stacked `q` (codes [k, bytes]), in fp32, added in
    chunk order: ((0 + x'_0) + x'_1) + ...; the reduction step of a quantized reduce-scatter."""
    if q.codes.dim() != 2:
        raise UsageError(f"dequantize_reduce: codes must be [k, bytes], got shape {tuple(q.codes.shape)}; "
                         f"stack the chunks first (megazero.ops.quantize.stack)")
    chunks = q.codes.shape[0]
    _check_quantized(q, chunks=chunks)
    out = _check_out(out, q.numel, torch.float32, q.codes.device, "dequantize_reduce")
    if q.codes.device.type != "cpu" or chunks == 0:
        return out.copy_(dequantize_reduce_reference(q))
    _extension().dequantize_reduce(q.codes.data_ptr(), q.scales.data_ptr(), _ptr(q.mins), chunks,
                                   q.numel, q.bits, q.block_size, q.symmetric, out.data_ptr(),
                                   torch.get_num_threads(), _isa(isa))
    return out


def kernel_info() -> dict:
    """What the C++ path would do here: the loops this CPU can run, best first, and OpenMP."""
    ext = _extension()
    return {"isas": list(ext.supported_isas()), "openmp": ext.built_with_openmp()}


# ---- the torch references (test oracles; also the path for non-CPU tensors) ----

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
    lo, hi = padded.amin(dim=1), padded.amax(dim=1)
    qmax = _qmax(bits, symmetric)
    if symmetric:
        scale = torch.maximum(-lo, hi) / qmax
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = torch.round(padded / scale[:, None]).to(torch.int32).clamp(-qmax, qmax)
    else:
        mn = lo + 0.0  # -0 becomes +0, as in the kernel
        scale = (hi - mn) / qmax
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = torch.round((padded - mn[:, None]) / scale[:, None]).to(torch.int32).clamp(0, qmax)
        out.mins.copy_(mn)
    out.scales.copy_(scale)
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
    return values.flatten(-2)[..., :q.numel]


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


# ---- checks and plumbing ----

def _extension():
    try:
        quant = importlib.import_module("megazero._quant")  # cached by Python after the first call
    except ImportError as err:
        raise UsageError(f"quantization needs the C++ extension megazero._quant, which is not built "
                         f"({err}); {BUILD_HINT}") from None
    return quant


def _isa(isa: str | None) -> str:
    return os.environ.get(ISA_ENV, "") if isa is None else isa


def _ptr(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _check_format(bits: int, block_size: int) -> None:
    if bits not in (8, 4):
        raise UsageError(f"quantization bits={bits} is not supported; use 8 or 4")
    if not isinstance(block_size, int) or block_size < 1 or (bits == 4 and block_size % 2):
        raise UsageError(f"quantization block_size={block_size} must be a positive integer "
                         f"(even for int4, which packs two codes per byte)")


def _empty_quantized(numel: int, bits: int, block_size: int, symmetric: bool, lead: tuple,
                     device: torch.device) -> QuantizedTensor:
    blocks = -(-numel // block_size)
    nbytes = blocks * (block_size if bits == 8 else block_size // 2)
    scales = torch.empty(*lead, blocks, dtype=torch.float32, device=device)
    mins = None if symmetric else torch.empty_like(scales)
    codes = torch.empty(*lead, nbytes, dtype=torch.uint8, device=device)
    return QuantizedTensor(codes, scales, mins, numel, bits, block_size)


def _check_quantized(q: QuantizedTensor, chunks: int | None) -> None:
    _check_format(q.bits, q.block_size)
    lead = () if chunks is None else (chunks,)
    want = {"codes": ((*lead, q.num_blocks * q.bytes_per_block), torch.uint8),
            "scales": ((*lead, q.num_blocks), torch.float32)}
    if not q.symmetric:
        want["mins"] = want["scales"]
    for name, (shape, dtype) in want.items():
        tensor = getattr(q, name)
        if (tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous()
                or tensor.device != q.codes.device):
            raise UsageError(f"quantized {name} is {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}; "
                             f"expected contiguous {dtype} {shape} on {q.codes.device} for numel={q.numel}, "
                             f"bits={q.bits}, block_size={q.block_size} (pass what quantize() returned)")


def _check_out(out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device,
               op: str) -> torch.Tensor:
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if out.numel() != numel or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise UsageError(f"{op}: out is {out.dtype} {tuple(out.shape)} on {out.device}; it must be a "
                         f"contiguous {dtype} tensor of {numel} elements on {device}")
    return out.view(-1)
