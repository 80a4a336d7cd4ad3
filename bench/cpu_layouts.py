"""The CPU grid's layouts: each launched with torchrun, its steady-state step time measured, beside
the dry run's predicted step time when the timeline is there (docs/dry_run.md, "Calibrating a machine").

    python bench/cpu_layouts.py                        # calibration + 17 layouts: ~6 min on 2 quiet cores
    python bench/cpu_layouts.py --only dp2-zero1,tp2 --skip-calibration

It runs bench/calibrate_cpu.py first, in the same run (a loaded machine then loads the device
model and the layouts alike), writing megazero/dry_run/cpu_measured.toml unless --calibration says
elsewhere; its launch_us is fitted on this model's one-rank step (not one of LAYOUTS: no layout
reported here is fitted), and every prediction uses that file. Then every layout of LAYOUTS: the small GPT the tests use (4 layers, hidden 64, 4 heads,
sequence 64, vocabulary 8192, micro batch 1, global batch 8, fp32, no dropout), `--train-iters` steps
(default 8), one torch thread per rank (torchrun's OMP_NUM_THREADS=1). Measured: the median of the
`ms_per_iter` rank 0 logs to metrics.jsonl over the steps after the first two (the first builds
buffers and the stage-3 trace). Predicted, when `megazero.dry_run.timeline` (or `.speed`) has
`predict`: `predict(argv, "cpu", world=N)` (or `predict(["--world-size", N, *argv], "cpu")`), its step
time beside the measured one and their ratio, and a markdown table (--table). Without it, the measured column and one line saying so. Beside each
layout: the load average as it ended, and the host's cost per op measured just before it
(calibrate_cpu.step_op_us, the calibration's launch_us): how far the machine's load had moved since
the calibration.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

from cpu_grid import LAYOUTS, MODEL, REPO, layout_argv, measure_layout, steady_step_ms  # noqa: F401


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


def table(rows: list[dict], calibration: str) -> str:
    lines = [
        f"Measured with {calibration}.",
        "",
        "| layout | ranks | flags | measured ms/step | predicted ms/step | predicted / measured | load | host us/op |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pred = f"{r['predicted']:.1f}" if r.get("predicted") is not None else "-"
        ratio = f"{r['predicted'] / r['measured']:.2f}" if r.get("predicted") is not None else "-"
        lines.append(
            f"| {r['name']} | {r['ranks']} | `{' '.join(r['flags'])}` | {r['measured']:.1f} | {pred} | {ratio} | {r['load']:.1f} | {r['host_us']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    p.add_argument("--steps", type=int, default=8, help="training steps per layout (the first two are not timed)")
    p.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="where the calibration writes (default megazero/dry_run/cpu_measured.toml)",
    )
    p.add_argument("--skip-calibration", action="store_true", help="use the calibration file as it is")
    p.add_argument("--table", type=Path, default=None, help="write the markdown table here too")
    args = p.parse_args(argv)
    names = [name for name, _, _ in LAYOUTS]
    unknown = [n for n in args.only.split(",") if n and n not in names]
    if unknown:
        p.error(f"--only {','.join(unknown)}: not a layout; the layouts are {', '.join(names)}")
    if args.steps < 3:
        p.error(f"--steps {args.steps}: at least 3 (the first two are not timed)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO / "bench"))
    calibrate_cpu = importlib.import_module("calibrate_cpu")
    from megazero.dry_run import devices

    calibration = args.calibration or calibrate_cpu.DEFAULT_OUTPUT
    torch.set_num_threads(1)  # as the ranks run (and the calibration measures)
    if not args.skip_calibration:
        calibrate_cpu.main(["--output", str(calibration)])
    header = calibration_header(calibration.read_text())
    predict = predictor()
    if predict is None:
        print("megazero.dry_run.timeline (its predict) is absent: measured step times only", flush=True)
    chosen = set(filter(None, args.only.split(",")))
    rows = []
    for name, ranks, extra in LAYOUTS:
        if chosen and name not in chosen:
            continue
        argv = layout_argv(extra, args.steps)
        host_us = calibrate_cpu.step_op_us()[0]  # the load now, as the calibration's launch_us saw it
        with tempfile.TemporaryDirectory(prefix=f"cpu_layout_{name}_") as folder:
            row = dict(
                name=name,
                ranks=ranks,
                flags=extra,
                measured=measure_layout(ranks, argv, Path(folder)),
                load=os.getloadavg()[0],
                host_us=host_us,
            )
        if predict is not None:
            row["predicted"] = predicted_ms(predict, ranks, argv, devices.cpu(calibration))
        rows.append(row)
        ratio = (
            f" | predicted {row['predicted']:.1f} ms | ratio {row['predicted'] / row['measured']:.2f}"
            if predict is not None
            else ""
        )
        print(
            f"{name:<20} {ranks} ranks | measured {row['measured']:.1f} ms/step{ratio} | load {row['load']:.1f}",
            flush=True,
        )
    text = table(rows, f"{calibration.name} calibrated in the same run ({header})")
    print(text)
    if args.table:
        args.table.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
