"""The training step on CPU: megazero against plain torch on the same model, in the same run.

    ours  megazero.training.setup / train_step, one process (tp = pp = dp = 1, ZeRO stage 0 by
          default), fp32: the engine's flat buffers, its Adam (the fused C++ kernel when built), its
          global-norm clipping; the pure `megazero.models.GPT` underneath, with the variant's options
    peer  the same `megazero.models.GPT` and options with no megazero engine: plain autograd,
          `torch.optim.AdamW(fused=True)` (decay on >= 2-D weights, as ours), `clip_grad_norm_`

Both sides start from the same weights (`make_init_fn`: by seed and parameter name), train on the same
`SyntheticTokens` microbatches with the same hyperparameters and the same summed token loss over the
global batch, and take one `.item()` per step; their first losses are printed side by side (they agree
to ~1e-7: the same work). The model options (recomputation, --compile) are the model's, so they run on
both sides: the ratio is what megazero's step adds around the model, for each variant.

Variants (all fp32, dropout off): gpt2 (learned positions, GELU, LayerNorm, tied); llama (RoPE,
SwiGLU, RMSNorm, grouped-query attention, untied); llama + selective / full recomputation; with
--compile also llama with each layer torch.compile'd (inductor: its first step compiles, in warm-up).
They run in rounds, alternating, and keep their fastest round (other load only adds time). Reported:
median wall ms per step, median process CPU ms per step (all threads), ratio ours / peer.

    python bench/bench_step_vs_torch.py                  # ~2 min on 2 cores
    python bench/bench_step_vs_torch.py --compile --variants llama,llama-compiled
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megazero.config.train_config import OptimizerConfig, TrainConfig
from megazero.data.synthetic import SyntheticTokens
from megazero.model_builder import compile_layers, make_init_fn
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT
from megazero.ops.adam_config import AdamConfig
from megazero.parallel.process_groups import ProcessGroups
from megazero.data.sampler import MicrobatchSource
from megazero.training import setup, train_step
from megazero.zero.config import ZeroConfig
from megazero.zero.precision import uses_weight_decay

LR, SEED = 1e-3, 1234
ADAM = AdamConfig(lr=LR, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LLAMA = dict(position_embedding="rope", activation="swiglu", normalization="rmsnorm", tie_embeddings=False,
             heads_per_group=2)
VARIANTS = {
    "gpt2": ({}, None),
    "llama": (LLAMA, None),
    "llama-selective": ({**LLAMA, "recompute_granularity": "selective"}, None),
    "llama-full": ({**LLAMA, "recompute_granularity": "full", "recompute_method": "uniform",
                    "recompute_num_layers": 1}, None),
    "llama-compiled": (LLAMA, "inductor"),
}


def model_config(args, options: dict) -> GPTConfig:
    options = dict(options)
    groups = args.heads // options.pop("heads_per_group", 1)
    return GPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                     num_attention_heads=args.heads, num_query_groups=groups, seq_length=args.seq,
                     hidden_dropout=0.0, attention_dropout=0.0, **options)


def step_batches(args, cfg: GPTConfig) -> list[list[torch.Tensor]]:
    source = MicrobatchSource(SyntheticTokens(cfg.vocab_size, cfg.seq_length, seed=1),
                              args.micro_batch * args.microbatches, args.micro_batch, 0, 1)
    return [source.batch(i) for i in range(args.warmup + args.steps)]


def timed(args, step) -> dict:
    losses, ms, cpu = [], [], []
    for i in range(args.warmup + args.steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        losses.append(step(i))
        if i >= args.warmup:
            ms.append(1000 * (time.perf_counter() - started))
            cpu.append(1000 * (time.process_time() - cpu_started))
    return {"losses": losses, "ms": statistics.median(ms), "cpu_ms": statistics.median(cpu)}


def run_ours(args, cfg: GPTConfig, compile_backend) -> dict:
    train = TrainConfig(model=cfg, zero=ZeroConfig(stage=args.zero_stage),
                        optimizer=OptimizerConfig(lr=LR, adam=ADAM, clip_grad=1.0), seed=SEED,
                        micro_batch_size=args.micro_batch, global_batch_size=args.micro_batch * args.microbatches,
                        compile_backend=compile_backend)
    state = setup(train, ProcessGroups.single())
    batches = step_batches(args, cfg)
    return timed(args, lambda i: train_step(state, batches[i], LR).loss)


def run_peer(args, cfg: GPTConfig, compile_backend) -> dict:
    model = GPT(cfg)
    init = make_init_fn(cfg, SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init(name, p))
    if compile_backend is not None:
        compile_layers(model, compile_backend)
    params = list(model.train().parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if uses_weight_decay(p.shape)]},
                                   {"params": [p for p in params if not uses_weight_decay(p.shape)],
                                    "weight_decay": 0.0}],
                                  lr=LR, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                                  weight_decay=ADAM.weight_decay, fused=True)
    batches = step_batches(args, cfg)
    normalizer = args.micro_batch * args.microbatches * cfg.seq_length

    def step(i: int) -> float:
        total = 0.0
        for tokens in batches[i]:
            loss = model(tokens[:, :-1], tokens[:, 1:]).sum() / normalizer
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return timed(args, step)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    p.add_argument("--compile", action="store_true", help="also the llama-compiled variant (inductor)")
    p.add_argument("--variants", default=None, help="comma-separated subset of " + ",".join(VARIANTS))
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = args.variants.split(",") if args.variants else [v for v in VARIANTS
                                                            if args.compile or not v.endswith("compiled")]
    print(f"GPT layers={args.layers} hidden={args.hidden} heads={args.heads} seq={args.seq} vocab={args.vocab}; "
          f"micro {args.micro_batch} x {args.microbatches}; fp32; ours ZeRO stage {args.zero_stage}; "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds; "
          f"{torch.get_num_threads()} thread(s); torch {torch.__version__}", flush=True)
    best: dict = {}
    for _ in range(args.rounds):
        for name in wanted:
            options, backend = VARIANTS[name]
            for side, run in (("ours", run_ours), ("peer", run_peer)):
                result = run(args, model_config(args, options), backend)
                kept = best.get((name, side))
                if kept is None or result["ms"] < kept["ms"]:
                    best[(name, side)] = result
            print(f"  {name:<16} ours {best[(name, 'ours')]['ms']:8.1f} ms  peer {best[(name, 'peer')]['ms']:8.1f} ms",
                  flush=True)
    print("\n| variant | ours ms/step | peer ms/step | ours cpu ms | peer cpu ms | time x | cpu x | loss gap |")
    print("|---|---|---|---|---|---|---|---|")
    for name in wanted:
        ours, peer = best[(name, "ours")], best[(name, "peer")]
        gap = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], peer["losses"]))
        print(f"| {name} | {ours['ms']:.1f} | {peer['ms']:.1f} | {ours['cpu_ms']:.1f} | {peer['cpu_ms']:.1f} | "
              f"{ours['ms'] / peer['ms']:.3f} | {ours['cpu_ms'] / peer['cpu_ms']:.3f} | {gap:.1e} |")
    print("time x, cpu x: ours / peer (< 1: ours faster); loss gap: largest relative difference of the "
          "step losses (same work on both sides)")


if __name__ == "__main__":
    main()
