"""The fused C++ Adam kernel (megazero._C) against torch's AdamW on one flat fp32 partition.

Two steps, each timed for every side on the same data:

- fp32 step: fp32 param, grad, exp_avg, exp_avg_sq, updated in place.
    ours      megazero.ops.adam.adam_update (the kernel: one pass over memory)
    fused     torch.optim.AdamW(fused=True)
    foreach   torch.optim.AdamW(foreach=True)
- mixed step, as a ZeRO rank with bf16 parameters runs it: fp32 master + bf16 gradient in, the
  updated master and its bf16 copy (the model's parameter) out.
    ours      adam_update(master, grad_bf16, ..., param_copy=param_bf16): still one pass
    torch     AdamW needs fp32 grads, so:
              master.grad.copy_(grad_bf16); step(); param_bf16.copy_(master)
  and, as a second view, the same with the gradient already in fp32 (grad accumulated in fp32):
    ours      adam_update(master, grad_fp32, ..., param_copy=param_bf16)
    fused     step(); param_bf16.copy_(master)

Every side gets torch's intra-op threads (the kernel the same count), with weight decay and a
grad scale. Sides take turns over rounds, each round from fresh state, so a burst of load from
elsewhere lands on all of them; per side and round the median step time is kept, and the table
shows the median over rounds (and the fastest round), wall and process CPU time. "x ours" = peer
time / our time (above 1: ours is faster). On a shared machine the CPU-time ratio at one thread
is the steadier one: time spent descheduled is not counted (with more threads it also counts
threads spinning at a barrier).

GB/s counts the bytes one pass must move per element: 28 for the fp32 step and for the mixed step
with a bf16 grad (read grad, param, exp_avg, exp_avg_sq; write the three states and the copy), 30
with an fp32 grad and a bf16 copy. Beside it, a plain fp32 `copy_` of the same length measured in
the same run (8 bytes per element: read + write). The load average is printed at start and end:
the numbers are only as quiet as the machine.

    python bench/bench_cpu_adam.py                          # 10M and 100M, 1 thread and torch's
    python bench/bench_cpu_adam.py --numel 10000000 --threads 1 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from megazero.ops.adam import adam_update, kernel_info
from megazero.ops.adam_config import AdamConfig

CONFIG = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
GRAD_SCALE = 0.5
# Bytes one pass must move per element: the grad, param/exp_avg/exp_avg_sq read and written, the copy.
BYTES = {"fp32 step": 28, "mixed step, bf16 grad": 28, "mixed step, fp32 grad": 30}


def timed(step_fn: Callable[[int], None], warmup: int, steps: int) -> tuple[float, float]:
    """Median (wall, process CPU) seconds of `steps` calls after `warmup`; step_fn gets the Adam
    step number (from 1)."""
    for step in range(1, warmup + 1):
        step_fn(step)
    wall, cpu = [], []
    for step in range(warmup + 1, warmup + steps + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        step_fn(step)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def ours(init: dict, grad_key: str, with_copy: bool) -> Callable[[int], None]:
    param, grad = init["param"].clone(), init[grad_key]
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    copy = torch.empty_like(param, dtype=torch.bfloat16) if with_copy else None

    def step_fn(step: int) -> None:
        adam_update(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=CONFIG.lr,
            config=CONFIG,
            weight_decay=CONFIG.weight_decay,
            grad_scale=GRAD_SCALE,
            param_copy=copy,
        )

    return step_fn


def torch_adamw(init: dict, impl: str, bf16_grad: bool = False, with_copy: bool = False):
    """torch's AdamW, and for the mixed step as a mixed-precision user must run it: the bf16 grad
    converted into the fp32 .grad first, the master copied into the bf16 parameter after. (Our
    side also multiplies by a grad scale, which torch's plain step lacks: one multiply per
    element, free next to the memory traffic.)"""
    master = torch.nn.Parameter(init["param"].clone())
    master.grad = init["grad32"].clone()
    optim = torch.optim.AdamW(
        [master],
        lr=CONFIG.lr,
        betas=(CONFIG.beta1, CONFIG.beta2),
        eps=CONFIG.eps,
        weight_decay=CONFIG.weight_decay,
        **{impl: True},
    )
    param16 = torch.empty_like(master, dtype=torch.bfloat16) if with_copy else None
    grad16 = init["grad16"]

    def step_fn(step: int) -> None:
        if bf16_grad:
            master.grad.copy_(grad16)
        optim.step()
        if with_copy:
            param16.copy_(master.detach())

    return step_fn


def plain_copy(init: dict) -> Callable[[int], None]:
    src, dst = init["param"], torch.empty_like(init["param"])
    return lambda step: dst.copy_(src)


def sides() -> dict:
    """(step kind, side name) -> factory(init)."""
    return {
        ("fp32 step", "ours"): lambda i: ours(i, "grad32", False),
        ("fp32 step", "fused"): lambda i: torch_adamw(i, "fused"),
        ("fp32 step", "foreach"): lambda i: torch_adamw(i, "foreach"),
        ("mixed step, bf16 grad", "ours"): lambda i: ours(i, "grad16", True),
        ("mixed step, bf16 grad", "fused"): lambda i: torch_adamw(i, "fused", True, True),
        ("mixed step, bf16 grad", "foreach"): lambda i: torch_adamw(i, "foreach", True, True),
        ("mixed step, fp32 grad", "ours"): lambda i: ours(i, "grad32", True),
        ("mixed step, fp32 grad", "fused"): lambda i: torch_adamw(i, "fused", False, True),
        ("copy", "plain fp32 copy_"): plain_copy,
    }


def measure(numel: int, threads: int, args) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    grad32 = torch.randn(numel, generator=gen)
    init = {"param": torch.randn(numel, generator=gen), "grad32": grad32, "grad16": grad32.bfloat16()}
    rounds = {key: [] for key in sides()}
    for _ in range(args.rounds):
        for key, make in sides().items():
            rounds[key].append(timed(make(init), args.warmup, args.steps))  # state freed after
    return rounds


def report(numel: int, threads: int, rounds: dict) -> None:
    ms = {key: 1e3 * statistics.median(wall for wall, _ in r) for key, r in rounds.items()}
    best = {key: 1e3 * min(wall for wall, _ in r) for key, r in rounds.items()}
    cpu = {key: 1e3 * statistics.median(c for _, c in r) for key, r in rounds.items()}
    copy_ms = ms[("copy", "plain fp32 copy_")]
    print(
        f"\n## {numel:,} elements, {threads} thread(s); plain fp32 copy_: {copy_ms:.2f} ms = "
        f"{8 * numel / copy_ms / 1e6:.1f} GB/s"
    )
    print("| step | side | ms/step | fastest round | cpu ms | Gparams/s | GB/s | x ours | x ours (cpu) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, nbytes in BYTES.items():
        mine = (ms[(kind, "ours")], cpu[(kind, "ours")])
        for (k, side), value in ms.items():
            if k != kind:
                continue
            key = (k, side)
            gbs = f"{nbytes * numel / value / 1e6:.1f}" if side == "ours" else ""
            ratios = ("", "")
            if side != "ours":
                ratios = (f"{value / mine[0]:.2f}", f"{cpu[key] / mine[1]:.2f}")
            print(
                f"| {kind} | {side} | {value:.2f} | {best[key]:.2f} | {cpu[key]:.2f} | "
                f"{numel / value / 1e6:.2f} | {gbs} | {ratios[0]} | {ratios[1]} |"
            )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--numel", type=int, nargs="+", default=[10_000_000, 100_000_000], help="partition sizes (elements)")
    p.add_argument(
        "--threads", type=int, nargs="+", default=None, help="intra-op thread counts (default: 1 and torch's default)"
    )
    p.add_argument("--rounds", type=int, default=3, help="passes over all sides")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per side and round")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    default_threads = torch.get_num_threads()
    threads = args.threads or sorted({1, default_threads})
    info = kernel_info()
    print(
        f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), kernel {info}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )
    if not info["enabled"]:
        raise SystemExit("the C++ kernel is not available (not built, or MEGAZERO_DISABLE_CPP_ADAM=1)")
    for numel in args.numel:
        for count in threads:
            report(numel, count, measure(numel, count, args))
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
