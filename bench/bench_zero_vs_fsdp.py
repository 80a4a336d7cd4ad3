"""ZeRO stages 0-3 against torch's own data parallelism and DeepSpeed, on 2 gloo ranks on CPU, in one run.

    ours ZeRO-3        vs  torch.distributed.fsdp.fully_shard (FSDP2), per transformer layer + root
    ours ZeRO-0/1/2    vs  torch.nn.parallel.DistributedDataParallel
    ours ZeRO-1/2/3    vs  DeepSpeed's ZeRO 1/2/3 (`deepspeed.initialize`, its CPU accelerator, the
                           same process group; DeepSpeed's default zero_optimization otherwise), when
                           deepspeed is installed (the ds rows are left out, with a note, when not)

Each side trains its own model: ours the pure `megazero.models.GPT` (fused output layer and loss),
the peers what their users train, transformers' GPT2LMHeadModel (SDPA) with transformers' own loss,
holding megazero's initial weights (bench/peer_models.py, through megazero's Hugging Face export:
the same function, so the printed losses agree). Both: dropout off, tied embeddings, the same
`SyntheticTokens` samples (Megatron sampler order through `MicrobatchSource`), fp32, AdamW with the
same hyperparameters (weight decay on >= 2-D weights only, as ours), global-norm gradient clipping,
a constant learning rate. The loss is the summed token loss over the global batch's tokens on both
sides (the peers average gradients over ranks, so their backward loss is multiplied by the world
size to match ours, which sums). The ratios therefore include the model's code as well as the
engine's.

The peers use torch.optim.AdamW(fused=True) (ours: the fused C++ Adam kernel when it is built;
DeepSpeed's own CPU Adam is a JIT-built extension, so DeepSpeed gets the same torch AdamW as a client
optimizer, `zero_allow_untested_optimizer`); DDP keeps gradients as views of its buckets, as our
stage 0 keeps them in its flat buffer. DeepSpeed clips with its `gradient_clipping` and accumulates
over its `gradient_accumulation_steps` (its backward loss is scaled to the same summed loss).

Each configuration runs in a fresh pair of processes (`DistributedPool`), so each rank's
`ru_maxrss` is that configuration's own peak. Reported per configuration, worst rank:
  ms/step  median wall time of the timed steps (after warm-up; each step ends with a loss
           all-reduce on both sides, so ranks leave the step together)
  cpu ms   median process CPU time per step, all threads (gloo's included): unlike wall time it
           barely moves when other jobs share the machine
  peak     peak RSS of the process
  +model   peak RSS minus the RSS measured after imports and communicator creation, before the model
           is built: what the model, optimizer, activations and temporaries added at their peak
The configurations run in rounds (ddp, zero0, ds1, zero1, ds2, zero2, fsdp2, ds3, zero3, then
again); each keeps its fastest round, since other load only ever adds time. Ratios are ours / peer (below 1: ours is
faster or smaller). The first steps' global losses of every side are printed too: same init, data
and optimizer, so they agree to float reduction-order noise (~1e-7 relative).

    python bench/bench_zero_vs_fsdp.py                      # defaults: ~2.5 min on 2 cores
    python bench/bench_zero_vs_fsdp.py --rounds 1 --configs fsdp2,zero3
    python bench/bench_zero_vs_fsdp.py --configs zero3 --profile zero3    # torch.profiler, rank 0
    python bench/bench_zero_vs_fsdp.py --configs zero3 --zero-extra overlap_comm=0,max_reuse_distance=0
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import resource
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from megazero.config.train_config import OptimizerConfig, TrainConfig
from megazero.data.synthetic import SyntheticTokens
from megazero.models.config import GPTConfig
from megazero.parallel.topology import Topology
from megazero.testing import DistributedPool
from megazero.data.sampler import MicrobatchSource
from megazero.training import setup, train_step
from megazero.ops.adam_config import AdamConfig
from megazero.zero.config import ZeroConfig
from megazero.zero.precision import uses_weight_decay

from peer_models import hf_loss, hf_model, layers_of

WORLD = 2
# (name, side, ZeRO stage or None, names of the peers it is compared with)
CONFIGS = [
    ("ddp", "ddp", None, ()),
    ("zero0", "ours", 0, ("ddp",)),
    ("ds1", "deepspeed", 1, ()),
    ("zero1", "ours", 1, ("ddp", "ds1")),
    ("ds2", "deepspeed", 2, ()),
    ("zero2", "ours", 2, ("ddp", "ds2")),
    ("fsdp2", "fsdp2", None, ()),
    ("ds3", "deepspeed", 3, ()),
    ("zero3", "ours", 3, ("fsdp2", "ds3")),
]


def deepspeed_available() -> bool:
    """Whether deepspeed is installed (not imported here: its accelerator is chosen at import,
    which the workers do with DS_ACCELERATOR=cpu)."""
    return importlib.util.find_spec("deepspeed") is not None


@dataclasses.dataclass
class Bench:
    """What every configuration shares (pickled to the workers)."""

    model: GPTConfig
    micro_batch: int
    global_batch: int
    steps: int
    warmup: int
    lr: float
    adam: AdamConfig
    clip: float
    seed: int
    zero_extra: dict
    profile: str | None
    threads: int = 1
    peer_adam: str = "fused"


def rss_mib() -> float:
    """Peak resident set of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def batches(bench: Bench, rank: int) -> list[list[torch.Tensor]]:
    """Every step's microbatches for this rank, built before timing starts."""
    data = SyntheticTokens(bench.model.vocab_size, bench.model.seq_length, seed=bench.seed)
    source = MicrobatchSource(data, bench.global_batch, bench.micro_batch, rank, WORLD)
    return [source.batch(i) for i in range(bench.warmup + bench.steps)]


def timed_steps(bench: Bench, step_fn, rank: int, name: str) -> dict:
    """Runs warm-up then timed steps; returns the losses of every step and the wall and process CPU
    milliseconds (all threads, gloo's included) of each timed step."""
    losses, times, cpu = [], [], []
    profiler = None
    for i in range(bench.warmup + bench.steps):
        if i == bench.warmup and bench.profile == name and rank == 0:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        started, cpu_started = time.perf_counter(), time.process_time()
        losses.append(step_fn(i))
        if i >= bench.warmup:
            times.append(1000 * (time.perf_counter() - started))
            cpu.append(1000 * (time.process_time() - cpu_started))
    if profiler is not None:
        profiler.__exit__(None, None, None)
        print(f"\n--- torch.profiler, rank 0, {name}, {bench.steps} steps ---", flush=True)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    return {"losses": losses, "ms": times, "cpu_ms": cpu}


def run_ours(ctx, bench: Bench, stage: int, name: str) -> dict:
    groups = ctx.groups(Topology(world_size=WORLD))  # communicators: before the baseline, as the peers'
    baseline = rss_mib()
    zero = ZeroConfig(stage=stage, **bench.zero_extra)
    optimizer = OptimizerConfig(lr=bench.lr, adam=bench.adam, clip_grad=bench.clip)
    cfg = TrainConfig(
        model=bench.model,
        zero=zero,
        optimizer=optimizer,
        seed=bench.seed,
        micro_batch_size=bench.micro_batch,
        global_batch_size=bench.global_batch,
    )
    state = setup(cfg, groups)
    data = batches(bench, ctx.rank)
    comm_bytes = []

    def step(i: int) -> float:
        loss = train_step(state, data[i], bench.lr).loss
        comm_bytes.append(sum(groups.log.last_step.values()))
        return loss

    result = timed_steps(bench, step, ctx.rank, name)
    return {
        **result,
        "peak": rss_mib(),
        "baseline": baseline,
        "model_states": state.engine.memory.report()["model_states"],
        "comm": comm_bytes[-1],
    }


def peer_model(bench: Bench):
    """transformers' GPT-2 with our initial weights (init depends only on seed and parameter name)."""
    return hf_model(bench.model, bench.seed)


def peer_optimizer(model: nn.Module, bench: Bench) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if uses_weight_decay(p.shape)]
    no_decay = [p for p in model.parameters() if not uses_weight_decay(p.shape)]
    a = bench.adam
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=bench.lr,
        betas=(a.beta1, a.beta2),
        eps=a.eps,
        **kind[bench.peer_adam],
    )


def wrap_fsdp2(model):
    """FSDP2 the way its docs apply it to a transformer: each layer, then the root (embedding, final
    norm and the tied head share the root's group). Returns (model, sync(last) -> context)."""
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in layers_of(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    @contextlib.contextmanager
    def sync(last: bool):
        model.set_requires_gradient_sync(last)  # reduce-scatter on the last microbatch only
        yield

    return model, sync


def wrap_ddp(model):
    """DDP with gradients as views of its buckets (no second gradient copy, as our flat buffer)."""
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    return ddp, lambda last: contextlib.nullcontext() if last else ddp.no_sync()


def wrap_deepspeed(model, bench: Bench, stage: int, rank: int):
    """DeepSpeed's ZeRO `stage` around the model on its CPU accelerator, in this process group,
    with the peers' AdamW as a client optimizer. Returns (engine, backward(loss))."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(rank)  # one machine: the launcher would set it
    import deepspeed

    accumulation = bench.global_batch // (bench.micro_batch * WORLD)
    config = {
        "train_micro_batch_size_per_gpu": bench.micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": bench.clip,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=peer_optimizer(model, bench), config=config, dist_init_required=False
    )
    # DeepSpeed averages gradients over ranks and (scale_wrt_gas) divides by the accumulation steps
    return engine, lambda loss: engine.backward(loss * WORLD * accumulation)


def run_deepspeed(ctx, bench: Bench, stage: int, name: str) -> dict:
    baseline = rss_mib()
    engine, backward = wrap_deepspeed(peer_model(bench), bench, stage, ctx.rank)
    data = batches(bench, ctx.rank)
    normalizer = bench.global_batch * bench.model.seq_length

    def step(i: int) -> float:
        total = torch.zeros(1, dtype=torch.float64)
        for tokens in data[i]:
            loss = hf_loss(engine, tokens, normalizer)
            backward(loss)
            engine.step()  # the optimizer steps at the accumulation boundary
            total += loss.item()
        dist.all_reduce(total)
        return total.item()

    return {**timed_steps(bench, step, ctx.rank, name), "peak": rss_mib(), "baseline": baseline}


def run_peer(ctx, bench: Bench, side: str, name: str) -> dict:
    baseline = rss_mib()
    model, sync = (wrap_fsdp2 if side == "fsdp2" else wrap_ddp)(peer_model(bench))
    optimizer = peer_optimizer(model, bench)
    data = batches(bench, ctx.rank)
    normalizer = bench.global_batch * bench.model.seq_length

    def step(i: int) -> float:
        total = torch.zeros(1, dtype=torch.float64)
        for j, tokens in enumerate(data[i]):
            with sync(j == len(data[i]) - 1):
                loss = hf_loss(model, tokens, normalizer)
                (loss * WORLD).backward()  # the peers average gradients over ranks
            total += loss.item()
        nn.utils.clip_grad_norm_(model.parameters(), bench.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        return total.item()

    return {**timed_steps(bench, step, ctx.rank, name), "peak": rss_mib(), "baseline": baseline}


def worker(ctx, bench: Bench, name: str, side: str, stage: int | None) -> dict:
    torch.set_num_threads(bench.threads)
    # FSDP2 warns when a wrapped module returns a view (in-place ops on it would be unsafe; none here).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    if side == "ours":
        return run_ours(ctx, bench, stage, name)
    if side == "deepspeed":
        warnings.filterwarnings("ignore", module="deepspeed")
        return run_deepspeed(ctx, bench, stage, name)
    return run_peer(ctx, bench, side, name)


# --- driver -------------------------------------------------------------------------------------


def summarize(rounds: list[list[dict]]) -> dict:
    """Worst rank of each measure; over rounds, the fastest (other load on the machine only ever adds
    time) and the largest memory."""
    out = {
        "ms": min(max(statistics.median(r["ms"]) for r in ranks) for ranks in rounds),
        "cpu_ms": min(max(statistics.median(r["cpu_ms"]) for r in ranks) for ranks in rounds),
        "peak": max(r["peak"] for ranks in rounds for r in ranks),
        "added": max(r["peak"] - r["baseline"] for ranks in rounds for r in ranks),
        "losses": rounds[0][0]["losses"],
    }
    ranks = rounds[0]
    if "model_states" in ranks[0]:
        out["model_states"] = max(r["model_states"] for r in ranks) / 2**20
        out["comm"] = max(r["comm"] for r in ranks) / 2**20
    return out


def print_results(results: dict[str, dict], show_losses: int) -> None:
    print("\nstep time and memory, worst of 2 ranks (ratios: ours / peer; < 1 is better for ours)")
    head = (
        f"{'config':<7} {'peer':<6} {'ms/step':>8} {'cpu ms':>7} {'peak MiB':>9} {'+model MiB':>11} "
        f"{'states MiB':>11} {'comm MiB':>9} {'time x':>7} {'cpu x':>6} {'peak x':>7} {'+model x':>9}"
    )
    print(head)
    print("-" * len(head))
    for name, _, _, peers in CONFIGS:
        if name not in results:
            continue
        r = results[name]
        for peer in [p for p in peers if p in results] or [None]:
            line = (
                f"{name:<7} {peer or '':<6} {r['ms']:>8.1f} {r['cpu_ms']:>7.1f} {r['peak']:>9.1f} "
                f"{r['added']:>11.1f} {_fmt(r.get('model_states')):>11} {_fmt(r.get('comm')):>9}"
            )
            if peer is not None:
                p = results[peer]
                line += (
                    f" {r['ms'] / p['ms']:>7.3f} {r['cpu_ms'] / p['cpu_ms']:>6.3f} "
                    f"{r['peak'] / p['peak']:>7.3f} {r['added'] / p['added']:>9.3f}"
                )
            print(line)
    print(
        "ms/step: median wall time; cpu ms: median process CPU time per step (all threads; "
        "insensitive to other load on the machine)\nstates: our engine's model-state bytes per rank "
        "(engine.memory.report()); comm: bytes per rank per step by the comm layer's ring convention"
    )
    _print_losses(results, show_losses)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _print_losses(results: dict[str, dict], show: int) -> None:
    names = [n for n, *_ in CONFIGS if n in results]
    print(f"\nglobal loss of the first {show} steps (same init, data and optimizer on every side)")
    print(f"{'step':>4} " + " ".join(f"{n:>12}" for n in names))
    for i in range(min(show, len(results[names[0]]["losses"]))):
        print(f"{i + 1:>4} " + " ".join(f"{results[n]['losses'][i]:>12.7f}" for n in names))
    for name, _, _, peers in CONFIGS:
        for peer in peers:
            if name in results and peer in results:
                ours, theirs = results[name]["losses"], results[peer]["losses"]
                gap = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
                print(f"{name} vs {peer}: max relative loss gap over {len(ours)} steps = {gap:.2e}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=6)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=8, help="micro x 2 ranks x accumulation steps")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (stage 3 records its trace)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (2 ranks share the cores)")
    p.add_argument(
        "--peer-adam",
        choices=["fused", "foreach", "for-loop"],
        default="fused",
        help="torch.optim.AdamW implementation of the peers (ours: the fused C++ kernel if built)",
    )
    p.add_argument(
        "--configs",
        default=",".join(n for n, *_ in CONFIGS),
        help="comma-separated subset of " + ",".join(n for n, *_ in CONFIGS),
    )
    p.add_argument(
        "--zero-extra",
        default="",
        help="extra ZeroConfig keys for ours, e.g. max_reuse_distance=0,prefetch_bucket_size=0",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="run every configuration this many times (alternating) and keep its fastest "
        "round: use 2-3 on a machine others are using",
    )
    p.add_argument("--profile", default=None, help="a config name: print torch.profiler's top ops of rank 0")
    p.add_argument("--show-losses", type=int, default=5)
    return p.parse_args(argv)


def make_bench(args) -> Bench:
    model = GPTConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_embeddings=True,
    )
    extra = dict(kv.split("=") for kv in args.zero_extra.split(",") if kv)
    adam = AdamConfig(lr=args.lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=args.weight_decay)
    return Bench(
        model=model,
        micro_batch=args.micro_batch_size,
        global_batch=args.global_batch_size,
        steps=args.steps,
        warmup=args.warmup,
        lr=args.lr,
        adam=adam,
        clip=args.clip_grad,
        seed=1234,
        zero_extra={k: int(float(v)) for k, v in extra.items()},
        profile=args.profile,
        threads=args.threads,
        peer_adam=args.peer_adam,
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    bench = make_bench(args)
    wanted = set(args.configs.split(","))
    if not deepspeed_available() and wanted & {"ds1", "ds2", "ds3"}:
        print("deepspeed is not installed: its rows are left out (pip install deepspeed)")
        wanted -= {"ds1", "ds2", "ds3"}
    m = bench.model
    print(
        f"GPT h={m.hidden_size} layers={m.num_layers} heads={m.num_attention_heads} seq={m.seq_length} "
        f"vocab={m.vocab_size}; micro {bench.micro_batch} x {WORLD} ranks, global {bench.global_batch}; "
        f"fp32 AdamW; {bench.warmup} warm-up + {bench.steps} timed steps; "
        f"{bench.threads} thread(s)/rank; gloo on CPU; torch {torch.__version__}"
    )
    runs: dict[str, list] = {}
    for round_index in range(args.rounds):
        for name, side, stage, _ in CONFIGS:
            if name not in wanted:
                continue
            started = time.perf_counter()
            pool = DistributedPool(WORLD)  # fresh processes: ru_maxrss is this config's own peak
            try:
                ranks = pool.run(worker, bench, name, side, stage)
            finally:
                pool.close()
            runs.setdefault(name, []).append(ranks)
            ms = max(statistics.median(r["ms"]) for r in ranks)
            print(
                f"  round {round_index + 1} {name:<6} {ms:8.1f} ms/step  ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    print_results({name: summarize(rounds) for name, rounds in runs.items()}, args.show_losses)


if __name__ == "__main__":
    main()
