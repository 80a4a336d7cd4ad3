"""megazero's model and training step on CPU against transformers' model trained in plain torch, in
the same run.

Two tables, each variant's sides alternating over rounds (each keeps its fastest round: other load
only adds time):

  model  forward + backward of one microbatch, no optimizer:
           ours  the pure `megazero.models.GPT` (fused output layer and loss, models/loss.py)
           peer  transformers' GPT2LMHeadModel / LlamaForCausalLM (SDPA attention) holding the same
                 initial weights (bench/peer_models.py: megazero's Hugging Face export), with
                 transformers' own loss
  step   the whole training step (microbatches, clipping, AdamW):
           ours  megazero.training.setup / train_step, one process, ZeRO stage 0 by default, fp32: the
                 engine's flat buffers, its Adam (the fused C++ kernel when built), its clipping
           peer  the same transformers model in plain torch: `torch.optim.AdamW(fused=True)` (decay on
                 >= 2-D weights, as ours), `clip_grad_norm_`, the summed token loss over the batch

Both sides train on the same `SyntheticTokens` microbatches with the same hyperparameters and take
one `.item()` per step; their losses are printed side by side (the same function: they agree to
~1e-6). Variants (fp32, dropout off): gpt2 (learned positions, GELU, LayerNorm, tied, biases);
llama (RoPE, SwiGLU, RMSNorm, grouped-query attention, untied, no biases); llama-full (ours:
Megatron's full recomputation, one layer a group; peer: transformers' gradient checkpointing, the
same thing); llama-selective (ours recomputes the core attention; transformers has no such option,
so its peer runs without recomputation); with --compile, llama-compiled (each layer
torch.compile'd on both sides; the first step compiles, in warm-up). Reported: median wall ms per
step, median process CPU ms (all threads), ratio ours / peer (< 1: ours faster).

    python bench/bench_step_vs_torch.py                  # ~4 min on 2 cores
    python bench/bench_step_vs_torch.py --tables model --variants gpt2,llama --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megazero.config.train_config import OptimizerConfig, TrainConfig
from megazero.data.synthetic import SyntheticTokens
from megazero.training.model_builder import compile_layers
from megazero.models.config import GPTConfig
from megazero.ops.adam_config import AdamConfig
from megazero.parallel.process_groups import ProcessGroups
from megazero.data.sampler import MicrobatchSource
from megazero.training import setup, train_step
from megazero.zero.config import ZeroConfig
from megazero.zero.precision import uses_weight_decay

from peer_models import hf_loss, hf_model, initialised_gpt, layers_of

LR, SEED = 1e-3, 1234
ADAM = AdamConfig(lr=LR, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LLAMA = dict(
    position_embedding="rope",
    activation="swiglu",
    normalization="rmsnorm",
    tie_embeddings=False,
    add_bias_linear=False,
    heads_per_group=2,
)
# name -> (megazero options, compile backend, peer's recomputation)
VARIANTS = {
    "gpt2": ({}, None, False),
    "llama": (LLAMA, None, False),
    "llama-selective": ({**LLAMA, "recompute_granularity": "selective"}, None, False),
    "llama-full": (
        {**LLAMA, "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        None,
        True,
    ),
    "llama-compiled": (LLAMA, "inductor", False),
}


def model_config(args, options: dict) -> GPTConfig:
    options = dict(options)
    groups = args.heads // options.pop("heads_per_group", 1)
    return GPTConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_query_groups=groups,
        seq_length=args.seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **options,
    )


def step_batches(args, cfg: GPTConfig, microbatches: int) -> list[list[torch.Tensor]]:
    source = MicrobatchSource(
        SyntheticTokens(cfg.vocab_size, cfg.seq_length, seed=1), args.micro_batch * microbatches, args.micro_batch, 0, 1
    )
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


def peer(cfg: GPTConfig, backend, recompute: bool):
    """transformers' model of `cfg` with our initial weights, recomputing / compiled as asked."""
    model = hf_model(cfg, SEED)
    if recompute:  # transformers 5's name; 4.x calls it gradient checkpointing
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if backend is not None:
        for layer in layers_of(model):
            layer.compile(backend=backend)
    return model


def ours_model(cfg: GPTConfig, backend):
    model = initialised_gpt(cfg, SEED).train()
    return compile_layers(model, backend) if backend is not None else model


def run_model(args, side: str, cfg: GPTConfig, backend, recompute: bool) -> dict:
    """Forward + backward of one microbatch a step, gradients dropped after each."""
    model = ours_model(cfg, backend) if side == "ours" else peer(cfg, backend, recompute)
    batches = step_batches(args, cfg, 1)
    normalizer = args.micro_batch * cfg.seq_length

    def step(i: int) -> float:
        tokens = batches[i][0]
        if side == "ours":
            loss = model(tokens[:, :-1], tokens[:, 1:]).sum() / normalizer
        else:
            loss = hf_loss(model, tokens, normalizer)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    return timed(args, step)


def run_step(args, side: str, cfg: GPTConfig, backend, recompute: bool) -> dict:
    if side == "ours":
        train = TrainConfig(
            model=cfg,
            zero=ZeroConfig(stage=args.zero_stage),
            optimizer=OptimizerConfig(lr=LR, adam=ADAM, clip_grad=1.0),
            seed=SEED,
            micro_batch_size=args.micro_batch,
            global_batch_size=args.micro_batch * args.microbatches,
            compile_backend=backend,
        )
        state = setup(train, ProcessGroups.single())
        batches = step_batches(args, cfg, args.microbatches)
        return timed(args, lambda i: train_step(state, batches[i], LR).loss)
    model = peer(cfg, backend, recompute)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if uses_weight_decay(p.shape)]},
            {"params": [p for p in params if not uses_weight_decay(p.shape)], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(ADAM.beta1, ADAM.beta2),
        eps=ADAM.eps,
        weight_decay=ADAM.weight_decay,
        fused=True,
    )
    batches = step_batches(args, cfg, args.microbatches)
    normalizer = args.micro_batch * args.microbatches * cfg.seq_length

    def step(i: int) -> float:
        total = 0.0
        for tokens in batches[i]:
            loss = hf_loss(model, tokens, normalizer)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return timed(args, step)


TABLES = {"model": run_model, "step": run_step}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2, help="gradient accumulation steps (step table)")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads; 0: torch's default")
    p.add_argument("--compile", action="store_true", help="also the llama-compiled variant (inductor)")
    p.add_argument("--variants", default=None, help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--tables", default="model,step", help="comma-separated subset of " + ",".join(TABLES))
    return p.parse_args(argv)


def print_table(table: str, wanted: list[str], best: dict) -> None:
    print(f"\n{table}: | variant | ours ms | peer ms | ours cpu ms | peer cpu ms | time x | cpu x | loss gap |")
    print("|---|---|---|---|---|---|---|---|")
    for name in wanted:
        ours, theirs = best[(table, name, "ours")], best[(table, name, "peer")]
        gap = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"]))
        print(
            f"| {name} | {ours['ms']:.1f} | {theirs['ms']:.1f} | {ours['cpu_ms']:.1f} | {theirs['cpu_ms']:.1f} | "
            f"{ours['ms'] / theirs['ms']:.3f} | {ours['cpu_ms'] / theirs['cpu_ms']:.3f} | {gap:.1e} |"
        )
    name = wanted[0]
    print(
        f"first losses, {name}: ours "
        + " ".join(f"{x:.6f}" for x in best[(table, name, "ours")]["losses"][:3])
        + " | peer "
        + " ".join(f"{x:.6f}" for x in best[(table, name, "peer")]["losses"][:3])
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = (
        args.variants.split(",")
        if args.variants
        else [v for v in VARIANTS if args.compile or not v.endswith("compiled")]
    )
    tables = args.tables.split(",")
    print(
        f"GPT layers={args.layers} hidden={args.hidden} heads={args.heads} seq={args.seq} vocab={args.vocab}; "
        f"micro {args.micro_batch} (step: x {args.microbatches}); fp32; ours ZeRO stage {args.zero_stage}; "
        f"peer transformers; {args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds; "
        f"{torch.get_num_threads()} thread(s); torch {torch.__version__}",
        flush=True,
    )
    best: dict = {}
    for _ in range(args.rounds):
        for table in tables:
            for name in wanted:
                options, backend, recompute = VARIANTS[name]
                for side in ("ours", "peer"):
                    result = TABLES[table](args, side, model_config(args, options), backend, recompute)
                    kept = best.get((table, name, side))
                    if kept is None or result["ms"] < kept["ms"]:
                        best[(table, name, side)] = result
                print(
                    f"  {table:<5} {name:<16} ours {best[(table, name, 'ours')]['ms']:8.1f} ms  "
                    f"peer {best[(table, name, 'peer')]['ms']:8.1f} ms",
                    flush=True,
                )
    for table in tables:
        print_table(table, wanted, best)
    print(
        "time x, cpu x: ours / peer (< 1: ours faster); loss gap: largest relative difference of the "
        "step losses (the same function on both sides)"
    )


if __name__ == "__main__":
    main()
