"""The fused C++ Adam kernel (megazero._C) against its peers on one flat fp32 partition, in one run.

    kernel      megazero.zero.adam.adam_update with the extension (one pass over memory)
    reference   megazero.zero.adam.adam_update_reference (torch ops, AdamW's order: ~8 passes)
    foreach     torch.optim.AdamW(foreach=True)
    fused       torch.optim.AdamW(fused=True), where this torch supports it on CPU

Every side updates the same 10M-element fp32 partition with weight decay, using all of torch's
intra-op threads (the kernel gets the same count). The kernel and the reference also run with a
bf16 gradient, the mixed-precision case ZeRO hands them. The sides take turns over several rounds
(fresh state each round). Reported: median ms per step over all timed steps (after warm-up), the
kernel's effective memory traffic, and ratios kernel / peer (below 1: the kernel is faster). The
whole run takes ~10 s on 2 cores.

    python bench/bench_cpu_adam.py
    python bench/bench_cpu_adam.py --numel 1000000 --steps 50 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from megazero.zero import adam as adam_module
from megazero.zero.adam import AdamConfig, adam_update_reference, kernel_info

CONFIG = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def time_steps(step_fn: Callable[[int], None], warmup: int, steps: int) -> list[float]:
    """Wall time of each timed call, in seconds; step_fn gets the Adam step number (from 1)."""
    for step in range(1, warmup + 1):
        step_fn(step)
    times = []
    for step in range(warmup + 1, warmup + steps + 1):
        start = time.perf_counter()
        step_fn(step)
        times.append(time.perf_counter() - start)
    return times


def ours(update, numel: int, grad_dtype: torch.dtype) -> Callable[[int], None]:
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).to(grad_dtype)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)

    def step_fn(step: int) -> None:
        update(param, grad, exp_avg, exp_avg_sq, step=step, lr=CONFIG.lr, config=CONFIG,
               weight_decay=CONFIG.weight_decay, grad_scale=0.5)
    return step_fn


def run_kernel(param, grad, exp_avg, exp_avg_sq, **kwargs) -> None:
    assert adam_module._kernel_accepts(param, grad, exp_avg, exp_avg_sq)
    adam_module.adam_update(param, grad, exp_avg, exp_avg_sq, **kwargs)


def torch_adamw(numel: int, **impl) -> Callable[[int], None]:
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen))
    param.grad = torch.randn(numel, generator=gen)
    optim = torch.optim.AdamW([param], lr=CONFIG.lr, betas=(CONFIG.beta1, CONFIG.beta2),
                              eps=CONFIG.eps, weight_decay=CONFIG.weight_decay, **impl)
    return lambda step: optim.step()


def fused_adamw_supported() -> bool:
    try:
        torch_adamw(16, fused=True)(1)
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--numel", type=int, default=10_000_000, help="partition size (elements)")
    p.add_argument("--rounds", type=int, default=3, help="passes over all sides")
    p.add_argument("--steps", type=int, default=8, help="timed steps per side and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side and round")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = kernel_info()
    print(f"numel {args.numel:,}  threads {torch.get_num_threads()}  torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()})  kernel {info}")
    if not info["enabled"]:
        raise SystemExit("the C++ kernel is not available (not built, or MEGAZERO_DISABLE_CPP_ADAM=1)")

    n = args.numel
    # Factories, so each side's ~160 MB of state exists only while that side is timed.
    sides = {
        "kernel fp32 grad": lambda: ours(run_kernel, n, torch.float32),
        "kernel bf16 grad": lambda: ours(run_kernel, n, torch.bfloat16),
        "reference fp32 grad": lambda: ours(adam_update_reference, n, torch.float32),
        "reference bf16 grad": lambda: ours(adam_update_reference, n, torch.bfloat16),
        "torch AdamW foreach": lambda: torch_adamw(n, foreach=True),
    }
    if fused_adamw_supported():
        sides["torch AdamW fused"] = lambda: torch_adamw(n, fused=True)
    # Rounds interleave the sides, so a burst of load from elsewhere on the machine lands on all.
    samples = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, make in sides.items():
            samples[name] += time_steps(make(), args.warmup, args.steps)
    ms = {name: 1e3 * statistics.median(times) for name, times in samples.items()}

    # Bytes the kernel must move per element: read grad, p, m, v; write p, m, v.
    for name, grad_bytes in (("kernel fp32 grad", 4), ("kernel bf16 grad", 2)):
        traffic = args.numel * (grad_bytes + 24) / (ms[name] * 1e-3) / 1e9
        print(f"{name:<22} {ms[name]:8.2f} ms/step   {traffic:6.1f} GB/s effective")
    for name in [n for n in ms if not n.startswith("kernel")]:
        print(f"{name:<22} {ms[name]:8.2f} ms/step")
    print("ratios kernel / peer (below 1: kernel faster)")
    for peer in [n for n in ms if not n.startswith("kernel")]:
        mine = "kernel bf16 grad" if "bf16" in peer else "kernel fp32 grad"
        print(f"  {mine} / {peer:<22} {ms[mine] / ms[peer]:6.3f}")


if __name__ == "__main__":
    main()
