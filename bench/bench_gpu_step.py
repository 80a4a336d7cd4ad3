"""Training-step time and MFU of a ~1.3B-parameter GPT on one GPU in bf16: megazero against plain
torch, measured in the same run, with the figures checked.

    ours  megazero.training.setup / train_step (ZeRO stage 1 by default, one process, tp = pp = dp = 1):
          bf16 parameters and activations, fp32 master weights and Adam states, fp32 gradient norm
          clipping; the pure `megazero.models.GPT` underneath
    peer  a GPT-2 in plain PyTorch (bench/plain_gpt.py: nn.Linear, nn.LayerNorm, SDPA, F.cross_entropy
          on the full logits; no custom autograd Function, so every GEMM of forward and backward runs
          under the autocast) holding megazero's initial weights: fp32 parameters under
          `torch.autocast(bfloat16)` (the standard torch mixed-precision recipe, fp32 master weights
          as ours), `torch.optim.AdamW(fused=True)`, `clip_grad_norm_(1.0)`; the ratio includes the
          model's code as well as the engine's

Both sides start from the same weights (`make_init_fn`: by seed and parameter name; the peer's through
megazero's GPT-2 export, bench/peer_models.initial_hf_state), train on the
same learnable `ArithmeticTokens` microbatches (progressions modulo the vocabulary: the loss falls
within a few steps) with the same optimizer hyperparameters and the same summed token loss over the
global batch, and take one `loss.item()` per step. Attention is SDPA's flash kernel on both sides
(forced on CUDA: a device where it cannot run fails the bench). Dropout is off.

Default shape: 24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304 (tied), micro batch 8, one
microbatch per step. FLOPs per step are megazero.training.flops.step_flops (Megatron's count, what the
training loop's MFU uses); MFU = TFLOP/s / --peak-tflops (default: the device's dense bf16 peak from
megazero.training.flops, 989 for the H100/H200); HFU beside it also counts the FLOPs recomputation adds
(megazero.training.flops.recompute_flops; `--recompute selective|full` turns Megatron's recomputation on for
both sides, the peer's through torch.utils.checkpoint; without it HFU = MFU). The goals, MFU >= 0.50 and ours' step time <= the peer's
/ 0.95, are noted beside those figures, not checked. Step time is the median over the timed steps
(CUDA events between steps, after warm-up); peak memory is torch.cuda.max_memory_allocated of each side, measured
one after the other; ours' is compared with tools/plan_memory.py's device total for the same run
(megazero.config.memory_estimate.plan_bytes).

Checks (`compare`, exit 1 if one fails): every loss finite; each side's last loss below its first;
ours and peer within LOSS_RTOL relative at every step (bf16 computes the residual stream and norms
in bf16 on our side, in fp32 under the peer's autocast: they agree to bf16 noise, not bitwise);
ours' measured peak within MEMORY_RTOL of the plan (on CUDA). `--json PATH` writes the figures in
bench/gpu_check.py's step format.

    python bench/bench_gpu_step.py                         # on a GPU: ~1.3B, both sides, ~2 min
    python bench/bench_gpu_step.py --tiny --device cpu     # the same code path on CPU, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import traceback
from pathlib import Path

import torch

from megazero.config.train_config import OptimizerConfig, ParallelConfig, PrecisionConfig, TrainConfig
from megazero.data.synthetic import ArithmeticTokens
from megazero.training.flops import peak_tflops, recompute_flops, step_flops
from megazero.config.memory_estimate import device_bytes, plan_bytes
from megazero.models.config import GPTConfig
from megazero.parallel.process_groups import ProcessGroups
from megazero.core.streams import Event, copy_to_device
from megazero.data.sampler import MicrobatchSource
from megazero.training import setup, train_step
from megazero.ops.adam_config import AdamConfig
from megazero.zero.config import ZeroConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, also when imported by path
from peer_models import initial_hf_state  # noqa: E402
from plain_gpt import PlainGPT, supports  # noqa: E402

LOSS_RTOL = 0.03  # ours vs peer, every step
MEMORY_RTOL = 0.10  # ours' measured peak vs the plan
MFU_GOAL = 0.50  # the goals, noted beside the figures (not checked)
TIME_GOAL = 1 / 0.95


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
    p.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default="none",
        help="Megatron's --recompute-granularity on both sides (full: uniform, one layer a group)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 peak of the device (default: megazero.training.flops' table, else 989)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--sides", default="ours,peer")
    p.add_argument("--json", default=None, help="write the figures here (bench/gpu_check.py's step format)")
    p.add_argument("--lr", type=float, default=None, help="constant learning rate (default 1e-4; --tiny 1e-2)")
    p.add_argument(
        "--fp32",
        action="store_true",
        help="both sides in fp32 (no bf16 weights, no autocast): their losses then agree to 1e-5",
    )
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
    full = args.recompute == "full"
    return GPTConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_granularity=args.recompute,
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else 0,
    )


def train_config(args, cfg: GPTConfig) -> TrainConfig:
    """Ours' run, as pretrain_gpt.py would configure it (and tools/plan_memory.py plans it)."""
    return TrainConfig(
        model=cfg,
        zero=ZeroConfig(stage=args.zero_stage),
        optimizer=OptimizerConfig(lr=args.lr, adam=adam_config(args.lr), clip_grad=1.0),
        precision=PrecisionConfig(bf16=not args.fp32),
        micro_batch_size=args.micro_batch,
        global_batch_size=args.micro_batch * args.microbatches,
        seed=1234,
        parallel=ParallelConfig(distributed_backend="nccl" if args.device != "cpu" else "gloo"),
    )


def step_batches(args, cfg: GPTConfig) -> list[list[torch.Tensor]]:
    data = ArithmeticTokens(cfg.vocab_size, cfg.seq_length, seed=1)
    source = MicrobatchSource(data, args.micro_batch * args.microbatches, args.micro_batch, 0, 1)
    return [source.batch(i) for i in range(args.warmup + args.steps)]


def flash_attention(device: torch.device):
    """SDPA limited to the flash kernel on CUDA (an error where it cannot run); CPU: its default."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


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
    state = setup(train_config(args, cfg), ProcessGroups.single(device=device), device)
    params = sum(p.numel() for chunk in state.chunks for p in chunk.parameters())
    batches = step_batches(args, cfg)
    result = timed(args, device, lambda i: train_step(state, batches[i], args.lr).loss)
    return {**result, "params": params}


def peer_model(cfg: GPTConfig, device: torch.device) -> PlainGPT:
    """The plain-PyTorch GPT-2 holding megazero's initial weights (the same function as ours)."""
    if not supports(cfg):
        raise ValueError("bench_gpu_step's peer is a GPT-2 (bench/plain_gpt.py): the model must be one")
    model = PlainGPT(cfg)
    model.load_gpt2_state(initial_hf_state(cfg, 1234, "gpt2"))
    return model.to(device).train()


def peer_step(args, cfg: GPTConfig, device: torch.device):
    """(step(i) -> loss, parameter count) of the peer's training loop."""
    model = peer_model(cfg, device)
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]  # as ours: no decay on biases and norms
    rest = [p for p in params if p.ndim < 2]
    adam = adam_config(args.lr)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": adam.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        fused=True,
    )
    batches = step_batches(args, cfg)
    normalizer = args.micro_batch * args.microbatches * cfg.seq_length

    def step(i: int) -> float:
        total = torch.zeros((), device=device)
        for tokens in batches[i]:
            tokens = copy_to_device(tokens, device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.fp32):
                loss = model(tokens[:, :-1], tokens[:, 1:]).float().sum() / normalizer
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total.item()

    return step, sum(p.numel() for p in params)


def run_peer(args, cfg: GPTConfig, device: torch.device) -> dict:
    step, params = peer_step(args, cfg, device)
    return {**timed(args, device, step), "params": params}


def measure(side: str, args, cfg: GPTConfig, device: torch.device) -> dict | None:
    """One side's numbers, or None after printing its traceback (the other side still runs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with flash_attention(device):
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


def figure(value, ok: bool, bound: str, note: str = "") -> dict:
    return {"value": value, "ok": bool(ok), "bound": bound, "note": note}


def compare(
    results: dict,
    tflops_per_step: float,
    peak: float,
    planned_gib: float | None,
    hardware_flops_per_step: float | None = None,
) -> dict:
    """The bench's figures (name -> value, ok, bound) from each side's losses, step time and peak
    memory; a side missing (it failed) fails its figures. MFU counts the model's FLOPs
    (`tflops_per_step`), HFU also what recomputation adds (`hardware_flops_per_step`, the same
    without recomputation); the goals (MFU >= MFU_GOAL, ours' step within TIME_GOAL of the
    peer's) are noted beside the figures, not checked: the bench reports, the reader judges."""
    hardware = hardware_flops_per_step or tflops_per_step
    out = {}
    for side, r in results.items():
        if r is None:
            out[f"{side}_ran"] = figure(False, False, "both sides run")
            continue
        losses, ms = r["losses"], r["ms"]
        finite = all(math.isfinite(x) for x in losses)
        timed = math.isfinite(ms) and ms > 0
        out[f"{side}_losses_finite"] = figure(finite, finite, "every loss finite")
        out[f"{side}_loss_falls"] = figure(
            [losses[0], losses[-1]], finite and losses[-1] < losses[0], "last loss < first (learnable data)"
        )
        tflops = tflops_per_step / (ms / 1000) / 1e12
        out[f"{side}_tokens_per_s"] = figure(r["tokens"] / (ms / 1000), timed, "> 0, reported")
        mfu = tflops / peak
        goal = f"goal >= {MFU_GOAL}: {'met' if mfu >= MFU_GOAL else 'not met'}" if side == "ours" else ""
        out[f"{side}_mfu"] = figure(mfu, timed, f"> 0, reported (peak {peak:g} TFLOP/s, model FLOPs)", goal)
        out[f"{side}_hfu"] = figure(mfu * hardware / tflops_per_step, timed, "> 0, reported (model + recomputed FLOPs)")
    ours, peer = results.get("ours"), results.get("peer")
    if ours is not None and peer is not None:
        gaps = [abs(a - b) / abs(b) for a, b in zip(ours["losses"], peer["losses"])]
        worst = max(gaps) if gaps and all(map(math.isfinite, gaps)) else float("nan")
        out["loss_gap_ours_vs_peer"] = figure(worst, worst <= LOSS_RTOL, f"<= {LOSS_RTOL} relative, every step")
        ratio = ours["ms"] / peer["ms"]
        out["time_ratio_ours_over_peer"] = figure(
            ratio,
            math.isfinite(ratio),
            "reported",
            f"goal <= {TIME_GOAL:.3f} (0.95x the peer's throughput): {'met' if ratio <= TIME_GOAL else 'not met'}",
        )
    if ours is not None and ours.get("peak_gib") is not None and planned_gib:
        ratio = ours["peak_gib"] / planned_gib
        out["memory_measured_over_plan"] = figure(
            ratio,
            abs(ratio - 1) <= MEMORY_RTOL,
            f"within {MEMORY_RTOL:.0%} of tools/plan_memory.py",
            f"measured {ours['peak_gib']:.2f} GiB, planned {planned_gib:.2f} GiB",
        )
    return out


def report(args, results: dict, tflops_per_step: float, peak: float, hardware_flops_per_step: float) -> None:
    print("| side | ms/step | tokens/s | TFLOP/s | MFU | HFU | peak GiB | x peer time |")
    print("|---|---|---|---|---|---|---|---|")
    peer = results.get("peer")
    for side, r in results.items():
        if r is None:
            print(f"| {side} | failed | | | | | | |")
            continue
        tflops = tflops_per_step / (r["ms"] / 1000) / 1e12
        ratio = f"{r['ms'] / peer['ms']:.3f}" if peer and side != "peer" else ""
        memory = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
        print(
            f"| {side} | {r['ms']:.1f} | {r['tokens'] / (r['ms'] / 1000):,.0f} | {tflops:.1f} | "
            f"{tflops / peak:.3f} | {tflops / peak * hardware_flops_per_step / tflops_per_step:.3f} | "
            f"{memory} | {ratio} |"
        )
    for side, r in results.items():
        if r is not None:
            print(f"{side} losses: " + " ".join(f"{x:.6f}" for x in r["losses"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = model_config(args)
    tokens = args.micro_batch * args.microbatches * cfg.seq_length
    peak = args.peak_tflops or peak_tflops(device) or 989.0
    tflops_per_step = step_flops(cfg, tokens)
    hardware_per_step = tflops_per_step + recompute_flops(cfg, tokens, [cfg.num_layers])
    plan = train_config(args, cfg)
    planned_gib = device_bytes(plan_bytes(plan, 1)) / 2**30
    print(
        f"GPT layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_attention_heads} "
        f"seq={cfg.seq_length} vocab={cfg.vocab_size}; {tokens} tokens/step; device={device} "
        f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}); "
        f"ours ZeRO stage {args.zero_stage}; peak {peak:g} TFLOP/s; "
        f"{tflops_per_step / 1e12:.1f} TFLOP/step; planned device memory (ours) {planned_gib:.2f} GiB",
        flush=True,
    )
    results = {side: measure(side, args, cfg, device) for side in args.sides.split(",")}
    for r in results.values():
        if r is not None:
            r["tokens"] = tokens
    first = next((r for r in results.values() if r is not None), None)
    if first is not None:
        print(f"parameters: {first['params'] / 1e6:,.1f}M")
    report(args, results, tflops_per_step, peak, hardware_per_step)
    figures = compare(results, tflops_per_step, peak, planned_gib if device.type == "cuda" else None, hardware_per_step)
    for name, f in figures.items():
        print(f"{'ok  ' if f['ok'] else 'FAIL'} {name} = {f['value']} ({f['bound']}) {f['note']}".rstrip())
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"step": "bench_gpu_step", "figures": figures}, out, indent=1)
    return 0 if all(f["ok"] for f in figures.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
