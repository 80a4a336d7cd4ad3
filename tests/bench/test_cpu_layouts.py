"""bench/cpu_layouts.py: its layouts are the grid the issue names and each one's flags pass
megazero's checks at its number of ranks (no process starts); the steady-state step time read
from metrics.jsonl; the shapes of the timeline's answer it reads a step time from."""

import json
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import cpu_layouts  # noqa: E402

from megazero.config.train_flags import config_from_args, parse_args  # noqa: E402


def test_the_layouts_cover_the_grid_and_their_flags_pass_the_checks():
    """Planted: 3 attention heads in MODEL (hidden 64 not divisible) fails here, before any launch would."""
    names = [name for name, _, _ in cpu_layouts.LAYOUTS]
    assert len(names) == len(set(names)) >= 12
    seen = set()
    for name, ranks, extra in cpu_layouts.LAYOUTS:
        cfg = config_from_args(parse_args(cpu_layouts.layout_argv(extra, 8)), ranks, ranks, cuda_available=False)
        p = cfg.parallel
        seen |= {
            f"tp{p.tensor_parallel}",
            f"pp{p.pipeline_parallel}",
            f"cp{p.context_parallel}",
            f"ep{p.expert_parallel}",
            f"zero{cfg.zero.stage}",
        }
        seen |= {"sp"} if p.sequence_parallel else set()
        seen |= {"interleaved"} if p.virtual_stages > 1 else set()
        seen |= {"offload"} if cfg.zero.offload_optimizer is not None and cfg.zero.offload_param is not None else set()
    assert seen >= {"tp2", "pp2", "cp2", "ep2", "sp", "interleaved", "offload", "zero0", "zero1", "zero2", "zero3"}, (
        seen
    )


def test_steady_step_is_the_median_after_the_first_two(tmp_path):
    records = [
        {"iteration": i, "split": "train", "ms_per_iter": ms}
        for i, ms in enumerate([900.0, 400.0, 110.0, 130.0, 120.0, 500.0, 115.0], start=1)
    ]
    records.insert(3, {"iteration": 3, "split": "valid", "loss": 1.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cpu_layouts.steady_step_ms(tmp_path / "metrics.jsonl") == 120.0
    with pytest.raises(ValueError, match="no training iteration"):
        cpu_layouts.steady_step_ms(tmp_path / "metrics.jsonl", skip=7)


def test_a_step_time_is_read_from_the_timelines_answer():
    assert cpu_layouts._step_ms(12.5) == 12.5
    assert cpu_layouts._step_ms({"step_s": 0.25}) == 250.0
    assert cpu_layouts._step_ms(types.SimpleNamespace(step_ms=3.0)) == 3.0
    assert cpu_layouts._step_ms({"ranks": {0: {"step_ms": 4.0}, 1: {"step_ms": 6.0}}}) == 6.0
    with pytest.raises(TypeError, match="without a step time"):
        cpu_layouts._step_ms({"mfu": 0.4})


def test_predict_is_told_the_world_as_it_takes_it():
    seen = []

    def with_world(argv, device, world, ranks=None):
        seen.append((argv[:1], device, world))
        return {"step_s": 0.5}

    def flag_only(argv, device):
        seen.append((argv[:2], device))
        return 7.0

    assert cpu_layouts.predicted_ms(with_world, 4, ["--zero-stage"]) == 500.0
    assert cpu_layouts.predicted_ms(flag_only, 2, ["--zero-stage"]) == 7.0
    assert seen == [(["--zero-stage"], "cpu", 4), (["--world-size", "2"], "cpu")]


def test_the_table_names_the_calibration_it_ran_with():
    import calibrate_cpu
    from tests.bench.test_calibrate_cpu import _measurement

    header = cpu_layouts.calibration_header(calibrate_cpu.render(_measurement()))
    assert header == "2026-12-07 15:00 UTC, a CPU (2 cores), load average 1.0 before / 2.0 after it"


def test_the_table_has_a_row_per_layout_and_the_ratio_where_predicted():
    rows = [
        dict(
            name="tp2",
            ranks=2,
            flags=["--tensor-model-parallel-size", "2"],
            measured=200.0,
            low=190.0,
            high=230.0,
            loads=[3.0, 3.4],
            probes_us=[20.0, 21.5],
            retries=1,
            predicted=180.0,
        ),
        dict(
            name="cp2",
            ranks=2,
            flags=["--context-parallel-size", "2"],
            measured=100.0,
            low=100.0,
            high=100.0,
            loads=[3.5],
            probes_us=[21.0],
            retries=0,
        ),
    ]
    lines = cpu_layouts.table(rows, "a calibration", repeats=2, retry_over=0.25).splitlines()
    assert "launched 2 times" in lines[0] and "over 25% above" in lines[0]
    assert lines[-2] == (
        "| tp2 | 2 | `--tensor-model-parallel-size 2` | 200.0 | 190.0-230.0 | 180.0 | 0.90 | 3.0-3.4 | 20.00-21.50 | 1 |"
    )
    assert lines[-1] == "| cp2 | 2 | `--context-parallel-size 2` | 100.0 | 100.0 | - | - | 3.5 | 21.00 | 0 |"
