"""Mixture of experts: the MoE block's forward + backward against a dense MLP of the same active
parameters, grouped GEMM (torch._grouped_mm) against the loop of matmuls, and all-to-all against
all-gather dispatch at ep 2 and 4, all measured in the same run, with ratios.

    python bench/bench_moe.py                 # tokens 4096, hidden 512, 8 experts of 1024, top-2
    python bench/bench_moe.py --tiny          # seconds: the test's path check

One process: the pure layer (models/moe.py) and the dense MLP whose width is k x the expert width
(what each token computes through the experts), on the same tokens; the loop and grouped-GEMM
experts. Expert parallelism: a pool of gloo ranks (one per EP rank, the CPU's cores shared between
them), each routing its own tokens through ParallelMoELayer (parallel/moe.py); the all-to-all and the
all-gather dispatchers give the same outputs (checked) and the comm log's bytes on the ep group per
step are printed beside the time. ms are medians of the timed repetitions after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megazero.core.comm import CommLog
from megazero.models.config import GPTConfig
from megazero.models.gpt import MLP, initial_value
from megazero.models.moe import MoELayer
from megazero.models.param_info import param_info
from megazero.parallel.moe import parallelize_moe
from megazero.parallel.topology import Topology


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024, help="each expert's width")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--eps", default="2,4", help="expert-parallel sizes of the dispatch comparison")
    p.add_argument("--tiny", action="store_true", help="tokens 64, hidden 32, 4 experts of 32, one repeat")
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.hidden, args.experts, args.ffn, args.repeats = 64, 32, 4, 32, 1
    return args


def config(args, **extra) -> GPTConfig:
    return GPTConfig(
        vocab_size=64,
        hidden_size=args.hidden,
        num_layers=1,
        num_attention_heads=4,
        seq_length=args.tokens,
        num_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.ffn,
        ffn_hidden_size=args.topk * args.ffn,
        activation="swiglu",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **extra,
    )


def init(module, cfg: GPTConfig, prefix: str) -> None:
    for name, p in module.named_parameters():
        p.data = initial_value(cfg, prefix + name, p.shape, 0)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def step(module, x):
    def run():
        module.zero_grad(set_to_none=True)
        module(x).square().mean().backward()

    return run


def one_process(args) -> dict:
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(0))
    out = {}
    dense_cfg = config(args)
    dense = MLP(dense_cfg)
    init(dense, dense_cfg, "layers.0.mlp.")
    out["dense"] = timed(step(dense, x), args.repeats)
    for grouped in (False, True):
        cfg = config(args, moe_grouped_gemm=grouped)
        moe = MoELayer(cfg)
        init(moe, cfg, "layers.0.mlp.")
        out["grouped" if grouped else "loop"] = timed(step(moe, x), args.repeats)
    return out


def _ep_worker(ctx, args, ep: int):
    groups = ctx.groups(Topology(world_size=ep, ep=ep))
    torch.set_num_threads(max(1, torch.get_num_threads() // ep))
    x = torch.randn(1, args.tokens // ep, args.hidden, generator=torch.Generator().manual_seed(groups.rank))
    result = {}
    for dispatcher in ("alltoall", "allgather"):
        cfg = config(args)
        with torch.device("meta"):
            moe = MoELayer(cfg)
        layer = parallelize_moe(
            moe, tp=groups.tp, ep=groups.ep, cp=groups.cp, sequence_parallel=False, dispatcher=dispatcher
        )
        layer.to_empty(device="cpu")
        for name, p in layer.named_parameters():
            full = initial_value(cfg, "layers.0.mlp." + name, _full_shape(p), 0)
            shard = param_info(p).tp_shard
            p.data = shard.local_from_full(full) if shard is not None else full
        groups.log.end_step()
        ms = timed(step(layer, x), args.repeats)
        log: CommLog = groups.log
        log.end_step()
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        y.square().mean().backward()
        moved = log.end_step()
        ep_bytes = sum(v for (op, group, _), v in moved.items() if group == "ep")
        result[dispatcher] = (ms, ep_bytes, y.detach())
    return result


def _full_shape(p):
    shard = param_info(p).tp_shard
    return shard.full_shape(p.shape) if shard is not None else tuple(p.shape)


def expert_parallel(args, pool_for) -> dict:
    out = {}
    for ep in [int(e) for e in args.eps.split(",") if e]:
        import bench_moe  # by module name: the pool's workers import it (bench/ is on sys.path)

        results = pool_for(ep).run(bench_moe._ep_worker, args, ep)
        for r in results:
            torch.testing.assert_close(r["alltoall"][2], r["allgather"][2], rtol=1e-5, atol=1e-6)
        out[ep] = {d: (max(r[d][0] for r in results), max(r[d][1] for r in results)) for d in ("alltoall", "allgather")}
    return out


def report(args, single: dict, ep: dict) -> list[str]:
    lines = [
        f"tokens {args.tokens}, hidden {args.hidden}, {args.experts} experts of {args.ffn}, "
        f"top-{args.topk} (dense MLP of {args.topk * args.ffn}: the same active parameters)",
        f"  dense MLP          {single['dense']:8.1f} ms",
        f"  MoE, loop          {single['loop']:8.1f} ms   x dense {single['loop'] / single['dense']:.2f}",
        f"  MoE, grouped GEMM  {single['grouped']:8.1f} ms   x dense {single['grouped'] / single['dense']:.2f}"
        f"   x loop {single['grouped'] / single['loop']:.2f}",
    ]
    for size, by in ep.items():
        a2a, ag = by["alltoall"], by["allgather"]
        lines.append(
            f"  ep {size}: alltoall {a2a[0]:8.1f} ms, {a2a[1] / 1e6:.2f} MB on ep | allgather "
            f"{ag[0]:8.1f} ms, {ag[1] / 1e6:.2f} MB | allgather / alltoall: time {ag[0] / a2a[0]:.2f}, "
            f"bytes {ag[1] / max(a2a[1], 1):.2f}"
        )
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    from megazero.testing import DistributedPool

    pools = {}

    def pool_for(n):
        if n not in pools:
            pools[n] = DistributedPool(n)
        return pools[n]

    try:
        print("\n".join(report(args, one_process(args), expert_parallel(args, pool_for))))
    finally:
        for pool in pools.values():
            pool.close(force=True)


if __name__ == "__main__":
    main()
