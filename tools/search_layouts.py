"""The fastest layouts of a model on N ranks of a named GPU that fit its memory (docs/dry_run.md,
"Which layout is fastest").

    python tools/search_layouts.py --world-size 8 --gpu h100 --top-k 3 --num-layers 32 --hidden-size 4096 \\
        --num-attention-heads 32 --seq-length 8192 --global-batch-size 32 --train-iters 2 --bf16 ...

Takes pretrain_gpt.py's model and batch flags (no layout flag: the search picks tensor, pipeline,
virtual-pipeline, context and data-parallel sizes, the ZeRO stage, recomputation and the micro
batch) plus --world-size, --gpu a100|h100|h200|cpu, --top-k K (layouts timed by the dry run,
default 3; each costs one dry run of every rank), --zero-stages, --recompute, --micro-batches,
--virtual (comma-separated choices to try; defaults 0,1,2,3 / none,selective,full / 1,2,4,8 / 1,2,4),
--ranks-per-node-sim (a node's GPUs, default the GPU's node), --processes and --json PATH ('-':
stdout). Every layout megazero's flag checks accept is kept if the memory planner's total fits the
device; those are ranked by a closed-form estimate and the best K timed by the dry run's timeline
(megazero.dry_run.layout_search). Exit 0: at least one layout timed; 1: none fits; 2: a flag mistake.
"""

from __future__ import annotations

import argparse
import json
import sys

SPACE = {
    "zero_stages": ("--zero-stages", "0,1,2,3", int),
    "recompute": ("--recompute", "none,selective,full", str),
    "micro_batches": ("--micro-batches", "1,2,4,8", int),
    "virtual": ("--virtual", "1,2,4", int),
}


def parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: pretrain_gpt.py's --zero-stage must not read as our --zero-stages
    ours = argparse.ArgumentParser(
        prog="tools/search_layouts.py",
        add_help=False,
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is pretrain_gpt.py's (python pretrain_gpt.py --help).",
    )
    ours.add_argument("--world-size", type=int, required=True)
    ours.add_argument("--gpu", required=True, help="a100, h100, h200 or cpu")
    ours.add_argument("--top-k", type=int, default=3)
    for flag, default, _ in SPACE.values():
        ours.add_argument(flag, default=default)
    ours.add_argument("--ranks-per-node-sim", type=int, default=None)
    ours.add_argument("--processes", type=int, default=None)
    ours.add_argument("--json", default=None)
    return ours


def _space(opts) -> dict:
    from megazero.core.errors import UsageError
    from megazero.dry_run.layout_search import RECOMPUTE

    out = {}
    for key, (flag, _, kind) in SPACE.items():
        text = getattr(opts, flag[2:].replace("-", "_"))
        try:
            values = tuple(kind(v) for v in text.split(","))
        except ValueError:
            raise UsageError(f"{flag} {text}: give comma-separated values, e.g. {SPACE[key][1]}") from None
        if key == "recompute" and any(v not in RECOMPUTE for v in values):
            raise UsageError(f"{flag} {text}: choose among {', '.join(RECOMPUTE)}")
        out[key] = values
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(parser().format_help())
        return 0
    from megazero.core.errors import UsageError
    from megazero.dry_run.layout_search import search, search_text

    try:
        opts, train_argv = parser().parse_known_args(argv)
        result = search(
            train_argv,
            opts.world_size,
            opts.gpu,
            opts.top_k,
            local_world=opts.ranks_per_node_sim,
            processes=opts.processes,
            **_space(opts),
        )
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if opts.json is not None:
        rows = [{**row, "layout": row["layout"].text()} for row in result["rows"]]
        doc = {**result, "rows": rows, "dropped": [[layout.text(), total] for layout, total in result["dropped"]]}
        if opts.json == "-":
            json.dump(doc, sys.stdout, indent=1)
            print()
        else:
            with open(opts.json, "w") as f:
                json.dump(doc, f, indent=1)
    if opts.json != "-":
        print(search_text(result))
    if not result["rows"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
