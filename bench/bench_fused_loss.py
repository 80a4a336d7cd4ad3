"""The output layer and its cross entropy, forward + backward, on CPU: megazero's fused path
(models/loss.py) against the unfused pair a torch user writes and against transformers' loss, at
small and large vocabularies and several token counts, in the same run.

    fused        megazero.models.loss.linear_cross_entropy, its default chunking (one chunk kept from
                 the forward while the fp32 logits fit its budget, else budget-sized chunks recomputed
                 in backward)
    fused-old    the same function with the rule before it: vocab / hidden chunks, logits recomputed
    unfused      F.linear, then F.cross_entropy on the fp32 logits
    transformers F.linear, then transformers' ForCausalLMLoss (what GPT2LMHeadModel / LlamaForCausalLM
                 compute from their logits: upcast, cross entropy)

Every side gets the same hidden states, weight and labels (fp32), returns the summed token loss,
and runs its backward into the hidden states and the weight; the losses are printed against the
unfused one (the same function: they agree to ~1e-6). Sides alternate over rounds and keep their
fastest (other load only adds time). `--memory` also runs each side once in a fresh process and
reports its peak resident growth (glibc told to give large blocks back, so the peak is the live
memory's) beside the planner's term for the fused path (megazero.config.memory_estimate.
output_layer_bytes: what the fused loss holds at once) and the input gradient it returns.

    python bench/bench_fused_loss.py                   # ~8 min on 2 cores (one thread)
    python bench/bench_fused_loss.py --vocabs 8192 --tokens 512,2048 --memory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from megazero.config.memory_estimate import output_layer_bytes
from megazero.models.config import GPTConfig
from megazero.models.loss import chunk_tokens_for, linear_cross_entropy

SIDES = ("fused", "fused-old", "unfused", "transformers")


def old_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """The rule before the memory budget: vocab / hidden chunks."""
    chunks = max(1, -(-vocab // max(1, hidden)))
    return max(1, -(-tokens // chunks))


def inputs(tokens: int, vocab: int, hidden: int):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, hidden, generator=g) * 0.5).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=g) * 0.05).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    return x, weight, labels


def loss_of(side: str, x, weight, labels) -> torch.Tensor:
    vocab, hidden = weight.shape
    if side == "fused":
        return linear_cross_entropy(x, weight, labels, vocab).sum()
    if side == "fused-old":
        return linear_cross_entropy(
            x, weight, labels, vocab, chunk_tokens=old_chunk_tokens(labels.numel(), vocab, hidden)
        ).sum()
    logits = F.linear(x, weight)
    if side == "unfused":
        return F.cross_entropy(logits.float(), labels, reduction="sum")
    from transformers.loss.loss_utils import ForCausalLMLoss

    # num_items_in_batch 1: its sum, as the other sides (the mean would only divide by the tokens)
    return ForCausalLMLoss(logits[None], None, vocab, num_items_in_batch=1, shift_labels=labels[None])


def run_side(side: str, tokens: int, vocab: int, hidden: int, repeats: int) -> dict:
    x, weight, labels = inputs(tokens, vocab, hidden)
    times, loss = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        loss = loss_of(side, x, weight, labels)
        loss.backward()
        times.append(1000 * (time.perf_counter() - started))
        x.grad = weight.grad = None
    return {"ms": min(times), "loss": loss.item()}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(l for l in status if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def memory_child(side: str, tokens: int, vocab: int, hidden: int) -> None:
    """In a fresh process: the peak resident growth of one forward + backward, in bytes (the
    kernel's high-water mark VmHWM, reset through /proc/self/clear_refs before the call)."""
    torch.set_num_threads(1)
    x, weight, labels = inputs(tokens, vocab, hidden)
    loss_of(side, *inputs(8, 16, 4)).backward()  # load every kernel before the baseline
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    baseline = _status_bytes("VmRSS")
    loss_of(side, x, weight, labels).backward()
    print(json.dumps({"growth": _status_bytes("VmHWM") - baseline}))


def measure_memory(side: str, tokens: int, vocab: int, hidden: int) -> float:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", side, str(tokens), str(vocab), str(hidden)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["growth"]


def planned_bytes(tokens: int, vocab: int, hidden: int) -> float:
    """The planner's output-layer term (fp32, one microbatch) plus the input gradient returned."""
    cfg = GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=1, num_attention_heads=1, seq_length=tokens)
    return output_layer_bytes(tokens, cfg, 1, 4) + tokens * hidden * 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocabs", default="8192,50304,128256")
    p.add_argument("--tokens", default="512,2048,4096")
    p.add_argument(
        "--max-elements",
        type=float,
        default=2**29,
        help="skip a point whose tokens x vocabulary exceeds this (the unfused side holds ~3 "
        "fp32 copies of the logits)",
    )
    p.add_argument(
        "--old-max-elements",
        type=float,
        default=2**24,
        help="fused-old runs only up to this tokens x vocabulary (its chunks of a few tokens "
        "take minutes at large vocabularies)",
    )
    p.add_argument("--repeats", type=int, default=2, help="forward + backward per side per round (fastest kept)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--memory", action="store_true", help="also each side's peak memory, in fresh processes")
    p.add_argument("--memory-child", nargs=4, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.memory_child:
        side, tokens, vocab, hidden = args.memory_child
        return memory_child(side, int(tokens), int(vocab), int(hidden))
    torch.set_num_threads(args.threads)
    sides = args.sides.split(",")
    points = [
        (t, v)
        for v in map(int, args.vocabs.split(","))
        for t in map(int, args.tokens.split(","))
        if t * v <= args.max_elements
    ]
    print(
        f"output layer + cross entropy, forward + backward, fp32, hidden {args.hidden}; "
        f"{args.rounds} rounds x {args.repeats} repeats; {torch.get_num_threads()} thread(s); "
        f"torch {torch.__version__}",
        flush=True,
    )
    best: dict = {}
    for _ in range(args.rounds):
        for tokens, vocab in points:
            for side in sides:
                if side == "fused-old" and tokens * vocab > args.old_max_elements:
                    continue
                r = run_side(side, tokens, vocab, args.hidden, args.repeats)
                key = (tokens, vocab, side)
                if key not in best or r["ms"] < best[key]["ms"]:
                    best[key] = r
            print(
                f"  vocab {vocab:>6} tokens {tokens:>5}: "
                + "  ".join(f"{s} {best[(tokens, vocab, s)]['ms']:.1f}" for s in sides if (tokens, vocab, s) in best),
                flush=True,
            )
    head = " | ".join(f"{s} ms" for s in sides)
    print(f"\n| vocab | tokens | chunk | {head} | fused / unfused | fused / transformers | loss gap |")
    print("|---|---|---|" + "---|" * len(sides) + "---|---|---|")
    for tokens, vocab in points:
        r = {s: best[(tokens, vocab, s)] for s in sides if (tokens, vocab, s) in best}
        ref = r.get("unfused", r[sides[0]])
        gap = max(abs(x["loss"] - ref["loss"]) / abs(ref["loss"]) for x in r.values())
        ratios = [
            f"{r['fused']['ms'] / r[s]['ms']:.3f}" if "fused" in r and s in r else "-"
            for s in ("unfused", "transformers")
        ]
        print(
            f"| {vocab} | {tokens} | {chunk_tokens_for(tokens, vocab)} | "
            + " | ".join(f"{r[s]['ms']:.1f}" if s in r else "-" for s in sides)
            + f" | {ratios[0]} | {ratios[1]} | {gap:.1e} |"
        )
    print(
        "chunk: the fused path's tokens per chunk (= tokens: one chunk, kept from the forward); "
        "ratios < 1: fused faster; loss gap: largest relative difference from the unfused loss"
    )
    if args.memory:
        print(
            "\npeak resident growth of one forward + backward (MiB), fresh process per side; planned: the "
            "planner's output-layer term + the input gradient"
        )
        print("| vocab | tokens | planned | " + " | ".join(sides) + " | fused / planned |")
        print("|---|---|---|" + "---|" * len(sides) + "---|")
        for tokens, vocab in points:
            grown = {
                s: measure_memory(s, tokens, vocab, args.hidden)
                for s in sides
                if s != "fused-old" or tokens * vocab <= args.old_max_elements
            }
            planned = planned_bytes(tokens, vocab, args.hidden)
            fused = f"{grown['fused'] / planned:.2f}" if "fused" in grown else "-"
            print(
                f"| {vocab} | {tokens} | {planned / 2**20:.1f} | "
                + " | ".join(f"{grown[s] / 2**20:.1f}" if s in grown else "-" for s in sides)
                + f" | {fused} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
