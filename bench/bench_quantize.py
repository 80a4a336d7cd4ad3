"""Block quantization kernels (megazero._quant) against their torch references, in GB/s.

For each kernel and format, on the same random buffer:

    ours    megazero.ops.quantize.quantize / dequantize / dequantize_reduce (the C++ loops; every
            instruction set this CPU runs, forced in turn, best first)
    torch   quantize_reference / dequantize_reference / dequantize_reduce_reference, the same math
            in torch ops (the oracle the tests compare with, and what a plain-torch ZeRO++ would run)

Sides take turns over rounds so a burst of load from elsewhere lands on all of them; per side the
median of the rounds is kept (each round the median of `--steps` calls). Both sides use torch's
intra-op thread count (`--threads`). GB/s counts the bytes one pass must move: the input and the
codes, scales and mins written (quantize), the codes and parameters read and the output written
(dequantize), k chunks' codes and parameters read and one fp32 output written (dequantize_reduce).
"x torch" = torch time / our time (above 1: ours is faster). The results are checked equal before
timing, so both sides do the same work.

    python bench/bench_quantize.py                       # 4M elements, block 2048, k = 8
    python bench/bench_quantize.py --numel 16000000 --threads 1 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from megazero.ops import quantize as Q

FORMATS = [(8, True), (8, False), (4, True), (4, False)]


def median_seconds(fn: Callable[[], object], steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def quantized_bytes(q: Q.QuantizedTensor) -> int:
    extra = 0 if q.mins is None else q.mins.numel() * 4
    return q.codes.numel() + q.scales.numel() * 4 + extra


def cases(x: torch.Tensor, block_size: int, chunks: int, isas: list):
    """(name, bytes moved, {side: fn}) for every kernel and format; each fn binds its arguments."""
    for bits, symmetric in FORMATS:
        fmt = f"int{bits} {'sym' if symmetric else 'asym'}"
        spec = (bits, block_size, symmetric)
        for dtype in (torch.float32, torch.bfloat16):
            source = x.to(dtype)
            q = Q.quantize_reference(source, *spec)
            name = "fp32" if dtype == torch.float32 else "bf16"
            plain_bytes = source.numel() * source.element_size()
            sides = {isa: (lambda s=source, p=spec, i=isa: Q.quantize(s, *p, isa=i)) for isa in isas}
            sides["torch"] = lambda s=source, p=spec: Q.quantize_reference(s, *p)
            yield f"quantize {name} -> {fmt}", plain_bytes + quantized_bytes(q), sides
            sides = {isa: (lambda q=q, d=dtype, i=isa: Q.dequantize(q, d, isa=i)) for isa in isas}
            sides["torch"] = lambda q=q, d=dtype: Q.dequantize_reference(q, d)
            yield f"dequantize {fmt} -> {name}", quantized_bytes(q) + plain_bytes, sides
        stacked = Q.stack([Q.quantize_reference(x * (c + 1), *spec) for c in range(chunks)])
        sides = {isa: (lambda q=stacked, i=isa: Q.dequantize_reduce(q, isa=i)) for isa in isas}
        sides["torch"] = lambda q=stacked: Q.dequantize_reduce_reference(q)
        yield f"reduce {chunks}x {fmt} -> fp32", quantized_bytes(stacked) + x.numel() * 4, sides


def check_equal(sides: dict) -> None:
    results = [fn() for fn in sides.values()]
    for result in results[1:]:
        same = (
            torch.equal(result.codes, results[0].codes)
            if isinstance(result, Q.QuantizedTensor)
            else torch.equal(result, results[0])
        )
        assert same, "a kernel disagrees with the torch reference; run tests/ops/test_quantize.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4_000_000, help="elements per buffer")
    parser.add_argument("--block-size", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=8, help="k, the chunks dequantize_reduce sums")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="calls per side and round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isas = Q.kernel_info()["isas"]
    print(
        f"numel {args.numel:,}, block {args.block_size}, k {args.chunks}, {args.threads} threads, "
        f"paths {isas}, openmp {Q.kernel_info()['openmp']}"
    )
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    print(f"{'kernel':32s}" + "".join(f"{side + ' GB/s':>14s}" for side in isas + ["torch"]) + f"{'x torch':>9s}")
    for name, nbytes, sides in cases(x, args.block_size, args.chunks, isas):
        check_equal(sides)
        rounds = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, fn in sides.items():
                rounds[side].append(median_seconds(fn, args.steps))
        seconds = {side: statistics.median(times) for side, times in rounds.items()}
        rates = "".join(f"{nbytes / seconds[side] / 1e9:14.2f}" for side in sides)
        print(f"{name:32s}{rates}{seconds['torch'] / seconds[isas[0]]:9.1f}")


if __name__ == "__main__":
    main()
