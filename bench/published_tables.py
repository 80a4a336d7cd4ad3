"""megazero's predicted speed beside published results, on the published layouts
(docs/dry_run.md, "Against published results").

    python bench/published_tables.py                  # every row the dry run can simulate here
    python bench/published_tables.py --rows 1.7B,8B@8 # some rows
    python bench/published_tables.py --list           # the rows, their flags, nothing simulated

Each row runs megazero's dry run of the published layout (`megazero.dry_run.speed.predict`: the
trace of the last training step placed on the device model's streams) and prints the predicted step
time, the per-GPU rate beside the published figure and their ratio (ours / published), megazero's
MFU (its own count: Megatron-LM's current formula, causal attention at half, the recomputed forward not counted),
and, where megazero is predicted slower, the ops the timeline shows most exposed and the flags that
would change them.

Sources (facts only, cited per row in SOURCES):
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC21 (arXiv:2104.04473), Table 1: GPT models 1.7B-1T on A100 80GB (Selene),
  sequence 2048, vocabulary 51,200, fp16 mixed precision, full activation recomputation; per row the
  layers, hidden size, heads, tp, pp, GPUs, global batch, achieved TFLOP/s per GPU, % of peak and
  aggregate PFLOP/s. The paper's rate counts FLOPs with its own formula (section 5.1) with
  recomputation, 96 B s l h^2 (1 + s/6h + V/16lh) per step, attention scores in full: the FLOPs
  the hardware executes. The paper does not state the micro batch sizes: MICRO below is ours.
- torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (torchtitan commit 9dec370, 2024-12-26):
  Llama 3.1 8B, FSDP only (bf16, no Float8, no torch.compile), local batch 2, selective activation
  checkpointing, tokens/s per GPU on 8 GPUs (its Table 1) and 128 GPUs (its Table 3). Its H100s are
  96 GB HBM2e parts at 500 W (between SXM and NVL, its footnote says); we model the H100 SXM. The
  sequence length is not in that file: 8192 is torchtitan's Llama 3 8B training config's seq_len.

Like with like: each row runs with its source's recomputation. Table 1's rows with full activation
recomputation, every layer (FULL_RECOMPUTE), so the paper's rate and ours count the same FLOPs, the
paper's formula with the recomputed forward (96 B s l h^2 (1 + s/6h + V/16lh), `paper_flops`), over
the step: ours is that count over megazero's predicted step. torchtitan's rows with megazero's
selective recomputation (`--recompute-activations`: Megatron's, the attention core recomputed),
the nearest megazero has to torchtitan's selective activation checkpointing (its "op" policy, which
also recomputes every second matmul of a layer: more than ours); its figure is tokens/s per GPU,
compared as such. `executed_flops` (the same count without the recomputed forward) stays for the
JSON's `executed` figure: the rate of the FLOPs a step without recomputation would need.

Ranks: a pipeline's stages at data- and tensor-parallel position 0 (a collective waits only for its
simulated members, and the other positions are the same op for op), so the critical path through
the stages and their p2p is in the timeline. Each row takes minutes on 2 shared cores; the rows past
MAX_WORKS are not run by default (with recomputation, on 2 shared cores: the 310.1B row, 3,456,
508 s; the 529.6B row, 7,350, 530 s; the 1T row, 16,384 on 64 ranks, 698 s): the script says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

NARAYANAN = "Narayanan et al. 2021 (SC21, arXiv:2104.04473), Table 1"
TORCHTITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 9dec370, 2024-12-26)"
SEQ, VOCAB = 2048, 51200  # Table 1's models: "vocabulary 51,200, sequence 2048" (section 5.1)

# Table 1 of Narayanan et al. 2021, one row per model: params (billions), heads, hidden, layers, tp,
# pp, GPUs, global batch, achieved TFLOP/s per GPU, % of theoretical peak, aggregate PFLOP/s.
TABLE1 = """
1.7     24   2304   24  1   1    32   512  137  44    4.4
3.6     32   3072   30  2   1    64   512  138  44    8.8
7.5     32   4096   36  4   1   128   512  142  46   18.2
18.4    48   6144   40  8   1   256  1024  135  43   34.6
39.1    64   8192   48  8   2   512  1536  138  44   70.8
76.1    80  10240   60  8   4  1024  1792  140  45  143.8
145.6   96  12288   80  8   8  1536  2304  148  47  227.1
310.1  128  16384   96  8  16  1920  2160  155  50  297.4
529.6  128  20480  105  8  35  2520  2520  163  52  410.2
1008.0 160  25600  128  8  64  3072  3072  163  52  502.0
"""
A100_PEAK_TFLOPS = 312.0  # the paper's peak: A100 fp16/bf16 tensor core, dense
MICRO = 4  # our choice of micro batch (Table 1 does not state one)
MAX_WORKS = 6_000  # microbatches x layers one pipeline simulates: above, not run here


@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # "1.7B": the --rows key
    source: str
    gpu: str  # the device model (megazero/dry_run/gpus.toml)
    argv: tuple  # pretrain_gpt.py's flags of the layout
    world: int
    tp: int
    pp: int
    dp: int
    layers: int
    hidden: int
    batch: int
    seq: int
    published: float  # TFLOP/s per GPU (Narayanan) or tokens/s per GPU (torchtitan)
    unit: str  # "TFLOP/s" or "tokens/s"


def parse_table1(text: str = TABLE1) -> list[dict]:
    """TABLE1's rows as dicts (dp = GPUs / (tp x pp))."""
    keys = ("params_b", "heads", "hidden", "layers", "tp", "pp", "gpus", "batch", "tflops", "percent", "pflops")
    rows = []
    for line in text.strip().splitlines():
        values = line.split()
        if len(values) != len(keys):
            raise ValueError(f"TABLE1 row {line!r}: {len(values)} columns, expected {len(keys)}")
        row = {k: (float(v) if k in ("params_b", "tflops", "pflops") else int(v)) for k, v in zip(keys, values)}
        row["dp"] = row["gpus"] // (row["tp"] * row["pp"])
        rows.append(row)
    return rows


def paper_params(layers: int, hidden: int, vocab: int = VOCAB, seq: int = SEQ) -> float:
    """The paper's parameter count: 12 l h^2 (1 + 13/12h + (V + s)/12lh)."""
    return 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (vocab + seq) / (12 * layers * hidden))


def paper_flops(batch: int, layers: int, hidden: int, seq: int = SEQ, vocab: int = VOCAB) -> float:
    """The paper's FLOPs of one step with full recomputation: 96 B s l h^2 (1 + s/6h + V/16lh)."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def executed_flops(batch: int, layers: int, hidden: int, seq: int = SEQ, vocab: int = VOCAB) -> float:
    """The same count without the recomputed forward (what a step without recomputation executes):
    72 B s l h^2 (1 + s/6h + V/12lh), the paper's terms less one forward of the layers."""
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


FULL_RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
SELECTIVE_RECOMPUTE = ("--recompute-activations",)


def _gpt_argv(r: dict, micro: int) -> tuple:
    return FULL_RECOMPUTE + tuple(
        f"--num-layers {r['layers']} --hidden-size {r['hidden']} --num-attention-heads {r['heads']} "
        f"--seq-length {SEQ} --max-position-embeddings {SEQ} --vocab-size {VOCAB} --tokenizer-type NullTokenizer "
        f"--micro-batch-size {micro} --global-batch-size {r['batch']} --train-iters 1 --fp16 "
        f"--tensor-model-parallel-size {r['tp']} --pipeline-model-parallel-size {r['pp']} --zero-stage 0 "
        f"--attention-dropout 0 --hidden-dropout 0".split()
    )


def _llama8b_argv(dp: int, micro: int) -> tuple:
    return SELECTIVE_RECOMPUTE + tuple(
        "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
        "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
        "--seq-length 8192 --max-position-embeddings 8192 --vocab-size 128256 --tokenizer-type NullTokenizer "
        f"--micro-batch-size {micro} --global-batch-size {micro * dp} --train-iters 1 --bf16 --zero-stage 3 "
        "--attention-dropout 0 --hidden-dropout 0".split()
    )


def rows(micro: int = MICRO) -> list[Row]:
    out = []
    for r in parse_table1():
        name = f"{r['params_b']:g}B"
        out.append(
            Row(
                name,
                f"{NARAYANAN}, the {name} row",
                "a100",
                _gpt_argv(r, micro),
                r["gpus"],
                r["tp"],
                r["pp"],
                r["dp"],
                r["layers"],
                r["hidden"],
                r["batch"],
                SEQ,
                r["tflops"],
                "TFLOP/s",
            )
        )
    for gpus, tps, table in ((8, 5762.0, 1), (128, 5605.0, 3)):
        out.append(
            Row(
                f"8B@{gpus}",
                f"{TORCHTITAN}, Table {table}, FSDP row",
                "h100",
                _llama8b_argv(gpus, 2),
                gpus,
                1,
                1,
                gpus,
                32,
                4096,
                2 * gpus,
                8192,
                tps,
                "tokens/s",
            )
        )
    return out


def works(row: Row) -> int:
    """Microbatches x layers the simulated ranks run together (one pipeline): the dry run's time
    grows with it."""
    micro = int(row.argv[row.argv.index("--micro-batch-size") + 1])
    return row.batch // (row.dp * micro) * row.layers


def pipeline_ranks(row: Row) -> list[int]:
    """The ranks of one pipeline (tp and dp position 0) in Megatron's rank order tp-cp-dp-pp."""
    return [stage * row.tp * row.dp for stage in range(row.pp)]


def flags_for(op: str) -> str:
    """The flags that change an exposed op (the timeline's label: "all_reduce dp[32]", "send to 8")."""
    if op.startswith(("send", "recv")) or " pp[" in op:
        return "--overlap-p2p-communication; --num-layers-per-virtual-pipeline-stage (smaller bubble)"
    if " tp[" in op:
        return (
            "none in megazero yet: tensor-parallel collectives run on the compute stream (nothing like "
            "Megatron's --tp-comm-overlap); a smaller --tensor-model-parallel-size with more pipeline stages"
        )
    if op.startswith("all_gather"):
        return "--overlap-param-gather (prefetch), larger stage3_prefetch_bucket_size"
    if op.startswith(("all_reduce", "reduce_scatter")):
        return "--overlap-grad-reduce (bucket sizes: --zero-config reduce_bucket_size)"
    return "-"


def measure(row: Row) -> dict:
    """The row's prediction: step time, per-GPU rate, ratio, MFU and the most exposed ops."""
    from megazero.dry_run.speed import predict

    start = time.perf_counter()
    result = predict(list(row.argv), row.gpu, row.world, ranks=pipeline_ranks(row))
    out = {"row": row.name, "wall_s": time.perf_counter() - start, "step_s": result["step_s"], "note": result["note"]}
    if result["step_s"] is None:
        return out
    step, ranks = result["step_s"], result["ranks"]
    if row.unit == "TFLOP/s":
        out["predicted"] = paper_flops(row.batch, row.layers, row.hidden) / step / row.world / 1e12
        out["executed"] = executed_flops(row.batch, row.layers, row.hidden) / step / row.world / 1e12
    else:
        out["predicted"] = result["tokens_per_s_per_device"]
    out["ratio"] = out["predicted"] / row.published
    out["mfu"] = max(r["mfu"] for r in ranks if r["mfu"] is not None)
    out["parts_s"] = {k: max(r[k] for r in ranks) for k in ("compute_s", "exposed_comm_s", "bubble_s", "host_s")}
    most = {}  # per (op, call site) its most exposed rank: the ranks of a pipeline repeat them
    for op in (op for r in ranks for op in r["top_exposed"]):
        key = (op["op"], op["site"])
        if key not in most or op["exposed_s"] > most[key]["exposed_s"]:
            most[key] = op
    exposed = sorted(most.values(), key=lambda op: -op["exposed_s"])
    out["exposed"] = [dict(op, flags=flags_for(op["op"])) for op in exposed[:3]]
    if out["parts_s"]["bubble_s"] > 0.02 * step:
        out["exposed"].append(
            {
                "op": "pipeline bubble",
                "site": "-",
                "calls": 1,
                "exposed_s": out["parts_s"]["bubble_s"],
                "flags": "--num-layers-per-virtual-pipeline-stage (interleaved), more microbatches "
                "(a smaller --micro-batch-size), or a zero-bubble --pipeline-schedule",
            }
        )
    return out


def line(row: Row, m: dict) -> str:
    if m.get("step_s") is None:
        return f"{row.name:>8}  {row.published:>9,.0f} {row.unit:<8}  not run: {m.get('note')}"
    parts = m["parts_s"]
    text = (
        f"{row.name:>8}  {row.published:>9,.0f} {row.unit:<8} ours {m['predicted']:>9,.1f}  "
        f"ratio {m['ratio']:.2f}  MFU {m['mfu']:.1%}  step {m['step_s']:.3f} s (compute {parts['compute_s']:.3f}, "
        f"exposed comm {parts['exposed_comm_s']:.3f}, bubble {parts['bubble_s']:.3f}, host {parts['host_s']:.3f})"
        f"  [{m['wall_s']:.0f} s here]"
    )
    # where megazero is predicted slower, the most exposed ops (and the bubble) with their flags; else the first
    for op in m["exposed"] if m["ratio"] < 1 else m["exposed"][:1]:
        text += (
            f"\n{'':>10}exposed {1000 * op['exposed_s']:,.1f} ms: {op['op']} x{op['calls']} at {op['site']}"
            f" -> {op['flags']}"
        )
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=None, help="comma-separated row names (default: every row)")
    p.add_argument("--list", action="store_true", help="print the rows and their flags, simulate nothing")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument("--all", action="store_true", help=f"also the rows above {MAX_WORKS:,} microbatch-layers")
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=MICRO,
        help=f"Table 1's rows' micro batch (the paper does not state it; default {MICRO})",
    )
    opts = p.parse_args(argv)
    table = rows(opts.micro_batch_size)
    if opts.rows:
        wanted = opts.rows.split(",")
        unknown = sorted(set(wanted) - {r.name for r in table})
        if unknown:
            p.error(f"unknown rows {unknown}; the rows: {', '.join(r.name for r in table)}")
        table = [r for r in table if r.name in wanted]
    results = []
    for row in table:
        if opts.list:
            print(
                f"{row.name}: {row.gpu} x{row.world}, {row.published:g} {row.unit} ({row.source}); {' '.join(row.argv)}"
            )
            continue
        if works(row) > MAX_WORKS and not opts.all:
            m = {
                "row": row.name,
                "step_s": None,
                "note": f"{works(row):,} microbatch-layers in a pipeline (above {MAX_WORKS:,}: past a few minutes on 2 shared cores; --all runs it)",
            }
        else:
            m = measure(row)
        results.append(m)
        print(line(row, m), flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
