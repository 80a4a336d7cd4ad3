"""The Triton kernels of megazero/ops/quantize_triton.py (qwZ's and qgZ's GPU path) against the torch
references and the C++ kernels, bit for bit, under Triton's interpreter (TRITON_INTERPRET=1) on
this CPU.

- quantize: codes, scales and mins of random fp32 and bf16 rows, int8 and int4, symmetric and
  asymmetric, a short last block; and of the edge blocks tests/ops/test_quantize.py gives the C++
  kernels (all zeros, a NaN, +inf, -inf, an asymmetric range that overflows, ties between codes,
  subnormals, -0): the same NaN policy (scale NaN, codes 0).
- dequantize (fp32 and bf16 out: bf16 rounded to nearest even on the bits, as the C++ kernels) and
  the fused dequantize-and-reduce of 3 rows (the sum in row order, fp32 and bf16 out).
- The collectives' forms: qgZ's first hop reads [nodes, locals, chunk] transposed in place and
  writes a packed send buffer (codes, then scales, per row); the bytes equal the C++ path's, and so
  does the reduce read from the packed receive buffer.
NaN bits are compared as "a NaN" (tests/ops/test_quantize.py's `bits_of`).

The interpreter must be on before Triton is first imported, and the test session may have imported
it already (torch probes for it), so one subprocess runs every check and each test reads its part.
Planted, each failed its test: the NaN flag dropped (`bad` only from the range: the edge test),
the bf16 store truncating instead of rounding (the dequantize test), the source read with the
element stride for segments (the collectives' test).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FORMATS = list(itertools.product((8, 4), (True, False)))  # (bits, symmetric)
DTYPES = (torch.float32, torch.bfloat16)
BLOCK = 16
ROOT = Path(__file__).resolve().parents[2]


# ---- the checks (run in the subprocess; each returns a list of what differed) ----


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    from tests.ops.test_quantize import bits_of

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits_of(a), bits_of(b))


def _same_quantized(got, want) -> bool:
    return (
        torch.equal(got.codes, want.codes)
        and _same(got.scales, want.scales)
        and (want.symmetric or _same(got.mins, want.mins))
    )


def _triton_quantize(T, Q, x, bits, symmetric):
    out = Q._empty_quantized(x.numel(), bits, BLOCK, symmetric, (), x.device)
    T.quantize_rows(x.view(1, 1, -1), Q._as_rows(out), out.num_blocks)
    return out


def check_quantize_random(T, Q) -> list[str]:
    gen, bad = torch.Generator().manual_seed(0), []
    for (bits, symmetric), dtype in itertools.product(FORMATS, DTYPES):
        x = (torch.randn(3 * BLOCK + 5, generator=gen) * 3 + 1).to(dtype)
        got = _triton_quantize(T, Q, x, bits, symmetric)
        for name, want in (
            ("reference", Q.quantize_reference(x, bits, BLOCK, symmetric)),
            ("C++", Q.quantize(x, bits, BLOCK, symmetric)),
        ):
            if not _same_quantized(got, want):
                bad.append(f"int{bits} sym={symmetric} {dtype}: differs from the {name}")
    return bad


def check_quantize_edges(T, Q) -> list[str]:
    from tests.ops.test_quantize import non_finite_blocks

    bad = []
    for (bits, symmetric), dtype in itertools.product(FORMATS, DTYPES):
        x = non_finite_blocks(bits).to(dtype)
        got = _triton_quantize(T, Q, x, bits, symmetric)
        for name, want in (
            ("reference", Q.quantize_reference(x, bits, BLOCK, symmetric)),
            ("C++", Q.quantize(x, bits, BLOCK, symmetric)),
        ):
            if not _same_quantized(got, want):
                bad.append(f"edges int{bits} sym={symmetric} {dtype}: differs from the {name}")
    return bad


def check_dequantize(T, Q) -> list[str]:
    from tests.ops.test_quantize import non_finite_blocks

    gen, bad = torch.Generator().manual_seed(1), []
    for bits, symmetric in FORMATS:
        rows = [non_finite_blocks(bits)[: 4 * BLOCK]] + [
            torch.randn(4 * BLOCK, generator=gen) * (r + 1) for r in range(2)
        ]
        qs = [Q.quantize_reference(x, bits, BLOCK, symmetric) for x in rows]
        stacked = Q.stack(qs)
        for dtype in DTYPES:
            for r, q in enumerate(qs):
                got = torch.empty(q.numel, dtype=dtype)
                T.dequantize_rows(Q._as_rows(q), got.view(1, -1), q.num_blocks, False)
                if not (_same(got, Q.dequantize_reference(q, dtype)) and _same(got, Q.dequantize(q, dtype))):
                    bad.append(f"dequantize int{bits} sym={symmetric} row {r} to {dtype}")
            got = torch.empty(stacked.numel, dtype=dtype)
            T.dequantize_rows(stacked, got.view(1, -1), stacked.num_blocks, True)
            want = Q.dequantize_reduce_reference(stacked).to(dtype)
            if not (_same(got, want) and _same(got, Q.dequantize_reduce(stacked, out=torch.empty_like(got)))):
                bad.append(f"dequantize_reduce int{bits} sym={symmetric} to {dtype}")
    return bad


def check_collective_forms(T, Q) -> list[str]:
    """qgZ's first hop over 2 nodes of 2: row j = chunks (p, j) of every node p, read in place."""
    gen, bad = torch.Generator().manual_seed(2), []
    nodes, locals_, chunk = 2, 2, 3 * BLOCK + 7
    for bits, dtype in itertools.product((8, 4), DTYPES):
        bucket = torch.randn(nodes * locals_ * chunk, generator=gen).to(dtype)
        rows = bucket.view(nodes, locals_, chunk).transpose(0, 1)  # strided: no copy
        m, shape = nodes * chunk, (locals_, Q.packed_row_bytes(nodes * chunk, bits, BLOCK))
        got, want = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
        packed = Q.packed_rows(got, m, bits, BLOCK)
        T.quantize_rows(rows, packed, packed.num_blocks)
        Q.quantize_rows(rows, Q.packed_rows(want, m, bits, BLOCK))  # the C++ path
        if not torch.equal(got, want):
            bad.append(f"packed send buffer int{bits} {dtype}")
        for out_dtype in DTYPES:
            total = torch.empty(m, dtype=out_dtype)
            T.dequantize_rows(packed, total.view(1, -1), packed.num_blocks, True)
            if not _same(total, Q.dequantize_reduce(Q.packed_rows(want, m, bits, BLOCK), out=torch.empty_like(total))):
                bad.append(f"reduce of the packed buffer int{bits} {dtype} to {out_dtype}")
    return bad


CHECKS = {name: fn for name, fn in dict(globals()).items() if name.startswith("check_")}


def _run_checks() -> None:
    from megazero.ops import quantize as Q
    from megazero.ops import quantize_triton as T

    results = {}
    for name, check in CHECKS.items():
        try:
            results[name] = check(T, Q)
        except Exception as err:  # reported by the test that owns the check
            results[name] = [f"raised {type(err).__name__}: {err}"]
    print("RESULTS " + json.dumps(results))


# ---- the tests ----


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton", reason="Triton is an optional dependency (pip install megazero[triton])")
    from tests.ops.test_quantize import supported_isas

    supported_isas()  # the C++ kernels, the second oracle (fails when unbuilt)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ops.test_quantize_triton"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULTS ") :])


@pytest.mark.parametrize("check", list(CHECKS))
def test_triton_kernel_equals_reference_and_cpp(results, check):
    assert results[check] == [], "\n".join(results[check])


if __name__ == "__main__":
    _run_checks()
