"""The block quantization kernels (csrc/quantize*.cpp, megazero.ops.quantize) against their torch
references, and the references against the format's error bound.

What "equal" means here: codes, scales and mins are bitwise equal to the reference, and so are the
dequantized values (fp32 and bf16) and the fused dequantize-and-reduce, because every path rounds
the same fp32 ops in the same order (no fused multiply-adds, see csrc/quantize_kernels.h). This
holds for every loop this CPU can run (avx512, avx2, scalar, forced in turn), every length (tails
of every size), block size, int8/int4 and symmetric/asymmetric, fp32/bf16 in and out.

Round trip: |x - x'| <= scale / 2 + SLACK_ULPS * 2^-24 * max|block| (the fp32 roundings of the
division, the subtraction of min and the dequantizing multiply-add: a few half-ulps of the block's
largest magnitude), plus 2^-8 |x'| when x' is rounded to bf16.

Like tests/ops/test_adam.py, these never skip silently: without megazero._quant they FAIL, unless
MEGAZERO_ALLOW_NO_CPP=1 opts out, and then they skip saying why.
"""

import itertools
import os
import sys

import pytest
import torch

from megazero.core.errors import UsageError
from megazero.ops import quantize as Q

SLACK_ULPS = 8
FORMATS = list(itertools.product((8, 4), (True, False)))  # (bits, symmetric)
DTYPES = (torch.float32, torch.bfloat16)
ISA_CPU_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "scalar": set(),
}


def supported_isas() -> list:
    try:
        return Q.kernel_info()["isas"]
    except UsageError as err:
        if os.environ.get("MEGAZERO_ALLOW_NO_CPP") == "1":
            pytest.skip(f"{err}; kernel tests skipped because MEGAZERO_ALLOW_NO_CPP=1")
        pytest.fail(f"{err} (or set MEGAZERO_ALLOW_NO_CPP=1 to skip the kernel tests)", pytrace=False)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """t's bits, every NaN as one pattern: which NaN a path writes is not part of the format (torch's
    own bf16 conversion writes 0xffff or 0x7fc0 by its loop)."""
    bits = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)
    return torch.where(t.isnan(), -1, bits)


def assert_same_quantized(got: Q.QuantizedTensor, want: Q.QuantizedTensor, where: str) -> None:
    assert torch.equal(got.codes, want.codes), f"codes differ: {where}"
    assert torch.equal(bits_of(got.scales), bits_of(want.scales)), f"scales differ: {where}"
    if not want.symmetric:
        assert torch.equal(bits_of(got.mins), bits_of(want.mins)), f"mins differ: {where}"


def check_all_kernels(x: torch.Tensor, bits: int, symmetric: bool, block_size: int, isas: list) -> None:
    """Every kernel on every forced path equals the reference bitwise, for this x."""
    want = Q.quantize_reference(x, bits, block_size, symmetric)
    others = [
        Q.quantize_reference(x * 3, bits, block_size, symmetric),
        Q.quantize_reference(-x, bits, block_size, symmetric),
    ]
    stacked = Q.stack([want] + others)
    want_values = {dtype: Q.dequantize_reference(want, dtype) for dtype in DTYPES}
    want_sum = Q.dequantize_reduce_reference(stacked)
    for isa in isas:
        where = f"n={x.numel()} {x.dtype} int{bits} sym={symmetric} block={block_size} isa={isa}"
        got = Q.quantize(x, bits, block_size, symmetric, isa=isa)
        assert_same_quantized(got, want, where)
        for dtype in DTYPES:
            assert torch.equal(bits_of(Q.dequantize(want, dtype, isa=isa)), bits_of(want_values[dtype])), (
                f"dequantize to {dtype} differs: {where}"
            )
        assert torch.equal(bits_of(Q.dequantize_reduce(stacked, isa=isa)), bits_of(want_sum)), (
            f"dequantize_reduce differs: {where}"
        )


def test_every_path_this_cpu_has_is_compiled_and_offered():
    isas = supported_isas()
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as cpuinfo:
            flags = {flag for line in cpuinfo if line.startswith("flags") for flag in line.split()}
    expected = [isa for isa, needs in ISA_CPU_FLAGS.items() if flags and needs <= flags] or ["scalar"]
    assert isas == expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_equal_reference_for_every_tail(dtype):
    isas = supported_isas()
    gen = torch.Generator().manual_seed(0)
    # Every length up to a few blocks of 64 (every tail size), then larger odd and edge lengths.
    lengths = list(range(1, 200)) + [1000, 2047, 2048, 2049, 4099]
    for (bits, symmetric), n in itertools.product(FORMATS, lengths):
        x = (torch.randn(n, generator=gen) * 3 + 1).to(dtype)
        check_all_kernels(x, bits, symmetric, 64, isas)


@pytest.mark.parametrize("block_size", [2, 32, 100, 2048])
def test_kernels_equal_reference_for_block_sizes(block_size):
    isas = supported_isas()
    gen = torch.Generator().manual_seed(1)
    for (bits, symmetric), dtype, n in itertools.product(FORMATS, DTYPES, (1, 7, 31, 32, 33, 1000)):
        x = (torch.randn(n, generator=gen) * 0.02).to(dtype)
        check_all_kernels(x, bits, symmetric, block_size, isas)


def test_kernels_equal_reference_on_a_large_buffer():
    """1M + 5 elements: many threads' worth of blocks and a 5-element tail."""
    isas = supported_isas()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1_000_005, generator=gen)
    for (bits, symmetric), dtype in itertools.product(FORMATS, DTYPES):
        check_all_kernels(x.to(dtype), bits, symmetric, 2048, isas)


def test_awkward_blocks_equal_reference():
    """Constant blocks (scale 1), zeros and negative zeros, a far offset, tiny and huge values."""
    isas = supported_isas()
    cases = [
        torch.zeros(70),
        torch.full((70,), -0.0),
        torch.full((70,), 5.0),
        torch.randn(70, generator=torch.Generator().manual_seed(3)) + 1000.0,
        torch.tensor([1e-40, -3e-41, 0.0] * 20),
        torch.tensor([3e38, -1e37, 1.0] * 20),
    ]
    for x, (bits, symmetric), dtype in itertools.product(cases, FORMATS, DTYPES):
        check_all_kernels(x.to(dtype), bits, symmetric, 16, isas)


@pytest.mark.parametrize("bits,symmetric", FORMATS)
def test_round_trip_within_half_a_step(bits, symmetric):
    supported_isas()
    gen = torch.Generator().manual_seed(4)
    x = torch.cat([torch.randn(5003, generator=gen) * 4, torch.rand(3001, generator=gen) + 50.0])
    block_size = 64
    for dtype in DTYPES:
        source = x.to(dtype)
        q = Q.quantize(source, bits, block_size, symmetric)
        exact = source.float()
        blocks = torch.nn.functional.pad(exact.abs(), (0, q.num_blocks * block_size - exact.numel()))
        per_element = lambda per_block: per_block.repeat_interleave(block_size)[: exact.numel()]  # noqa: E731
        block_max = per_element(blocks.view(q.num_blocks, block_size).amax(dim=1))
        scale = per_element(q.scales)
        bound = scale / 2 + SLACK_ULPS * 2.0**-24 * block_max
        for out_dtype in DTYPES:
            values = Q.dequantize(q, out_dtype).float()
            extra = values.abs() * 2.0**-8 if out_dtype == torch.bfloat16 else 0.0
            excess = ((values - exact).abs() - bound - extra).max().item()
            assert excess <= 0, f"int{bits} sym={symmetric} {dtype}->{out_dtype}: bound exceeded by {excess}"
        # The bound is not slack: the worst element uses most of half a step.
        worst = ((Q.dequantize(q).float() - exact).abs() / scale).max().item()
        assert worst > 0.45


def test_layout_is_padded_never_dropped():
    supported_isas()
    x = torch.arange(1, 8, dtype=torch.float32)  # 7 values, block 4: blocks of 4 and 3 (+1 padding)
    q = Q.quantize(x, bits=4, block_size=4, symmetric=False)
    assert (q.codes.numel(), q.scales.numel(), q.num_blocks) == (4, 2, 2)
    assert q.codes[-1].item() >> 4 == 0  # the padding's nibble
    assert torch.allclose(Q.dequantize(q), x, atol=0.5 * q.scales.max().item())
    q8 = Q.quantize(x, bits=8, block_size=4, symmetric=True)
    assert q8.codes.numel() == 8 and q8.codes[-1].item() == 0
    assert q8.codes.view(torch.int8)[3].item() == 127  # the block's largest magnitude maps to qmax


def test_bad_input_is_one_line_usage_error():
    supported_isas()
    x = torch.randn(10)
    with pytest.raises(UsageError, match="bits=3"):
        Q.quantize(x, bits=3)
    with pytest.raises(UsageError, match="even for int4"):
        Q.quantize(x, bits=4, block_size=5)
    with pytest.raises(UsageError, match="fp32 or bf16"):
        Q.quantize(x.half())
    q = Q.quantize(x, block_size=4)
    with pytest.raises(UsageError, match="stack the chunks"):
        Q.dequantize_reduce(q)
    with pytest.raises(UsageError, match="must be a contiguous"):
        Q.dequantize(q, out=torch.empty(9))
    with pytest.raises(UsageError, match="expected contiguous"):
        Q.dequantize(Q.QuantizedTensor(q.codes, q.scales[:1], None, 10, 8, 4))
    with pytest.raises(ValueError, match="not available"):
        Q.quantize(x, isa="sse9")


def test_missing_extension_is_an_error_naming_the_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "megazero._quant", None)  # makes the import fail
    with pytest.raises(UsageError, match=r"megazero\._quant.*pip install --no-deps -e \."):
        Q.quantize(torch.randn(4))


def non_finite_blocks(bits: int) -> torch.Tensor:
    """Blocks of 16: all zeros, a NaN, +inf, -inf, +-3e38 (an asymmetric range that overflows),
    halves between codes (ties: round half to even), subnormals, -0; then a 10-element tail."""
    qmax = 7 if bits == 4 else 127
    gen = torch.Generator().manual_seed(5)
    blocks = [torch.randn(16, generator=gen) for _ in range(8)]
    blocks[0].zero_()
    blocks[1][3] = float("nan")
    blocks[2][15] = float("inf")
    blocks[3][0] = float("-inf")
    blocks[4] = torch.tensor([3e38, -3e38] * 8)
    blocks[5] = torch.cat([torch.tensor([0.0, float(qmax)]), torch.arange(14) % qmax + 0.5])
    blocks[6] = torch.tensor([1e-42, -3e-41, 0.0, 5e-45] * 4)
    blocks[7] = torch.full((16,), -0.0)
    return torch.cat(blocks + [torch.randn(10, generator=gen)])


def test_non_finite_blocks_read_nan_and_equal_reference():
    """A block holding a NaN or an infinity (or whose max - min overflows) dequantizes to NaN
    everywhere, on every path; every other block is untouched by its neighbours' NaN. Planted (the
    kernel's NaN flag dropped: NaN skipped by min/max, as before) fails it."""
    isas = supported_isas()
    for (bits, symmetric), dtype in itertools.product(FORMATS, DTYPES):
        x = non_finite_blocks(bits).to(dtype)
        check_all_kernels(x, bits, symmetric, 16, isas)
        values = Q.dequantize(Q.quantize(x, bits, 16, symmetric)).view(-1)
        nan_blocks = [1, 2, 3] + ([] if symmetric else [4])
        for b in range(9):
            block = values[16 * b : 16 * b + 16]
            assert bool(block.isnan().all()) == (b in nan_blocks), (bits, symmetric, dtype, b)
            assert b in nan_blocks or bool(block.isfinite().all()), (bits, symmetric, dtype, b)
