"""A user's own model under megazero.initialize against DeepSpeed's engine, in one run, on 2 gloo
ranks on CPU: the same transformers LlamaForCausalLM (same weights: built from one seed), the same
DeepSpeed config, client optimizer (torch.optim.AdamW), data and loop on both sides.

    ours    megazero.initialize(model, optimizer=AdamW, config)   ZeRO-2 / ZeRO-3
    peer    deepspeed.initialize(model, optimizer=AdamW, config)  its CPU accelerator, same config
            (plus zero_allow_untested_optimizer: DeepSpeed steps the torch AdamW itself; ours reads
            its hyperparameters and steps its own Adam on each partition)

The config: micro batch 4, 2 accumulation steps, gradient_clipping 1.0, DeepSpeed's default
zero_optimization otherwise; fp32; dropout off. Each side runs `engine(input_ids=, labels=)`,
`engine.backward(loss)`, `engine.step()` per micro batch; the loss is transformers' own. Every
configuration runs in a fresh pair of processes (its own `ru_maxrss`), in rounds (ds2, zero2, ds3,
zero3, again), keeping each one's fastest round. Columns, worst rank:
  ms/step  median wall time per optimizer step (after warm-up)
  cpu ms   median process CPU time per step, all threads: barely moved by other load
  peak     peak RSS; +model: peak minus the RSS before the model is built
Ratios are ours / DeepSpeed's (below 1: ours faster or smaller). The losses of both sides are
printed with their largest relative gap: same weights, data, config and optimizer math.

    python bench/bench_own_model_vs_deepspeed.py              # ~3 min on 2 quiet cores
    python bench/bench_own_model_vs_deepspeed.py --rounds 1 --steps 4
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from megazero.testing import DistributedPool

WORLD = 2
CONFIGS = [("ds2", "deepspeed", 2), ("zero2", "ours", 2), ("ds3", "deepspeed", 3), ("zero3", "ours", 3)]


@dataclasses.dataclass
class Shape:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 704
    vocab: int = 8192
    seq: int = 128
    micro: int = 4
    accumulation: int = 2
    steps: int = 8
    warmup: int = 2
    lr: float = 3e-4
    clip: float = 1.0


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(shape: Shape):
    import transformers as tf

    torch.manual_seed(1234)
    config = tf.LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.seq,
        attention_dropout=0.0,
    )
    model = tf.LlamaForCausalLM(config)
    return model, torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.01)


def config(shape: Shape, stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": shape.micro,
        "gradient_accumulation_steps": shape.accumulation,
        "gradient_clipping": shape.clip,
        "zero_optimization": {"stage": stage},
    }


def worker(ctx, shape: Shape, side: str, stage: int) -> dict:
    torch.set_num_threads(1)
    if side == "ours":
        import megazero
        from megazero.parallel.topology import Topology

        groups = ctx.groups(Topology(world_size=WORLD))
        baseline = rss_mib()
        model, optimizer = build(shape)
        engine, *_ = megazero.initialize(
            model=model, optimizer=optimizer, config=config(shape, stage), process_groups=groups
        )
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["LOCAL_RANK"] = str(ctx.rank)
        import deepspeed

        baseline = rss_mib()
        model, optimizer = build(shape)
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            dist_init_required=False,
            config={**config(shape, stage), "zero_allow_untested_optimizer": True, "steps_per_print": 2**31},
        )
    g = torch.Generator().manual_seed(7)
    data = [
        torch.randint(0, shape.vocab, (shape.micro * shape.accumulation * WORLD, shape.seq), generator=g)
        for _ in range(shape.warmup + shape.steps)
    ]
    losses, wall, cpu = [], [], []
    for i, batch in enumerate(data):
        started, cpu_started = time.perf_counter(), time.process_time()
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(shape.accumulation):
            row = (m * WORLD + ctx.rank) * shape.micro
            tokens = batch[row : row + shape.micro]
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / (shape.accumulation * WORLD)
        dist.all_reduce(total)
        losses.append(total.item())
        if i >= shape.warmup:
            wall.append(1000 * (time.perf_counter() - started))
            cpu.append(1000 * (time.process_time() - cpu_started))
    return {
        "losses": losses,
        "ms": statistics.median(wall),
        "cpu_ms": statistics.median(cpu),
        "peak": rss_mib(),
        "baseline": baseline,
    }


def summarize(rounds: list[list[dict]]) -> dict:
    best = min(rounds, key=lambda ranks: max(r["ms"] for r in ranks))
    return {
        "ms": max(r["ms"] for r in best),
        "cpu_ms": max(r["cpu_ms"] for r in best),
        "peak": max(r["peak"] for r in best),
        "model": max(r["peak"] - r["baseline"] for r in best),
        "losses": best[0]["losses"],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=Shape.steps)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("deepspeed") is None:
        print("deepspeed is not installed (pip install deepspeed): nothing to compare with")
        return
    shape = Shape(steps=args.steps)
    print(
        f"LlamaForCausalLM h={shape.hidden} layers={shape.layers} heads={shape.heads}/{shape.kv_heads} "
        f"ffn={shape.ffn} vocab={shape.vocab} seq={shape.seq}; micro {shape.micro} x {shape.accumulation} "
        f"accumulation x {WORLD} ranks; fp32 torch AdamW (client optimizer), clip {shape.clip}; "
        f"{shape.warmup} warm-up + {shape.steps} timed steps; torch {torch.__version__}",
        flush=True,
    )
    runs: dict[str, list] = {}
    for round_index in range(args.rounds):
        for name, side, stage in CONFIGS:
            pool = DistributedPool(WORLD)  # fresh processes: ru_maxrss is this config's own peak
            try:
                ranks = pool.run(worker, shape, side, stage, timeout=1800)
            finally:
                pool.close()
            runs.setdefault(name, []).append(ranks)
            print(f"  round {round_index + 1} {name:<6} {max(r['ms'] for r in ranks):8.1f} ms/step", flush=True)
    rows = {name: summarize(rounds) for name, rounds in runs.items()}
    print("\n| stage | side | ms/step | cpu ms | peak MiB | +model MiB | time x | cpu x | peak x | +model x |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for stage in (2, 3):
        ds, ours = rows[f"ds{stage}"], rows[f"zero{stage}"]
        print(
            f"| {stage} | DeepSpeed | {ds['ms']:.1f} | {ds['cpu_ms']:.1f} | {ds['peak']:.1f} | {ds['model']:.1f} |"
            " | | | |"
        )
        print(
            f"| {stage} | megazero | {ours['ms']:.1f} | {ours['cpu_ms']:.1f} | {ours['peak']:.1f} | "
            f"{ours['model']:.1f} | {ours['ms'] / ds['ms']:.3f} | {ours['cpu_ms'] / ds['cpu_ms']:.3f} | "
            f"{ours['peak'] / ds['peak']:.3f} | {ours['model'] / ds['model']:.3f} |"
        )
    for stage in (2, 3):
        a, b = torch.tensor(rows[f"zero{stage}"]["losses"]), torch.tensor(rows[f"ds{stage}"]["losses"])
        gap = ((a - b).abs() / b.abs()).max().item()
        print(f"stage {stage} losses, megazero: {[round(x, 6) for x in a.tolist()]}")
        print(f"stage {stage} losses, DeepSpeed: {[round(x, 6) for x in b.tolist()]}  largest gap {gap:.2e}")


if __name__ == "__main__":
    main()
