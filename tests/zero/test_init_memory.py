"""zero.Init's memory (megazero/zero/init.py, with megazero.initialize adopting the slices): a
transformers LlamaForCausalLM of 24.9M parameters built inside `zero.Init()` and trained 2 steps at
ZeRO-3 (fp32, AdamW) on 4 gloo ranks holds, on every rank, a peak resident memory near its shard:

- the build's peak stays within this rank's slice plus two copies of the largest parameter (the
  replay's value and the draw it replays), 71 MiB, where the whole model's fp32 weights are 95 MiB;
- the peak of the whole run (build, initialize, 2 steps) stays within 1.3x the planner's figure:
  the model states' share (16 bytes per parameter / 4 ranks, megazero.config.memory_estimate) plus
  three copies of the largest parameter (its value gathered at adoption, its gathered weight, its
  full gradient before the reduce-scatter), 165 MiB. The whole model's fp32 states (380 MiB) are
  1.8x that bound. Measured: built 50 MiB, adopted 154, run 198-202 (1.20-1.22x the planned figure:
  at the backward's peak the output layer's gathered weight, its gradient and the unit's staging copy
  of it are alive beside the reduction's buffers).

Peak RSS is Linux's high-water mark (VmHWM), reset (/proc/self/clear_refs) after the imports and
the process group, measured above the RSS then. Large tensors are taken from mmap (M_MMAP_THRESHOLD
at 256 KiB): glibc's default raises that threshold to 32 MiB as tensors come and go, and keeps
the freed ones in its heaps, where the RSS counts them long after; measured on this model's bigger
sibling (bench/bench_zero_init_memory.py), that alone adds more than the model's shard. The pool is
this file's own, fresh, so that no earlier test's heap is reused.

Planted to see them fail: zero.Init keeping each parameter's full value beside its slice (the
build's peak reaches the whole model: fails both); adopt_initial_values keeping each gathered value
(the run's peak: 1.8x the planned figure).
"""

import ctypes
import re

import pytest
import torch

from megazero.testing import DistributedPool

WORLD = 4
SHAPE = dict(
    vocab_size=8000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=2,
    num_attention_heads=12,
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
BOUND = 1.3
MiB = 2**20
M_MMAP_THRESHOLD = -3


def rss() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / MiB


def peak() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def build_and_train(ctx) -> dict:
    import transformers as tf
    import megazero
    from megazero.parallel.topology import Topology

    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 256 * 1024)
    groups = ctx.groups(Topology(world_size=WORLD))
    warm_up(tf)
    base = rss()
    open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts here
    torch.manual_seed(0)
    with megazero.zero.Init(config_dict_or_path=CONFIG):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE))
    built = peak() - base
    numel, largest = sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters())
    engine, *_ = megazero.initialize(model=model, config=CONFIG, process_groups=groups)
    adopted = peak() - base
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(2):
        tokens = torch.randint(0, SHAPE["vocab_size"], (1, 64), generator=g)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    import resource

    cpu = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "built": built,
        "adopted": adopted,
        "run": peak() - base,
        "numel": numel,
        "largest": largest,
        "cpu": cpu.ru_utime + cpu.ru_stime,
    }


def warm_up(tf) -> None:
    """transformers' lazy imports and the kernels' first-call state (what any model's first step
    costs once per process), before the baseline: a tiny Llama's forward and backward."""
    tiny = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            **{
                **SHAPE,
                "vocab_size": 64,
                "hidden_size": 24,
                "intermediate_size": 32,
                "num_attention_heads": 6,
                "num_key_value_heads": 2,
            }
        )
    )
    tokens = torch.randint(0, 64, (1, 64))
    tiny(input_ids=tokens, labels=tokens).loss.backward()


def planned_mib(numel: int, largest: int) -> float:
    from megazero.config.memory_estimate import model_state_bytes_per_param

    return (numel * model_state_bytes_per_param(3, WORLD, 4, 4, False) + 3 * largest * 4) / MiB


def can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        ctypes.CDLL("libc.so.6").mallopt
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not can_reset_peak(),
    reason="needs Linux with glibc and a writable /proc/self/clear_refs (the peak RSS is reset there)",
)


@pytest.fixture(scope="module")
def pool():
    pool = DistributedPool(WORLD)
    yield pool
    pool.close(force=True)


def test_each_rank_peaks_near_its_shard(pool):
    ranks = pool.run(build_and_train)
    numel, largest = ranks[0]["numel"], ranks[0]["largest"]
    full, planned = numel * 4 / MiB, planned_mib(numel, largest)
    report = ", ".join(
        f"rank {r}: built {m['built']:.0f}, adopted {m['adopted']:.0f}, run {m['run']:.0f}, cpu {m['cpu']:.1f}s"
        for r, m in enumerate(ranks)
    )
    what = f"MiB of peak RSS; full fp32 weights {full:.0f}, planned {planned:.0f}: {report}"
    slice_and_replay = full / WORLD + 2 * largest * 4 / MiB
    assert all(m["built"] <= slice_and_replay for m in ranks), what
    assert all(m["run"] <= BOUND * planned for m in ranks), what
