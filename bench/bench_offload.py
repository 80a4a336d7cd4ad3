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

`--zenflow`: ZenFlow in its real setting (topk_ratio 0.05, update_interval 4, overlap_step) against
plain cpu offload and the device optimizer, the same model, init and data (the embedded stdlib
corpus, megazero.data.default_data) for --steps steps (200 is the issue's run). Printed: each side's
final loss (mean of the last 10) and ZenFlow's gap to the device Adam's, beside the device Adam's
loss after steps / update_interval steps (as many updates as the unselected columns, 95% of them,
had: the gap's cause in a short run from scratch); the wall_clock_breakdown
(forward, backward, reduce, step ms per step) of each side; ZenFlow's CPU Adam ms per step (on its
thread) against the ms per step the training thread waited for it, and the step-phase ratio
offload / ZenFlow (above 1: the CPU Adam is off the critical path).

    python bench/bench_offload.py --zenflow --steps 200 --hidden 64 --layers 2 --threads 1   # ~20 min, 2 loaded cores
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
    from megazero.data.sampler import MicrobatchSource
    from megazero.training import setup, train_step
    from megazero.ops.adam_config import AdamConfig
    from megazero.zero.config import ZeroConfig

    torch.set_num_threads(args.threads)
    zero = {"stage": 1, "sub_group_size": args.sub_group_size}
    if block is not None:
        zero["offload_optimizer"] = {**block, "nvme_path": args.nvme_path, "buffer_count": 4}
    model = GPTConfig(
        vocab_size=1024,
        padded_vocab_size=1024,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=8,
        ffn_hidden_size=4 * args.hidden,
        seq_length=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    cfg = TrainConfig(
        model=model,
        zero=ZeroConfig(**zero),
        micro_batch_size=2,
        global_batch_size=2,
        optimizer=OptimizerConfig(lr=1e-4, adam=AdamConfig(lr=1e-4, weight_decay=0.1)),
        train_iters=args.steps,
        seed=1,
        parallel=ParallelConfig(),
    )
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
    return times[args.warmup :], losses


ZENFLOW_SIDES = {
    "device Adam": {},
    "cpu offload": {"offload_optimizer": {"device": "cpu"}},
    "zenflow": {
        "offload_optimizer": {"device": "cpu"},
        "zenflow": {"topk_ratio": 0.05, "update_interval": 4, "overlap_step": True},
    },
}


def zenflow_worker(ctx, args, extra, data_prefix):
    """Trains args.steps steps on the stdlib corpus; returns (losses, breakdown ms per step, ZenFlow stats)."""
    import torch

    from megazero.config.train_config import OptimizerConfig, ParallelConfig, TrainConfig
    from megazero.data.builders import build_train_valid_test_datasets
    from megazero.models.config import GPTConfig
    from megazero.ops.adam_config import AdamConfig
    from megazero.parallel.topology import Topology
    from megazero.data.sampler import MicrobatchSource
    from megazero.training import setup, train_step
    from megazero.zero.config import ZeroConfig

    torch.set_num_threads(args.threads)
    seq, batch = 64, 8
    model = GPTConfig(
        vocab_size=8192,
        padded_vocab_size=8192,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=4,
        ffn_hidden_size=4 * args.hidden,
        seq_length=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    cfg = TrainConfig(
        model=model,
        zero=ZeroConfig(stage=2, **extra),
        micro_batch_size=batch,
        global_batch_size=batch,
        train_iters=args.steps,
        seed=1,
        parallel=ParallelConfig(),
        optimizer=OptimizerConfig(lr=args.lr, adam=AdamConfig(lr=args.lr, weight_decay=0.01)),
    )
    cfg.wall_clock_breakdown = True
    state = setup(cfg, ctx.groups(Topology(world_size=1, tp=1, pp=1)))
    train, _, _ = build_train_valid_test_datasets(
        data_prefix, "100,0,0", seq, 1, (args.steps * batch, 0, 0), progress=False
    )
    source = MicrobatchSource(train, batch, batch, 0, 1)
    losses = [train_step(state, source.batch(it), args.lr).loss for it in range(args.steps)]
    breakdown = {k: v / args.steps for k, v in state.timers.elapsed_ms().items()}
    stats = [s.offload.stats for s in state.engine.storages() if hasattr(getattr(s, "offload", None), "stats")]
    zen = {k: sum(st[k] for st in stats) / args.steps for k in ("cpu_adam_ms", "wait_ms")} if stats else None
    return losses, breakdown, zen


def zenflow_main(args) -> None:
    from megazero.data.default_data import prepare_default_data
    from megazero.testing import DistributedPool

    prefix, _ = prepare_default_data(progress=False)
    pool = DistributedPool(1)
    try:
        out = {
            name: pool.run(zenflow_worker, args, extra, prefix, timeout=7200)[0]
            for name, extra in ZENFLOW_SIDES.items()
        }
    finally:
        pool.close()
    final = {name: sum(losses[-10:]) / 10 for name, (losses, _, _) in out.items()}
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab 8192, seq 64, batch 8; stage 2 fp32; "
        f"{args.steps} steps, lr {args.lr}; {args.threads} threads"
    )
    print("| side | final loss | forward ms | backward ms | reduce ms | step ms |")
    print("|---|---|---|---|---|---|")
    for name, (_, phases, _) in out.items():
        print(
            f"| {name} | {final[name]:.4f} | "
            + " | ".join(f"{phases.get(k, 0.0):.1f}" for k in ("forward", "backward", "reduce", "step"))
            + " |"
        )
    zen = out["zenflow"][2]
    gap = (final["zenflow"] - final["device Adam"]) / final["device Adam"]
    print(f"zenflow final loss vs device Adam: {100 * gap:+.2f}%")
    k = ZENFLOW_SIDES["zenflow"]["zenflow"]["update_interval"]
    adam = out["device Adam"][0]
    windows = max(1, args.steps // k)
    tail = adam[max(0, windows - 10) : windows]
    early = sum(tail) / len(tail)
    print(f"device Adam after {windows} steps (the unselected columns' {windows} CPU updates): {early:.4f}")
    print(
        f"zenflow CPU Adam {zen['cpu_adam_ms']:.1f} ms/step on its thread, training thread waited "
        f"{zen['wait_ms']:.1f} ms/step for it"
    )
    print(f"step phase, cpu offload / zenflow: {out['cpu offload'][1]['step'] / out['zenflow'][1]['step']:.2f}")


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
    parser.add_argument("--zenflow", action="store_true", help="ZenFlow vs cpu offload vs device Adam")
    parser.add_argument("--lr", type=float, default=1e-3, help="--zenflow: the learning rate")
    args = parser.parse_args(argv)
    if args.zenflow:
        zenflow_main(args)
        return
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
    print(
        f"model: hidden {args.hidden}, {args.layers} layers; sub_group_size {args.sub_group_size}; "
        f"{args.threads} threads; fastest of {args.rounds} rounds, median of {args.steps - args.warmup} steps"
    )
    print("| states | step ms | losses (first 3) |")
    print("|---|---|---|")
    for name in CONFIGS:
        print(f"| {name} | {best[name]:.1f} | {', '.join(f'{x:.6f}' for x in losses[name][:3])} |")
    print(f"cpu offload / device step time: {best['cpu'] / best['device']:.2f}")
    print(f"nvme sync / nvme overlap step time: {best['nvme sync'] / best['nvme overlap']:.2f}")


if __name__ == "__main__":
    main()
