"""bench/cpu_layouts.py's rounds, with the launcher and the load probe faked (no torchrun): every
layout launched once a round, in an order that moves from round to round; the table's figure the
median over rounds; the count within 20%; a launch behind a slow probe retried once; --json and
--compare end to end."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import cpu_layouts  # noqa: E402

NAMES = ["a", "b", "c", "d", "e"]


def _fake_launch(medians: dict, calls: list):
    """launch(name, ranks, argv) -> steps whose median is medians[name][its launch count so far]."""

    def launch(name, ranks, argv):
        count = sum(1 for called in calls if called == name)
        calls.append(name)
        ms = medians[name][count] if name in medians else 100.0
        return {"steps_ms": [ms - 1, ms, ms + 50], "wall_s": 1.0}

    return launch


def _rounds(names=NAMES, repeats=3, medians=None, probes=None, retry_over=0.25):
    calls = []
    probe_values = iter(probes or [])
    records = cpu_layouts.run_rounds(
        [(n, 2, ["--flag", n]) for n in names],
        repeats,
        _fake_launch(medians or {}, calls),
        lambda: next(probe_values, 10.0),
        10.0,
        retry_over,
        log=lambda line: None,
    )
    return records, calls


@pytest.mark.parametrize("count", [2, 4, 5, 17])
def test_every_round_launches_every_layout_once_and_the_neighbours_change(count):
    """Planted: the same order every round (a rotation of it too: [names[(r + i) % n]]) leaves a
    layout always after the same neighbour and fails the second assertion."""
    names = [f"l{i}" for i in range(count)]
    orders = cpu_layouts.round_orders(names, 3)
    assert len(orders) == 3 and all(sorted(order) == sorted(names) for order in orders)
    for name in names:
        before = {order[order.index(name) - 1] if order.index(name) else None for order in orders}
        assert len(before) > 1, (name, orders)


def test_rounds_interleave_the_layouts():
    """Round r's launches all come before round r + 1's. Planted: the layouts outermost (each
    layout's repeats back to back) fails."""
    records, calls = _rounds()
    assert len(calls) == 15
    for r in range(3):
        assert sorted(calls[5 * r : 5 * r + 5]) == NAMES
        assert {rec["round"] for rec in records[5 * r : 5 * r + 5]} == {r}
    assert calls[:5] != calls[5:10]


def test_the_table_shows_the_median_over_rounds_and_their_spread():
    """The per-launch figure is its steps' median (99, 100, 150 -> 100), the layout's the median of
    its launches. Planted: the mean over rounds (170 for b) fails; each launch's mean step fails."""
    records, _ = _rounds(medians={"b": [100.0, 300.0, 110.0]})
    rows = cpu_layouts.per_layout(records)
    assert rows["b"]["measured"] == 110.0 and (rows["b"]["low"], rows["b"]["high"]) == (100.0, 300.0)
    assert rows["a"]["measured"] == 100.0 and rows["a"]["medians"] == [100.0] * 3
    row = dict(rows["b"], name="b", ranks=2, flags=["--x"], predicted=99.0)
    assert "| b | 2 | `--x` | 110.0 | 100.0-300.0 | 99.0 | 0.90 |" in cpu_layouts.table([row], "c", 3, 0.25)


def test_the_count_within_20_percent():
    """0.8 and 1.2 are in, 0.79 and 1.21 out, a layout without a prediction not counted. Planted:
    only the upper bound checked (0.79 counted) fails."""
    rows = [dict(measured=100.0, predicted=p) for p in (80.0, 120.0, 79.0, 121.0, 100.0, 95.0)] + [
        dict(measured=100.0, predicted=None)
    ]
    found = cpu_layouts.summary(rows)
    assert (found["within"], found["predicted"], found["layouts"]) == (4, 6, 7)
    assert found["median_ratio"] == pytest.approx(0.975)
    assert cpu_layouts.summary_line(found).startswith("4 of 6 layouts predicted within 20%")


def test_a_launch_behind_a_slow_probe_is_retried_once_and_the_quieter_kept():
    """The calibration read 10 us/op: a probe of 13 (30% slower) retries, the retry's probe 10.5
    keeps the retry; 12 (20%) does not retry; a retry slower than its first try keeps the first.
    Planted: the retry rule off (no second try) or keeping the last try always fails."""
    # round 0: a 10, b 13 -> retry 10.5, c 12, d 10, e 10; round 1 (stride -1: b a e d c): b 15 -> retry 16
    probes = [10.0, 13.0, 10.5, 12.0, 10.0, 10.0, 15.0, 16.0]
    records, calls = _rounds(probes=probes, medians={"b": [400.0, 100.0, 120.0, 999.0, 110.0]})
    assert calls.count("b") == 5 and calls.count("c") == 3
    tries = [(rec["round"], rec["probe_us"], rec["retry"], rec["kept"]) for rec in records if rec["name"] == "b"]
    assert tries == [(0, 13.0, False, False), (0, 10.5, True, True), (1, 15.0, False, True), (1, 16.0, True, False)] + [
        (2, 10.0, False, True)
    ]
    rows = cpu_layouts.per_layout(records)
    assert rows["b"]["medians"] == [100.0, 120.0, 110.0] and rows["b"]["retries"] == 2
    _, calls = _rounds(probes=probes, retry_over=0.7)
    assert len(calls) == 15


def test_json_and_compare_end_to_end(tmp_path, monkeypatch):
    """main with the launcher, the probe and the timeline faked, on the committed calibration: the
    JSON holds every launch and each layout's row; --compare reads two of them. Planted: the
    fastest launch's column taking the slowest (2.00) fails."""
    import calibrate_cpu
    import cpu_grid

    medians = {"dp2-zero0": [50.0, 60.0, 55.0], "tp2": [200.0, 210.0, 190.0]}
    calls = []
    fake = _fake_launch(medians, calls)
    monkeypatch.setattr(cpu_layouts, "launch_layout", lambda ranks, argv, folder: fake(argv[-1], ranks, argv))
    monkeypatch.setattr(calibrate_cpu, "step_op_us", lambda: (4.0, 287))
    monkeypatch.setattr(cpu_layouts, "predictor", lambda: lambda argv, device, world: {"step_ms": 55.0})
    monkeypatch.setattr(cpu_layouts, "layout_argv", lambda extra, steps: [*extra, extra[-1]])
    monkeypatch.setattr(
        cpu_layouts, "LAYOUTS", [("dp2-zero0", 2, ["dp2-zero0"]), ("tp2", 2, ["tp2"]), ("cp2", 2, ["cp2"])]
    )
    monkeypatch.setattr(cpu_grid, "LAYOUTS", cpu_layouts.LAYOUTS)
    common = ["--skip-calibration", "--calibration", str(calibrate_cpu.DEFAULT_OUTPUT), "--only", "dp2-zero0,tp2"]
    assert cpu_layouts.main([*common, "--json", str(tmp_path / "a.json")]) == 0
    doc = json.loads((tmp_path / "a.json").read_text())
    assert len(doc["launches"]) == 6 and doc["repeats"] == 3 and doc["reference_probe_us"] == 4.0
    assert [(r["name"], r["measured"]) for r in doc["layouts"]] == [("dp2-zero0", 55.0), ("tp2", 200.0)]
    assert doc["summary"]["within"] == 1
    slowest = {n: max(r["median_ms"] for r in doc["launches"] if r["name"] == n) for n in ("dp2-zero0", "tp2")}
    # B's launches 10% faster but each layout's slowest twice as slow: the fastest launch's B / A is 0.90
    faster = [
        dict(rec, median_ms=rec["median_ms"] * (2.0 if rec["median_ms"] == slowest[rec["name"]] else 0.9))
        for rec in doc["launches"]
    ]
    b = dict(doc, layouts=[dict(doc["layouts"][0], measured=60.5), doc["layouts"][1]], launches=faster)
    (tmp_path / "b.json").write_text(json.dumps(b))
    text = cpu_layouts.compare(doc, b)
    assert "| dp2-zero0 | 55.0 | 60.5 | 1.10 | 0.90 | 1.00 | 0.91 |" in text and "largest gap B / A 1.10 (10%)" in text
    assert "| tp2 | 200.0 | 200.0 | 1.00 | 0.90 |" in text
    with pytest.raises(SystemExit):
        cpu_layouts.parse_args(["--compare", str(tmp_path / "a.json"), str(tmp_path / "missing.json")])


def test_the_probes_reference_is_the_calibrations_unless_skipped():
    """The calibration file's tiny_step_op_us when this run calibrated; three probes' median when it
    did not (--skip-calibration: another run's file) or the file lacks it: the least of three
    probes (load only slows one). Planted: their median (7.0) fails."""
    probes = iter([9.0, 5.0, 7.0])
    assert cpu_layouts.reference_probe_us("[cpu]\ntiny_step_op_us = 4.16\n", lambda: 1.0)[0] == 4.16
    assert cpu_layouts.reference_probe_us(None, lambda: next(probes))[0] == 5.0
    assert cpu_layouts.reference_probe_us("[cpu]\nlaunch_us = 3.0\n", lambda: 2.0)[0] == 2.0
