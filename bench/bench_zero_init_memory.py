"""zero.Init's memory: a transformers LlamaForCausalLM whose full fp32 model states do not fit one
rank's share is built and trained on 4 gloo ranks (ZeRO-3, fp32, AdamW), built inside
`megazero.zero.Init()` and built whole on every rank (the eager build), each in a fresh set of
processes. Per rank, worst rank, in MiB of peak resident memory (VmHWM, reset by /proc/self/clear_refs
after the imports, the process group and a tiny model's first step) above the RSS then:

  built    peak of the model's construction (zero.Init: its slice; eager: the whole model)
  engine   peak through megazero.initialize (the engine's storage adopting the slices)
  trained  peak through 2 training steps (micro batch 1 x seq 64)
  planned  the planner's figure: model states 16 bytes per parameter / 4 ranks
           (megazero.config.memory_estimate.model_state_bytes_per_param, stage 3, fp32) plus three
           full copies of the largest parameter (the set-up's value, its gathered weight, its full
           gradient before the reduce-scatter); activations (micro batch 1 x 64 tokens) are small

`malloc` says how glibc took the tensors' memory: "mmap" sets M_MMAP_THRESHOLD to 256 KiB (what
MALLOC_MMAP_THRESHOLD_=262144 in the environment does), so every freed tensor goes back to the
system; "default" leaves glibc's dynamic threshold, which climbs to 32 MiB as tensors come and go
and keeps the freed ones in its heaps, where the RSS counts them.

Stage 3 releases each gathered weight after use here (stage3_max_live_parameters 0, no reuse
distance, no prefetch): DeepSpeed's defaults keep the whole gathered model on a model this size.

    python bench/bench_zero_init_memory.py          # ~6 min on 2 quiet cores
"""

from __future__ import annotations

import argparse
import torch
import torch.distributed as dist

from megazero.testing import DistributedPool

WORLD = 4
SHAPE = dict(
    vocab_size=16000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=64,
    attention_dropout=0.0,
)
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {
        "stage": 3,
        "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
    },
}


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


def peak_mib() -> float:
    import re

    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def warm_up(tf) -> None:
    """transformers' lazy imports and the kernels' first-call state, before the baseline."""
    tiny = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            **{**SHAPE, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1}
        )
    )
    tokens = torch.randint(0, 64, (1, 64))
    tiny(input_ids=tokens, labels=tokens).loss.backward()


def worker(ctx, under_init: bool, mmap: bool) -> dict:
    import ctypes
    import transformers as tf
    import megazero
    from megazero.parallel.topology import Topology

    torch.set_num_threads(1)
    if mmap:
        ctypes.CDLL("libc.so.6").mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD
    groups = ctx.groups(Topology(world_size=WORLD))
    warm_up(tf)
    baseline = rss_mib()
    open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts
    torch.manual_seed(0)
    if under_init:
        with megazero.zero.Init(config_dict_or_path=CONFIG):
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE))
    built = peak_mib()
    numel = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    engine, *_ = megazero.initialize(model=model, config=CONFIG, process_groups=groups)
    after_engine = peak_mib()
    g = torch.Generator().manual_seed(ctx.rank)
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, SHAPE["vocab_size"], (1, 64), generator=g)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    dist.barrier()
    return {
        "built": built - baseline,
        "engine": after_engine - baseline,
        "trained": peak_mib() - baseline,
        "numel": numel,
        "largest": largest,
        "losses": losses,
    }


def planned_mib(numel: int, largest: int) -> float:
    from megazero.config.memory_estimate import model_state_bytes_per_param

    states = numel * model_state_bytes_per_param(3, WORLD, 4, 4, False)
    return (states + 3 * largest * 4) / 2**20


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    rows = {}
    for name, under_init, mmap in (("zero.Init", True, True), ("eager", False, True), ("zero.Init", True, False)):
        pool = DistributedPool(WORLD)
        try:
            rows[(name, mmap)] = pool.run(worker, under_init, mmap, timeout=3600)
        finally:
            pool.close()
        print(f"  {name}, {'mmap' if mmap else 'default'}: done", flush=True)
    first = rows[("zero.Init", True)][0]
    full = first["numel"] * 4 / 2**20
    print(
        f"LlamaForCausalLM {first['numel'] / 1e6:.1f}M parameters: full fp32 weights {full:.0f} MiB, "
        f"full fp32 model states (weights, grads, Adam) {4 * full:.0f} MiB; {WORLD} ranks, ZeRO-3"
    )
    print("\n| build | malloc | built MiB | engine MiB | trained MiB | planned MiB | trained / planned |")
    print("|---|---|---|---|---|---|---|")
    planned = planned_mib(first["numel"], first["largest"])
    for (name, mmap), ranks in rows.items():
        worst = {k: max(r[k] for r in ranks) for k in ("built", "engine", "trained")}
        print(
            f"| {name} | {'mmap' if mmap else 'default'} | {worst['built']:.0f} | {worst['engine']:.0f} | "
            f"{worst['trained']:.0f} | {planned:.0f} | {worst['trained'] / planned:.2f} |"
        )
    print(
        f"losses equal on both builds: {rows[('zero.Init', True)][0]['losses'] == rows[('eager', True)][0]['losses']}"
    )


if __name__ == "__main__":
    main()
