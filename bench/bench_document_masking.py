"""Document masking (--reset-position-ids --reset-attention-mask --eod-mask-loss) against the same
step without it, at long sequences: memory and time, with ratios measured in the same run.

    python bench/bench_document_masking.py                 # seq 8192 and 32768 (minutes: the
                                                           # unmasked step at 32768 is the slow one)
    python bench/bench_document_masking.py --seqs 8192     # one length
    python bench/bench_document_masking.py --flex          # also torch's FlexAttention, eager, forward
                                                           # only (it has no CPU backward), at 8192
    python bench/bench_document_masking.py --tiny          # the path check, seconds

Both sides train the same small GPT (RoPE, fp32, ZeRO-1, micro batch 1, one sample a step) on the
same packed samples (megazero.data.synthetic.DocumentTokens: documents of 1 to --max-document
tokens, each ending with the end-of-document id), one process in a gloo pool of one rank, a warm-up
step then --steps timed steps; the masked side has the three flags on, the unmasked (the peer)
attends across documents. Columns:
- measured MB: the timed steps' resident high-water mark above what the process held after the
  warm-up step (bench/plan_memory_table.py's method; the warm-up's one-time costs left out), the
  same for both sides;
- dry run MB: megazero.dry_run.simulate's peak for one rank of the same flags (meta device), as a
  CPU ("cpu": the CPU's kernels, one SDPA call per document) and as a GPU ("cuda": the varlen
  kernel's stand-in, one causal flash call's memory);
- planned MB: the memory planner's activations + comm buffers;
- ms/step: the median timed step.
Then the attention kernel alone, forward and backward at the model's attention shape: torch's own
SDPA call over the whole sequence (is_causal, the unmasked kernel) against models/attention.py's
per-document path (and, with --flex, torch's flex_attention with a document block mask, forward).

Checks (exit 1 if one fails): losses finite; masked / unmasked within MEMORY_RATIO for the measured
peak and both dry runs, and within TIME_RATIO for the step.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from megazero.config.flags import build_parser
from megazero.config.memory_estimate import plan_bytes
from megazero.config.train_flags import config_from_args
from megazero.parallel.topology import Topology
from plan_memory_table import fresh_high_water_mark, status_bytes

MEMORY_RATIO, TIME_RATIO = 1.05, 1.2
DOCUMENT_FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="8192,32768")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--max-document", type=int, default=4096, help="documents of 1 to this many tokens")
    p.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step")
    p.add_argument("--flex", action="store_true", help="also torch's flex_attention, eager, forward only")
    p.add_argument("--tiny", action="store_true", help="seq 256, documents up to 64 tokens")
    args = p.parse_args(argv)
    if args.tiny:
        args.seqs, args.max_document = "256", 64
    args.seqs = [int(s) for s in str(args.seqs).split(",")]
    return args


def flags(args, seq: int, masked: bool) -> list[str]:
    """pretrain_gpt.py's flags of one side (the dry run and the planner read the same)."""
    argv = [
        "--num-layers",
        str(args.layers),
        "--hidden-size",
        str(args.hidden),
        "--num-attention-heads",
        str(args.heads),
        "--ffn-hidden-size",
        str(4 * args.hidden),
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--position-embedding-type",
        "rope",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--zero-stage",
        "1",
        "--lr",
        "1e-4",
        "--train-iters",
        "2",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(args.vocab),
    ]
    return argv + (DOCUMENT_FLAGS if masked else [])


def config(args, seq: int, masked: bool):
    return config_from_args(build_parser().parse_args(flags(args, seq, masked)), world_size=1)


def step_worker(ctx, args, seq: int, masked: bool):
    """Pool entry: the side's losses, step times and peak bytes above the post-set-up baseline."""
    from megazero.data.sampler import MicrobatchSource
    from megazero.data.synthetic import DocumentTokens
    from megazero.training import setup, train_step

    groups = ctx.groups(Topology(world_size=1))
    cfg = config(args, seq, masked)
    eod = cfg.model.vocab_size - 1
    state = setup(cfg, groups, eod=eod if masked else None)
    data = DocumentTokens(cfg.model.vocab_size, seq, eod, seed=3, max_document=args.max_document)
    source = MicrobatchSource(data, 1, 1, 0, 1)
    losses, wall = [train_step(state, source.batch(0), 1e-4).loss], []
    base = fresh_high_water_mark()  # after the warm-up step: its one-time costs (the first side's) left out
    for it in range(1, args.steps + 1):
        start = time.perf_counter()
        losses.append(train_step(state, source.batch(it), 1e-4).loss)
        wall.append(time.perf_counter() - start)
    return {"losses": losses, "ms": 1000 * statistics.median(wall or [0.0]), "measured": status_bytes("VmHWM") - base}


def dry_run_peak(args, seq: int, masked: bool, device_kind: str) -> float:
    from megazero.dry_run.job import simulate

    run = simulate(flags(args, seq, masked), 1, processes=1, stream_check=False, device_kind=device_kind, save=False)[0]
    if run.error:
        raise RuntimeError(f"dry run ({device_kind}, seq {seq}): {run.error}")
    return float(run.memory["peak"])


def attention_alone(args, seq: int, flex: bool) -> dict:
    """Forward + backward of the attention kernel alone at the model's attention shape (b 1, fp32):
    torch's whole-sequence causal SDPA against the per-document path; times and peak RSS growth."""
    from megazero.data.synthetic import DocumentTokens
    from megazero.models.attention import varlen_attention
    from megazero.models.documents import DocumentMasking, pack_documents

    heads, d = args.heads, args.hidden // args.heads
    tokens = torch.as_tensor(
        DocumentTokens(args.vocab, seq, args.vocab - 1, seed=3, max_document=args.max_document)[0]["tokens"]
    )
    documents, _ = pack_documents(tokens[None, :-1], DocumentMasking(args.vocab - 1, True, True, True))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, heads, d, generator=gen) for _ in range(3))
    out = {"documents": len(documents.bounds) - 1}

    def timed(name, fn, backward=True):
        qkv = [t.clone().requires_grad_(backward) for t in (q, k, v)]
        base = fresh_high_water_mark()
        start = time.perf_counter()
        result = fn(*qkv)
        if backward:
            result.sum().backward()
        out[name] = (1000 * (time.perf_counter() - start), (status_bytes("VmHWM") - base) / 1e6)

    timed(
        "torch SDPA causal",
        lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ),
    )
    timed("per document", lambda q, k, v: varlen_attention(q, k, v, documents))
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        ids = documents.doc_ids

        def same_document(b, h, i, j):
            return (ids[b, i] == ids[b, j]) & (j <= i)

        mask = create_block_mask(same_document, 1, None, seq, seq, device="cpu")
        timed(
            "torch flex_attention (eager, forward)",
            lambda q, k, v: flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask),
            backward=False,
        )
    return out


def main(argv=None) -> int:
    from megazero.testing import DistributedPool

    args = parse_args(argv)
    print(
        f"GPT layers={args.layers} hidden={args.hidden} heads={args.heads} vocab={args.vocab} fp32, RoPE, "
        f"ZeRO-1, micro batch 1; documents of 1 to {args.max_document} tokens; {args.steps} timed step(s)"
    )
    print(
        "| seq | side | ms/step | measured MB | dry run cpu MB | dry run cuda MB | planned MB |\n"
        "|---|---|---|---|---|---|---|",
        flush=True,
    )
    pool, failed, rows = DistributedPool(1), [], {}
    try:
        for seq in args.seqs:
            for masked in (False, True):
                row = pool.run(step_worker, args, seq, masked)[0]
                row["cpu"], row["cuda"] = (dry_run_peak(args, seq, masked, kind) for kind in ("cpu", "cuda"))
                plan = plan_bytes(config(args, seq, masked), 1)
                row["planned"] = plan["activations"] + plan["comm_buffers"]
                rows[seq, masked] = row
                print(
                    f"| {seq} | {'masked' if masked else 'unmasked'} | {row['ms']:.0f} | "
                    f"{row['measured'] / 1e6:.1f} | {row['cpu'] / 1e6:.1f} | {row['cuda'] / 1e6:.1f} | "
                    f"{row['planned'] / 1e6:.1f} |",
                    flush=True,
                )
    finally:
        pool.close()
    for seq in args.seqs:
        plain, masked = rows[seq, False], rows[seq, True]
        ratios = {key: masked[key] / plain[key] for key in ("ms", "measured", "cpu", "cuda", "planned")}
        print(
            f"seq {seq}: masked / unmasked: time {ratios['ms']:.2f}, measured memory {ratios['measured']:.3f}, "
            f"dry run cpu {ratios['cpu']:.3f}, dry run cuda {ratios['cuda']:.3f}, planned {ratios['planned']:.3f}"
        )
        for key in ("measured", "cpu", "cuda"):
            if ratios[key] > MEMORY_RATIO:
                failed.append(f"seq {seq}: {key} memory ratio {ratios[key]:.3f} > {MEMORY_RATIO}")
        if ratios["ms"] > TIME_RATIO and not args.tiny:
            failed.append(f"seq {seq}: time ratio {ratios['ms']:.2f} > {TIME_RATIO}")
        if not all(map(lambda x: x == x and abs(x) != float("inf"), plain["losses"] + masked["losses"])):
            failed.append(f"seq {seq}: a loss is not finite")
        alone = attention_alone(args, seq, args.flex and seq <= 8192)
        kernels = {name: value for name, value in alone.items() if name != "documents"}
        line = ", ".join(f"{name} {ms:.0f} ms {mb:.1f} MB" for name, (ms, mb) in kernels.items())
        sdpa, ours = alone["torch SDPA causal"], alone["per document"]
        print(
            f"seq {seq}: attention alone ({alone['documents']} documents): {line}; per document / torch SDPA: "
            f"time {ours[0] / sdpa[0]:.2f}, memory {ours[1] / max(sdpa[1], 1e-9):.2f}"
        )
    print(f"process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    for line in failed:
        print(f"FAIL {line}")
    print("all checks passed" if not failed else f"{len(failed)} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
