"""Plot the metrics.jsonl of one or more runs on shared axes.

    python tools/plot_metrics.py runs/a runs/b --output plots.png

Panels: loss (train solid, valid dashed), learning rate, gradient norm, throughput (tokens/s) and memory
(MiB), each against the iteration; one colour per run, named as given on the command line. A RUN_DIR
may also be the metrics file itself (for runs with --metrics-file). Needs matplotlib:
pip install -e '.[plots]'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (record field, panel title); loss is drawn for both splits
PANELS = (
    ("loss", "loss"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_s", "throughput (tokens/s)"),
    ("memory_mib", "memory (MiB)"),
)
FIGSIZE, DPI = (10.0, 12.0), 100


class PlotError(Exception):
    """Bad input, reported as one line."""


def read_run(path: Path) -> tuple[str, list[dict]]:
    """(label, records) of a run folder holding metrics.jsonl, or of a metrics file."""
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics.is_file():
        raise PlotError(f"{path}: no metrics.jsonl there; give a run folder (--run-dir) or its metrics file")
    records = []
    for number, line in enumerate(metrics.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise PlotError(f"{metrics}:{number} is not a JSON object; is this a metrics.jsonl?") from None
    if not records:
        raise PlotError(f"{metrics} holds no records yet; plot it once the run has logged an iteration")
    return str(path), records


def series(records: list[dict], split: str, field: str) -> tuple[list[int], list[float]]:
    points = [
        (r["iteration"], r[field])
        for r in records
        if r.get("split", "train") == split and isinstance(r.get(field), (int, float))
    ]
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(runs: list[tuple[str, list[dict]]], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(PANELS), 1, figsize=FIGSIZE, sharex=True, dpi=DPI)
    for index, (label, records) in enumerate(runs):
        colour = f"C{index % 10}"
        for ax, (field, _) in zip(axes, PANELS):
            x, y = series(records, "train", field)
            ax.plot(x, y, color=colour, label=f"{label} train" if field == "loss" else label)
        x, y = series(records, "valid", "loss")
        if x:
            axes[0].plot(x, y, color=colour, linestyle="--", marker="o", markersize=3, label=f"{label} valid")
    for ax, (field, title) in zip(axes, PANELS):
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if field == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes[0].legend(fontsize="small")
    axes[-1].set_xlabel("iteration")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Plot loss, lr, grad norm, throughput and memory of runs.")
    parser.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl) or metrics files")
    parser.add_argument("--output", default="plots.png", help="image to write (default: plots.png)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "error: plot_metrics.py needs matplotlib; pip install -e '.[plots]' (or pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    output = Path(args.output)
    try:
        runs = [read_run(Path(run)) for run in args.runs]
        if not output.parent.is_dir():
            raise PlotError(f"--output {output}: folder {output.parent} does not exist; create it first")
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    plot_runs(runs, output)
    print(f"wrote {output} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
