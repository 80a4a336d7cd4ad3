"""The format of ZeRO++'s block-wise int8 / int4 quantization (megazero/ops/quantize.py quantizes
into it and back): QuantizedTensor, k of them stacked, the packed rows one collective moves (codes
and scales of a row side by side), and the checks that tensors have the format's shapes. Owns no
arithmetic and picks no implementation.

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
(bf16 widens exactly; results round to nearest even). A row of `quantize_rows` is quantized as its
own tensor (its last block may be short), and a packed buffer holds per row its codes, then its fp32
scales (`packed_rows`).
"""

from __future__ import annotations

import dataclasses

import torch

from megazero.core.errors import UsageError


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """Codes and per-block parameters of `numel` quantized values (see the module docstring).

    `quantize` gives 1-D fields. `dequantize_reduce` takes k such tensors stacked (`stack`), or a
    receive buffer laid out the same way: codes [k, bytes], scales and mins [k, num_blocks]. The row
    forms take [rows, ...] fields whose rows are contiguous, at any distance (`packed_rows`), with
    `numel` the length of one row."""

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
    if any(
        (q.numel, q.bits, q.block_size, q.symmetric) != (first.numel, first.bits, first.block_size, first.symmetric)
        for q in quantized
    ):
        raise UsageError(
            "stack: every quantized tensor needs the same numel, bits, block_size and "
            "symmetry; quantize the chunks with one setting"
        )
    mins = None if first.symmetric else torch.stack([q.mins for q in quantized])
    return dataclasses.replace(
        first,
        codes=torch.stack([q.codes for q in quantized]),
        scales=torch.stack([q.scales for q in quantized]),
        mins=mins,
    )


def packed_row_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of one row of a packed buffer: the row's codes, then its fp32 scales."""
    blocks = -(-numel // block_size)
    return blocks * (block_size if bits == 8 else block_size // 2) + 4 * blocks


def packed_rows(buffer: torch.Tensor, numel: int, bits: int, block_size: int) -> QuantizedTensor:
    """The symmetric QuantizedTensor whose rows are those of `buffer` (uint8 [rows, packed_row_bytes],
    contiguous): views, so quantizing into it fills the buffer, and one collective moves both codes
    and scales. The codes' bytes of a row are a multiple of 4, so its scales are aligned fp32."""
    _check_format(bits, block_size)
    blocks = -(-numel // block_size)
    nbytes = blocks * (block_size if bits == 8 else block_size // 2)
    if (
        buffer.dtype != torch.uint8
        or buffer.dim() != 2
        or not buffer.is_contiguous()
        or buffer.shape[1] != nbytes + 4 * blocks
        or nbytes % 4
    ):
        raise UsageError(
            f"packed_rows: buffer is {buffer.dtype} {tuple(buffer.shape)}; expected contiguous "
            f"uint8 [rows, {nbytes + 4 * blocks}] for numel={numel}, bits={bits}, "
            f"block_size={block_size} (codes a multiple of 4 bytes)"
        )
    scales = buffer.view(torch.float32)[:, nbytes // 4 :]
    return QuantizedTensor(buffer[:, :nbytes], scales, None, numel, bits, block_size)


def _check_format(bits: int, block_size: int) -> None:
    if bits not in (8, 4):
        raise UsageError(f"quantization bits={bits} is not supported; use 8 or 4")
    if not isinstance(block_size, int) or block_size < 1 or (bits == 4 and block_size % 2):
        raise UsageError(
            f"quantization block_size={block_size} must be a positive integer "
            f"(even for int4, which packs two codes per byte)"
        )


def _empty_quantized(
    numel: int, bits: int, block_size: int, symmetric: bool, lead: tuple, device: torch.device
) -> QuantizedTensor:
    blocks = -(-numel // block_size)
    nbytes = blocks * (block_size if bits == 8 else block_size // 2)
    scales = torch.empty(*lead, blocks, dtype=torch.float32, device=device)
    mins = None if symmetric else torch.empty_like(scales)
    codes = torch.empty(*lead, nbytes, dtype=torch.uint8, device=device)
    return QuantizedTensor(codes, scales, mins, numel, bits, block_size)


def _check_quantized(q: QuantizedTensor, chunks: int | None, rows: bool = False) -> None:
    """q's fields have the format's shapes; contiguous, or with `rows` each row contiguous."""
    _check_format(q.bits, q.block_size)
    lead = () if chunks is None else (chunks,)
    want = {
        "codes": ((*lead, q.num_blocks * q.bytes_per_block), torch.uint8),
        "scales": ((*lead, q.num_blocks), torch.float32),
    }
    if not q.symmetric:
        want["mins"] = want["scales"]
    for name, (shape, dtype) in want.items():
        tensor = getattr(q, name)
        laid_out = tensor.is_contiguous() or (rows and tensor.dim() == 2 and tensor.stride(1) == 1)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or not laid_out or tensor.device != q.codes.device:
            raise UsageError(
                f"quantized {name} is {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}; "
                f"expected contiguous {dtype} {shape} on {q.codes.device} for numel={q.numel}, "
                f"bits={q.bits}, block_size={q.block_size} (pass what quantize() returned)"
            )
