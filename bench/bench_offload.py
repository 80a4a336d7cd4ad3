"""Optimizer-state offload: the optimizer step's time with the states on the device, in host memory
(offload_optimizer cpu) and in swap files (nvme) with and without overlapped reads and writes.

One process (a gloo group of one), ZeRO stage 1, fp32, the same model, init, data and AdamW on every
side; only `offload_optimizer` differs:

  device      states on the device (here the CPU too): the peer of the cpu side
  cpu         states in host memory: each sub-group's gradients copied out, updated weights back
  nvme sync   states in swap files under --nvme-path, pipeline_read/pipeline_write off: every
              sub-group is read, stepped and written one after the other
  nvme overlap  pipeline_read and pipeline_write on: sub-group k+1 is read and k-1 written (threads,
              os.preadv/os.pwrite, CRC-32 each way) while k steps

Timed: `engine.step` alone (clip, Adam, weights back, and for nvme the swapping), median over the
timed steps after warm-up; configurations run in rounds and each keeps its fastest. Ratios: cpu /
device, nvme sync / nvme overlap (above 1: the overlap pays). The swap directory sits wherever
--nvme-path points; on a page-cached file system the reads and writes are memory copies, so the
overlap hides the CRC and copy time rather than a disk's latency. Losses are printed to show every
side did the same work (they agree exactly: the step is the same kernel on the same values).

    python bench/bench_offload.py                          # ~1 min on 2 cores
    python bench/bench_offload.py --hidden 512 --nvme-path /local/nvme/dir --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

CONFIGS = {
    "device": None,
    "cpu": {"device": "cpu"},
    "nvme sync": {"device": "nvme", "pipeline_read": False, "pipeline_write": False},
    "nvme overlap": {"device": "nvme", "pipeline_read": True, "pipeline_write": True},
}


def bench_worker(ctx, args, block):
    """Trains args.steps steps with `block` as offload_optimizer; returns (step ms list, losses)."""
    import torch

    from megazero.config.train_config import OptimizerConfig, ParallelConfig, TrainConfig
    from megazero.data.synthetic import ArithmeticTokens
    from megazero.models.config import GPTConfig
    from megazero.parallel.topology import Topology
    from megazero.training import MicrobatchSource, setup, train_step
    from megazero.ops.adam import AdamConfig
    from megazero.zero.config import ZeroConfig
    torch.set_num_threads(args.threads)
    zero = {"stage": 1, "sub_group_size": args.sub_group_size}
    if block is not None:
        zero["offload_optimizer"] = {**block, "nvme_path": args.nvme_path, "buffer_count": 4}
    model = GPTConfig(vocab_size=1024, padded_vocab_size=1024, hidden_size=args.hidden,
                      num_layers=args.layers, num_attention_heads=8, ffn_hidden_size=4 * args.hidden,
                      seq_length=64, hidden_dropout=0.0, attention_dropout=0.0)
    cfg = TrainConfig(model=model, zero=ZeroConfig(**zero), micro_batch_size=2, global_batch_size=2,
                      optimizer=OptimizerConfig(lr=1e-4, adam=AdamConfig(lr=1e-4, weight_decay=0.1)),
                      train_iters=args.steps, seed=1, parallel=ParallelConfig())
    groups = ctx.groups(Topology(world_size=1, tp=1, pp=1))
    state = setup(cfg, groups)
    source = MicrobatchSource(ArithmeticTokens(1024, 64, seed=3), 2, 2, 0, 1)
    times, losses, step = [], [], state.engine.step

    def timed_step(lr):
        start = time.perf_counter()
        out = step(lr)
        times.append(1000 * (time.perf_counter() - start))
        return out
    state.engine.step = timed_step
    for it in range(args.steps):
        losses.append(train_step(state, source.batch(it), 1e-4).loss)
    return times[args.warmup:], losses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sub-group-size", type=int, default=1_000_000)
    parser.add_argument("--nvme-path", default=None, help="swap directory (default: a temporary one)")
    args = parser.parse_args(argv)
    from megazero.testing import DistributedPool
    tmp = None
    if args.nvme_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-offload-")
        args.nvme_path = tmp.name
    pool = DistributedPool(1)
    best: dict[str, float] = {}
    losses: dict[str, list[float]] = {}
    try:
        for _ in range(args.rounds):
            for name, block in CONFIGS.items():
                times, losses[name] = pool.run(bench_worker, args, block)[0]
                best[name] = min(best.get(name, float("inf")), statistics.median(times))
    finally:
        pool.close()
        if tmp is not None:
            tmp.cleanup()
    print(f"model: hidden {args.hidden}, {args.layers} layers; sub_group_size {args.sub_group_size}; "
          f"{args.threads} threads; fastest of {args.rounds} rounds, median of {args.steps - args.warmup} steps")
    print("| states | step ms | losses (first 3) |")
    print("|---|---|---|")
    for name in CONFIGS:
        print(f"| {name} | {best[name]:.1f} | {', '.join(f'{x:.6f}' for x in losses[name][:3])} |")
    print(f"cpu offload / device step time: {best['cpu'] / best['device']:.2f}")
    print(f"nvme sync / nvme overlap step time: {best['nvme sync'] / best['nvme overlap']:.2f}")


if __name__ == "__main__":
    main()
