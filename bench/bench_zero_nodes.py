"""ZeRO-3 across simulated nodes: plain, hierarchical (two-hop) gather, hpZ, both, and ZeRO++'s
quantized qwZ / qgZ (alone, with hpZ, and with everything), on 8 gloo ranks acting as 2 nodes of 4
(`ranks_per_node` 4), in one run.

Every row trains the same GPT (fp32, dp 8, one shard group of 8 spanning both nodes) from the same
weights on the same batches, with `param_persistence_threshold` 0 (every parameter in a unit) and
`max_reuse_distance` 0 (a unit is released after each use, so the backward gathers again, as FSDP
does). The rows differ only in their `zero_optimization` keys. Per row, worst rank:
  ms/step   median wall time of the timed steps (each ends with the loss all-reduce)
  cpu ms    median process CPU time per step (all threads, gloo's included)
  inter MiB comm-layer bytes per rank per step over groups that span nodes, all ops
  intra MiB the same for groups inside one node
  formula   the inter-node bytes the scheme should move (megazero.zero.quantized_comm.
            stage3_inter_node_bytes): with P this rank's partition bytes (every unit's chunk once),
            N = 8 shard ranks and n = 2 nodes, the reduce-scatter moves (N-1)P and each gather
            (N-1)P flat, (n-1)P in two hops, nothing across nodes from hpZ's secondary (the backward
            gather); quantized rows move int8 codes + an fp32 scale per 256 per weight (qwZ) and int4
            + a scale per 128 per gradient (qgZ) of the P / 4 elements, qgZ's gradients crossing
            nodes once, (n-1) chunks, after the node's sum
The rows run in rounds (each row once per round) and keep their fastest round: other load only
adds time. Ratios are against the plain row. On one machine the "inter-node" links are as fast as
the others, so the time column shows what the extra hop and copies cost, and the byte columns what
a real cluster's slow links would carry. The first losses of every row are printed: same work
(the quantized rows' differ from the third digit or so: their weights and gradients are rounded).

Add a row with one line in ROWS: (name, zero_optimization keys).

    python bench/bench_zero_nodes.py                   # a few minutes on 2 cores (8 processes)
    python bench/bench_zero_nodes.py --rounds 1 --rows plain,hpz
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time


from megazero.config.train_config import OptimizerConfig, ParallelConfig, TrainConfig
from megazero.data.synthetic import SyntheticTokens
from megazero.models.config import GPTConfig
from megazero.parallel.topology import Topology
from megazero.testing import DistributedPool
from megazero.data.sampler import MicrobatchSource
from megazero.training import setup, train_step
from megazero.ops.adam_config import AdamConfig
from megazero.zero.config import ZeroConfig
from megazero.zero.quantized_comm import stage3_inter_node_bytes

WORLD, RANKS_PER_NODE = 8, 4
NODES = WORLD // RANKS_PER_NODE
QUANTIZED = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
HPZ = {"zero_hpz_partition_size": RANKS_PER_NODE}
TWO_HOPS = {"mics_hierarchical_params_gather": True}
# name, zero_optimization keys on top of the base; each row's inter-node bytes per step are checked
# against megazero.zero.quantized_comm.stage3_inter_node_bytes.
ROWS = [
    ("plain", {}),
    ("hierarchical", TWO_HOPS),
    ("hpz", HPZ),
    ("hierarchical+hpz", {**TWO_HOPS, **HPZ}),
    ("qwz", {"zero_quantized_weights": True}),
    ("qgz", {"zero_quantized_gradients": True}),
    ("zero++", {**QUANTIZED, **HPZ}),
    ("all", {**QUANTIZED, **HPZ, **TWO_HOPS}),
]
BASE = {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0}


@dataclasses.dataclass
class Bench:
    model: GPTConfig
    micro_batch: int
    global_batch: int
    steps: int
    warmup: int


def row_config(bench: Bench, keys: dict) -> TrainConfig:
    zero = ZeroConfig(**{**BASE, **keys})
    opt = OptimizerConfig(
        lr=1e-3,
        min_lr=1e-3,
        warmup_iters=0,
        decay_style="constant",
        adam=AdamConfig(lr=1e-3, weight_decay=0.1),
        clip_grad=1.0,
    )
    return TrainConfig(
        model=bench.model,
        zero=zero,
        optimizer=opt,
        micro_batch_size=bench.micro_batch,
        global_batch_size=bench.global_batch,
        train_iters=bench.warmup + bench.steps,
        seed=1,
        parallel=ParallelConfig(ranks_per_node=RANKS_PER_NODE),
    )


def run_row(ctx, bench: Bench, keys: dict) -> dict:
    """Pool entry: one row on this rank; times, bytes per step by locality, partition bytes, losses."""
    cfg = row_config(bench, keys)
    topology = Topology(
        world_size=WORLD, ranks_per_node=RANKS_PER_NODE, hpz_partition_size=cfg.zero.zero_hpz_partition_size
    )
    groups = ctx.groups(topology)
    state = setup(cfg, groups)
    data = SyntheticTokens(bench.model.vocab_size, bench.model.seq_length, seed=1)
    source = MicrobatchSource(data, bench.global_batch, bench.micro_batch, groups.coords.dp, topology.dp)
    steps = [source.batch(i) for i in range(bench.warmup + bench.steps)]
    losses, wall, cpu = [], [], []
    for i, microbatches in enumerate(steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        losses.append(train_step(state, microbatches, 1e-3).loss)
        if i >= bench.warmup:
            wall.append(1000 * (time.perf_counter() - started))
            cpu.append(1000 * (time.process_time() - cpu_started))
    by_locality = {"intra": 0.0, "inter": 0.0}
    for (_, _, loc), nbytes in groups.log.last_step.items():
        by_locality[loc] += nbytes
    return {
        "ms": statistics.median(wall),
        "cpu": statistics.median(cpu),
        "losses": losses,
        "partition": state.engine.unit_storage.partition_size * state.engine.unit_storage.partition.element_size(),
        **by_locality,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(name for name, _ in ROWS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    rows = [row for row in ROWS if row[0] in args.rows.split(",")]
    model = GPTConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=4,
        ffn_hidden_size=4 * args.hidden,
        seq_length=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    bench = Bench(model, micro_batch=2, global_batch=2 * WORLD, steps=args.steps, warmup=args.warmup)
    pool = DistributedPool(WORLD)
    best: dict[str, dict] = {}
    try:
        for _ in range(args.rounds):
            for name, keys in rows:
                ranks = pool.run(run_row, bench, keys)
                worst = {k: max(r[k] for r in ranks) for k in ("ms", "cpu", "inter", "intra", "partition")}
                worst["losses"] = ranks[0]["losses"]
                if name not in best or worst["ms"] < best[name]["ms"]:
                    best[name] = worst
    finally:
        pool.close()
    print_table(rows, best, bench)


def print_table(rows, best: dict, bench: Bench) -> None:
    mib = 2**20
    plain = best.get("plain")
    print(
        f"ZeRO-3, dp {WORLD} as {NODES} nodes of {RANKS_PER_NODE}, fp32, GPT hidden {bench.model.hidden_size} "
        f"x {bench.model.num_layers} layers, {bench.warmup} warm-up + {bench.steps} timed steps"
    )
    print("| row | ms/step | cpu ms | inter MiB | intra MiB | formula MiB | inter/formula | time x | inter x |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, keys in rows:
        r = best[name]
        # fp32 weights and gradients: partition bytes / 4 elements, 4 bytes each
        expected = stage3_inter_node_bytes(ZeroConfig(**BASE, **keys), r["partition"] // 4, WORLD, NODES, 4, 4)
        cells = [
            name,
            f"{r['ms']:.1f}",
            f"{r['cpu']:.1f}",
            f"{r['inter'] / mib:.3f}",
            f"{r['intra'] / mib:.3f}",
            f"{expected / mib:.3f}",
            f"{r['inter'] / expected:.4f}",
            f"{r['ms'] / plain['ms']:.3f}" if plain else "",
            f"{r['inter'] / plain['inter']:.3f}" if plain else "",
        ]
        print("| " + " | ".join(cells) + " |")
    print("first losses per row (same work):")
    for name, _ in rows:
        print(f"  {name:18s} " + " ".join(f"{x:.7f}" for x in best[name]["losses"][:3]))


if __name__ == "__main__":
    main()
