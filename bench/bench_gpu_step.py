"""Training-step time and MFU of a ~1.3B-parameter GPT on one GPU in bf16: megazero against plain
torch, measured in the same run.

    ours  megazero.training.setup / train_step (ZeRO stage 1 by default, one process, tp = pp = dp = 1):
          bf16 parameters and activations, fp32 master weights and Adam states, fp32 gradient norm
          clipping; the pure `megazero.models.GPT` underneath
    peer  the same `megazero.models.GPT` moved to the GPU with no megazero engine: fp32 parameters
          under `torch.autocast(bfloat16)` (the standard torch mixed-precision recipe, fp32 master
          weights as ours), `torch.optim.AdamW(fused=True)`, `clip_grad_norm_(1.0)`

Both sides start from the same weights (`make_init_fn`: by seed and parameter name), train on the
same `SyntheticTokens` microbatches with the same optimizer hyperparameters and the same summed
token loss over the global batch, and take one `loss.item()` per step. Their losses are printed
side by side: they agree to bf16 noise, so both sides do the same work. Dropout is off on both.

Default shape: 24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304 (tied), micro batch 8, one
microbatch per step. FLOPs per step (PaLM, Chowdhery et al. 2022, appendix B):
    6 N T  +  12 L h s T      (T tokens per step, N all parameters, the tied head counted once:
                               its matmul is the 6 V h of the embedding's share of N; attention
                               scores and weighted sum counted in full, not halved for causality)
TFLOP/s = FLOPs per step / step time; MFU = TFLOP/s / --peak-tflops (H100/H200 SXM dense bf16: 989).
Step time is the median over the timed steps (CUDA events between steps, after warm-up); peak
memory is torch.cuda.max_memory_allocated of each side, measured one after the other.

    python bench/bench_gpu_step.py                         # on a GPU: ~1.3B, both sides, ~2 min
    python bench/bench_gpu_step.py --tiny --device cpu     # the same code path on CPU, seconds
"""
from __future__ import annotations

import argparse
import gc
import statistics
import traceback

import torch

from megazero.config import OptimizerConfig, PrecisionConfig, TrainConfig
from megazero.data.synthetic import SyntheticTokens
from megazero.model_builder import make_init_fn
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT
from megazero.parallel.groups import ProcessGroups
from megazero.streams import Event, copy_to_device
from megazero.training import MicrobatchSource, setup, train_step
from megazero.zero.adam import AdamConfig
from megazero.zero.config import ZeroConfig


def adam_config(lr: float) -> AdamConfig:
    """Both sides' optimizer hyperparameters (constant lr)."""
    return AdamConfig(lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sides", default="ours,peer")
    p.add_argument("--lr", type=float, default=None, help="constant learning rate (default 1e-4; --tiny 1e-2)")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, seq 64, vocab 512: a path check")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.heads, args.seq, args.vocab, args.micro_batch = 2, 64, 4, 64, 512, 2
        args.warmup, args.steps = 1, 2
    if args.lr is None:
        # The tiny run's steps must move the loss far more than bf16 noise moves the two sides apart.
        args.lr = 1e-2 if args.tiny else 1e-4
    return args


def model_config(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                     num_attention_heads=args.heads, seq_length=args.seq, hidden_dropout=0.0,
                     attention_dropout=0.0)


def flops_per_token(cfg: GPTConfig, params: int) -> float:
    return 6.0 * params + 12.0 * cfg.num_layers * cfg.hidden_size * cfg.seq_length


def step_batches(args, cfg: GPTConfig) -> list[list[torch.Tensor]]:
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_length, seed=1)
    source = MicrobatchSource(data, args.micro_batch * args.microbatches, args.micro_batch, 0, 1)
    return [source.batch(i) for i in range(args.warmup + args.steps)]


def timed(args, device, step) -> dict:
    """Runs warm-up then timed steps; per-step times from events recorded between steps."""
    losses = [step(i) for i in range(args.warmup)]
    marks = [Event(device, timing=True).record()]
    for i in range(args.warmup, args.warmup + args.steps):
        losses.append(step(i))
        marks.append(Event(device, timing=True).record())
    ms = [a.elapsed_ms(b) for a, b in zip(marks, marks[1:])]
    return {"losses": losses, "ms": statistics.median(ms)}


def run_ours(args, cfg: GPTConfig, device: torch.device) -> dict:
    train = TrainConfig(model=cfg, zero=ZeroConfig(stage=args.zero_stage),
                        optimizer=OptimizerConfig(lr=args.lr, adam=adam_config(args.lr), clip_grad=1.0),
                        precision=PrecisionConfig(bf16=True),
                        micro_batch_size=args.micro_batch,
                        global_batch_size=args.micro_batch * args.microbatches, seed=1234)
    state = setup(train, ProcessGroups.single(device=device), device)
    params = sum(p.numel() for chunk in state.chunks for p in chunk.parameters())
    batches = step_batches(args, cfg)
    result = timed(args, device, lambda i: train_step(state, batches[i], args.lr).loss)
    return {**result, "params": params}


def peer_model(cfg: GPTConfig, device: torch.device) -> GPT:
    model = GPT(cfg)
    init = make_init_fn(cfg, 1234)
    with torch.no_grad():
        for name, p in model.named_parameters():        # the tied weight appears once
            p.copy_(init(name, p))
    return model.to(device).train()


def run_peer(args, cfg: GPTConfig, device: torch.device) -> dict:
    model = peer_model(cfg, device)
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]           # as ours: no decay on biases and norms
    rest = [p for p in params if p.ndim < 2]
    adam = adam_config(args.lr)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": adam.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps, fused=True)
    batches = step_batches(args, cfg)
    normalizer = args.micro_batch * args.microbatches * cfg.seq_length

    def step(i: int) -> float:
        total = torch.zeros((), device=device)
        for tokens in batches[i]:
            tokens = copy_to_device(tokens, device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:]).float().sum() / normalizer
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total.item()

    result = timed(args, device, step)
    return {**result, "params": sum(p.numel() for p in params)}


def measure(side: str, args, cfg: GPTConfig, device: torch.device) -> dict | None:
    """One side's numbers, or None after printing its traceback (the other side still runs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        result = (run_ours if side == "ours" else run_peer)(args, cfg, device)
    except Exception:
        print(f"--- {side} failed ---\n{traceback.format_exc()}", flush=True)
        return None
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return result


def report(args, cfg: GPTConfig, results: dict) -> None:
    tokens = args.micro_batch * args.microbatches * cfg.seq_length
    print(f"| side | ms/step | tokens/s | TFLOP/s | MFU | peak GiB | x peer time |")
    print("|---|---|---|---|---|---|---|")
    peer = results.get("peer")
    for side, r in results.items():
        if r is None:
            print(f"| {side} | failed | | | | | |")
            continue
        tflops = flops_per_token(cfg, r["params"]) * tokens / (r["ms"] / 1000) / 1e12
        ratio = f"{r['ms'] / peer['ms']:.3f}" if peer and side != "peer" else ""
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
        print(f"| {side} | {r['ms']:.1f} | {tokens / (r['ms'] / 1000):,.0f} | {tflops:.1f} | "
              f"{tflops / args.peak_tflops:.3f} | {peak} | {ratio} |")
    for side, r in results.items():
        if r is not None:
            print(f"{side} losses: " + " ".join(f"{x:.4f}" for x in r["losses"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = model_config(args)
    tokens = args.micro_batch * args.microbatches * cfg.seq_length
    print(f"GPT layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_attention_heads} "
          f"seq={cfg.seq_length} vocab={cfg.vocab_size}; {tokens} tokens/step; device={device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}); "
          f"ours ZeRO stage {args.zero_stage}; peak {args.peak_tflops} TFLOP/s", flush=True)
    results = {side: measure(side, args, cfg, device) for side in args.sides.split(",")}
    first = next((r for r in results.values() if r is not None), None)
    if first is not None:
        print(f"parameters: {first['params'] / 1e6:,.1f}M; FLOPs/token {flops_per_token(cfg, first['params']):.3e}")
    report(args, cfg, results)
    return 0 if all(r is not None for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
