"""The CPU grid's layouts: each launched with torchrun several times, its steady-state step time
measured, beside the dry run's predicted step time (docs/dry_run.md, "Calibrating a machine" and
"How the bench measures").

    python bench/cpu_layouts.py --json run.json        # calibration + 17 layouts x 3 rounds
    python bench/cpu_layouts.py --only dp2-zero1,tp2 --skip-calibration --repeats 3
    python bench/cpu_layouts.py --compare a.json b.json   # two runs' measured steps side by side

It runs bench/calibrate_cpu.py first, in the same run, writing megazero/dry_run/cpu_measured.toml
unless --calibration says elsewhere; its launch_us is fitted on this model's one-rank step (not one
of LAYOUTS: no layout reported here is fitted), and every prediction uses that file. Each layout:
the small GPT the tests use (4 layers, hidden 64, 4 heads, sequence 64, vocabulary 8192, micro batch
1, global batch 8, fp32, no dropout), `--steps` steps a launch, one torch thread per rank. A launch's
figure is the median of the `ms_per_iter` rank 0 logs to metrics.jsonl after the first two steps;
`--repeats` rounds each launch every layout once, the order changing from round to round
(cpu_grid.round_orders), and a layout's measured step is the median over its rounds, the min-max
beside it. Before each launch a load probe (calibrate_cpu.step_op_us, the host's cost per op, as
the calibration measured it as it began, its tiny_step_op_us; with --skip-calibration the least
of three probes as the bench begins): a launch whose probe reads more than
`--retry-over` above the calibration's is launched again once, and the try with the smaller probe
kept. Predicted: `predict(argv, "cpu", world=N)` of megazero.dry_run.timeline (or `.speed`), its
ratio to the measured step, and a summary line: how many within 20%, the ratios' median.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import torch

# MODEL, measure_layout, round_orders and steady_step_ms re-exported: the tests read them from here
from cpu_grid import (  # noqa: F401
    LAYOUTS,
    MODEL,
    REPO,
    launch_layout,
    layout_argv,
    measure_layout,
    per_layout,
    round_orders,
    run_rounds,
    steady_step_ms,
)

BAR = 0.2  # the issue's: predicted within 20% of measured
STEPS = 16  # per launch: a launch's start (~5 s quiet, ~18 s at load 8) costs more than 16 steps of most layouts
RETRY_OVER = 0.3  # a probe this much above the calibration's: retried once (docs/dry_run.md, "How the bench measures")


def predictor():
    """The timeline's predict (megazero.dry_run.timeline's, else megazero.dry_run.speed's), or None."""
    for name in ("megazero.dry_run.timeline", "megazero.dry_run.speed"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "predict"):
            return module.predict
    return None


def predicted_ms(predict, ranks: int, argv: list[str], device="cpu") -> float:
    """predict's step time (ms) for the layout on `ranks` ranks on `device` (the calibration just
    written, as a devices.Device): the world as its `world` argument when it takes one, else as
    tools/dry_run.py's --world-size flag."""
    if "world" in inspect.signature(predict).parameters:
        return _step_ms(predict(argv, device, world=ranks))
    return _step_ms(predict(["--world-size", str(ranks), *argv], device))


def _step_ms(result) -> float:
    """The step time (ms) in predict's answer: a number of ms, or a mapping / object with step_ms
    (step_time_ms, step_s, step_time_s), or else the slowest of its per-rank entries ("ranks")."""
    if isinstance(result, (int, float)):
        return float(result)
    get = result.get if isinstance(result, dict) else (lambda key, default=None: getattr(result, key, default))
    for key, scale in (("step_ms", 1.0), ("step_time_ms", 1.0), ("step_s", 1e3), ("step_time_s", 1e3)):
        if get(key) is not None:
            return float(get(key)) * scale
    ranks = get("ranks")
    if ranks:
        entries = ranks.values() if isinstance(ranks, dict) else ranks
        return max(_step_ms(entry) for entry in entries)
    raise TypeError(f"predict returned {type(result).__name__} without a step time (step_ms, step_s or ranks)")


def calibration_header(text: str) -> str:
    """'<date>, <machine>, load <before> / <after>' from calibrate_cpu.py's header comment."""
    found = re.search(r"calibrate_cpu\.py on (.+?) on (.+?),\n", text)
    load = re.search(r"load average ([\d.]+) before, ([\d.]+) after", text)
    if not found or not load:
        return "a calibration without calibrate_cpu.py's header"
    step = re.search(r"measured ([\d.]+) ms, the device model's work ([\d.]+) ms, (\d+) ops", text)
    launch = re.search(r"^launch_us = ([\d.]+)", text, re.M)
    fitted = (
        (
            f"; launch_us {launch[1]} fitted on the one-rank step ({step[1]} ms measured, {step[2]} ms "
            f"the device's work, {step[3]} ops)"
        )
        if step and launch
        else ""
    )
    return f"{found[1]}, {found[2]}, load average {load[1]} before / {load[2]} after it{fitted}"


def _span(values, fmt="{:.1f}") -> str:
    low, high = min(values), max(values)
    return fmt.format(low) if fmt.format(low) == fmt.format(high) else f"{fmt.format(low)}-{fmt.format(high)}"


def summary(rows: list[dict], bar: float = BAR) -> dict:
    """How many predicted layouts are within `bar` of their measured step (|predicted / measured - 1|
    <= bar), of how many predicted, and the ratios' median (None without predictions)."""
    ratios = [r["predicted"] / r["measured"] for r in rows if r.get("predicted") is not None]
    return dict(
        within=sum(abs(x - 1) <= bar for x in ratios),
        predicted=len(ratios),
        layouts=len(rows),
        bar=bar,
        median_ratio=statistics.median(ratios) if ratios else None,
    )


def summary_line(s: dict) -> str:
    if not s["predicted"]:
        return f"{s['layouts']} layouts measured, none predicted"
    return (
        f"{s['within']} of {s['predicted']} layouts predicted within {s['bar']:.0%} of their measured step; "
        f"predicted / measured median {s['median_ratio']:.2f}"
    )


def table(rows: list[dict], calibration: str, repeats: int = 1, retry_over: float | None = None) -> str:
    """The markdown table: per layout the median over rounds of each launch's steady median, their
    spread (min-max), the prediction and its ratio, the load averages and probes of the kept launches,
    and how many launches were retried for a slow probe."""
    retry = (
        f"; a launch whose probe read over {retry_over:.0%} above the calibration's was retried" if retry_over else ""
    )
    lines = [
        f"Measured with {calibration}. Each layout launched {repeats} times, in interleaved rounds{retry}.",
        "",
        "| layout | ranks | flags | measured ms/step (median of launches) | spread ms | predicted ms/step "
        "| predicted / measured | load | host us/op | retried |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pred = f"{r['predicted']:.1f}" if r.get("predicted") is not None else "-"
        ratio = f"{r['predicted'] / r['measured']:.2f}" if r.get("predicted") is not None else "-"
        lines.append(
            f"| {r['name']} | {r['ranks']} | `{' '.join(r['flags'])}` | {r['measured']:.1f} | "
            f"{_span([r['low'], r['high']])} | {pred} | {ratio} | {_span(r['loads'])} | "
            f"{_span(r['probes_us'], '{:.2f}')} | {r['retries']} |"
        )
    return "\n".join(lines) + "\n"


def _fastest(doc: dict, name: str) -> float | None:
    """The fastest kept launch of a layout in a --json output (load only slows a step), or None."""
    medians = [rec["median_ms"] for rec in doc.get("launches", []) if rec["name"] == name and rec["kept"]]
    return min(medians) if medians else None


def compare(a: dict, b: dict) -> str:
    """Two --json outputs side by side: per layout in both, measured A and B, B / A, the fastest
    launch's B / A, and each run's predicted / measured; then the largest |B / A - 1|."""
    lines = [
        f"A: {a.get('started', '?')} ({a.get('repeats', '?')} launches a layout); "
        f"B: {b.get('started', '?')} ({b.get('repeats', '?')})",
        "",
        "| layout | measured A ms | measured B ms | B / A | fastest launch B / A "
        "| predicted / measured A | predicted / measured B |",
        "|---|---|---|---|---|---|---|",
    ]
    rows_b = {r["name"]: r for r in b["layouts"]}
    gaps = []
    for ra in a["layouts"]:
        rb = rows_b.get(ra["name"])
        if rb is None:
            continue
        gaps.append(rb["measured"] / ra["measured"])
        fastest = [_fastest(doc, ra["name"]) for doc in (a, b)]
        fast = f"{fastest[1] / fastest[0]:.2f}" if None not in fastest else "-"
        ratios = [f"{r['predicted'] / r['measured']:.2f}" if r.get("predicted") is not None else "-" for r in (ra, rb)]
        lines.append(
            f"| {ra['name']} | {ra['measured']:.1f} | {rb['measured']:.1f} | {gaps[-1]:.2f} | {fast} "
            f"| {ratios[0]} | {ratios[1]} |"
        )
    if gaps:
        worst = max(gaps, key=lambda g: abs(g - 1))
        lines += ["", f"{len(gaps)} layouts in both; the largest gap B / A {worst:.2f} ({abs(worst - 1):.0%})"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    p.add_argument(
        "--steps", type=int, default=STEPS, help=f"training steps per launch, the first two not timed (default {STEPS})"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds: launches of each layout, interleaved (default 3)")
    p.add_argument(
        "--retry-over",
        type=float,
        default=RETRY_OVER,
        help=f"retry a launch once when its probe reads this fraction above the calibration's (default {RETRY_OVER})",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="where the calibration writes (default megazero/dry_run/cpu_measured.toml)",
    )
    p.add_argument("--skip-calibration", action="store_true", help="use the calibration file as it is")
    p.add_argument("--table", type=Path, default=None, help="write the markdown table here too")
    p.add_argument("--json", type=Path, default=None, help="write every launch's figures and the table's rows here")
    p.add_argument(
        "--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two --json outputs and exit (no launch)"
    )
    args = p.parse_args(argv)
    names = [name for name, _, _ in LAYOUTS]
    unknown = [n for n in args.only.split(",") if n and n not in names]
    if unknown:
        p.error(f"--only {','.join(unknown)}: not a layout; the layouts are {', '.join(names)}")
    if args.steps < 3:
        p.error(f"--steps {args.steps}: at least 3 (the first two are not timed)")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least 1")
    if args.retry_over < 0:
        p.error(f"--retry-over {args.retry_over}: a fraction >= 0 (0.25: retry at 25% slower)")
    for path in args.compare or ():
        if not path.is_file():
            p.error(f"--compare {path}: no such file; give two files written by --json")
    return args


def reference_probe_us(text: str | None, probe) -> tuple[float, str]:
    """The probe's figure at the calibration: the calibration file's tiny_step_op_us (the same
    step_op_us, measured as the calibration began), or with `text` None (--skip-calibration: the
    file is another run's, on a machine loaded otherwise) or a file without it, the least of three
    probes as this bench begins: load only slows a probe, and a burst of other jobs' work can cover
    one or two (at load 8-11 three probes read 14.9-47.4 us/op within seconds)."""
    value = tomllib.loads(text).get("cpu", {}).get("tiny_step_op_us") if text is not None else None
    if value:
        return float(value), "the calibration's"
    return min(probe() for _ in range(3)), "the least of three probes as the bench began"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        print(compare(*(json.loads(path.read_text()) for path in args.compare)), end="")
        return 0
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter()
    sys.path.insert(0, str(REPO / "bench"))
    calibrate_cpu = importlib.import_module("calibrate_cpu")
    from megazero.dry_run import devices

    calibration = args.calibration or calibrate_cpu.DEFAULT_OUTPUT
    torch.set_num_threads(1)  # as the ranks run (and the calibration measures)
    if not args.skip_calibration:
        calibrate_cpu.main(["--output", str(calibration)])
    text = calibration.read_text()
    header = calibration_header(text)

    def probe() -> float:
        return calibrate_cpu.step_op_us()[0]  # the host's cost per op now

    reference, reference_from = reference_probe_us(None if args.skip_calibration else text, probe)
    chosen = [layout for layout in LAYOUTS if not args.only or layout[0] in args.only.split(",")]
    layouts = [(name, ranks, layout_argv(extra, args.steps)) for name, ranks, extra in chosen]
    predict = predictor()
    if predict is None:
        print("megazero.dry_run.timeline (its predict) is absent: measured step times only", flush=True)
    device = devices.cpu(calibration)
    predicted = {n: predicted_ms(predict, k, a, device) if predict else None for n, k, a in layouts}

    def launch(name, ranks, argv):
        with tempfile.TemporaryDirectory(prefix=f"cpu_layout_{name}_") as folder:
            return launch_layout(ranks, argv, Path(folder))

    print(f"probe reference: {reference:.2f} us/op, {reference_from}", flush=True)
    records = run_rounds(layouts, args.repeats, launch, probe, reference, args.retry_over, log=_log)
    measured = per_layout(records)
    rows = [dict(name=n, ranks=k, flags=extra, predicted=predicted[n], **measured[n]) for n, k, extra in chosen]
    text = table(rows, f"{calibration.name} calibrated in the same run ({header})", args.repeats, args.retry_over)
    found = summary(rows)
    wall = time.perf_counter() - t0
    print(text + "\n" + summary_line(found) + f"; the bench took {wall / 60:.1f} min", flush=True)
    if args.table:
        args.table.write_text(text + "\n" + summary_line(found) + "\n")
    if args.json:
        doc = dict(
            started=started,
            wall_s=wall,
            calibration=header,
            reference_probe_us=reference,
            steps=args.steps,
            repeats=args.repeats,
            retry_over=args.retry_over,
            summary=found,
            layouts=rows,
            launches=records,
        )
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _log(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
