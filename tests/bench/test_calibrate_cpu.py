"""bench/calibrate_cpu.py: the alpha-beta fit recovers a made-up line (exactly, through noise that
an unweighted fit lets the large messages turn into a wrong latency, and through one size timed
wrong, as the quiet 2-rank all_reduce's 256 KiB was; the committed file's alpha and beta are that
fit of its own times), the ring formulas' bytes
on the wire, the collective sweep on two pool ranks and over groups of 2 inside 4, the groups' entries and all_to_all in the schema
the timeline reads (and files before them still read), and the committed measured file in it
(megazero/dry_run/cpu_measured.toml)."""

import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import calibrate_cpu  # noqa: E402

SIZES = [1024 * 4**i for i in range(8)]


def _line(op, n, alpha_us, beta_gbps, noise=()):
    wire = [calibrate_cpu.wire_bytes(op, n, s) for s in SIZES]
    times = [alpha_us * 1e-6 + w / (beta_gbps * 1e9) for w in wire]
    return wire, [t * (1 + (noise[i % len(noise)] if noise else 0)) for i, t in enumerate(times)]


@pytest.mark.parametrize("op,n", [("all_reduce", 2), ("all_gather", 4), ("reduce_scatter", 8), ("send_recv", 2)])
def test_fit_recovers_a_made_up_line(op, n):
    wire, times = _line(op, n, alpha_us=85.0, beta_gbps=1.7)
    alpha, beta = calibrate_cpu.fit_alpha_beta(wire, times)
    assert alpha == pytest.approx(85.0, rel=1e-9) and beta == pytest.approx(1.7, rel=1e-9)


def test_fit_keeps_the_latency_through_noise_on_large_messages():
    """+-3% on every point: the fit keeps alpha within 10% where a plain least-squares fit is
    ruled by the 16 MiB point's 3% (~0.7 ms, 15x alpha). Planted: the weights dropped (plain least
    squares) returns alpha 78 us, and fails here."""
    wire, times = _line("all_reduce", 4, alpha_us=50.0, beta_gbps=1.0, noise=(0.03, -0.03, 0.02, -0.02))
    alpha, beta = calibrate_cpu.fit_alpha_beta(wire, times)
    assert alpha == pytest.approx(50.0, rel=0.1) and beta == pytest.approx(1.0, rel=0.05)


def test_fit_keeps_the_latency_through_one_size_timed_wrong():
    """The committed quiet calibration's 2-rank all_reduce read 465 us at 256 KiB between ~1.2 ms at
    the small sizes and 1.7 ms at 1 MiB; a least-squares line bent to it and said alpha 654 us, and
    every small all-reduce of a tp2 step came out 0.5 ms short. Here: a 1.2 ms / 2 GB/s line, the
    256 KiB point at 0.4x and the 16 MiB point at 1.25x. Planted: the relative least-squares fit
    (the one before) returns alpha 758 us and beta 1.71 GB/s, and fails here."""
    wire, times = _line("all_reduce", 2, alpha_us=1200.0, beta_gbps=2.0)
    times[4] *= 0.4
    times[7] *= 1.25
    alpha, beta = calibrate_cpu.fit_alpha_beta(wire, times)
    assert alpha == pytest.approx(1200.0, rel=0.1) and beta == pytest.approx(2.0, rel=0.1)


def test_fit_refuses_what_is_no_line():
    with pytest.raises(ValueError, match="at least 2"):
        calibrate_cpu.fit_alpha_beta([1.0], [1.0])
    with pytest.raises(ValueError, match="do not grow"):
        calibrate_cpu.fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3])


def test_wire_bytes_follow_the_ring_algorithm():
    """Planted: all_reduce at (n-1)/n B (a reduce-scatter's) fails the first line."""
    assert calibrate_cpu.wire_bytes("all_reduce", 4, 1000) == 1500
    assert calibrate_cpu.wire_bytes("all_gather", 8, 1000) == 875
    assert calibrate_cpu.wire_bytes("reduce_scatter", 2, 1000) == 500
    assert calibrate_cpu.wire_bytes("send_recv", 8, 1000) == 1000


def test_sweep_times_every_op_on_two_pool_ranks(dist_pool):
    found = dist_pool(2).run(calibrate_cpu.sweep_collectives, [1024, 65536], 1, 0.001, 50.0)
    assert found[0] == found[1]  # the slowest rank's, agreed
    assert set(found[0]) == set(calibrate_cpu.OPS)
    assert all(len(times) == 2 and min(times) > 0 for times in found[0].values()), found[0]


def test_sweep_times_groups_of_two_inside_four_ranks(dist_pool):
    """Two groups of 2 among 4 pool ranks, both at once, every group op including all_to_all (the
    ranks' own agreed figure; its size is the machine's: not asserted)."""
    assert calibrate_cpu.groups_of(8) == [2, 4, 8] and calibrate_cpu.groups_of(2) == [2]
    found = dist_pool(4).run(calibrate_cpu.sweep_collectives, [4096], 1, 0.001, 0.0, 2, calibrate_cpu.GROUP_OPS)
    assert all(f == found[0] for f in found)
    assert set(found[0]) == set(calibrate_cpu.GROUP_OPS) and all(t[0] > 0 for t in found[0].values()), found[0]


def _measurement():
    table = {
        "ranks": [2, 4, 8],
        "alpha_us": [10.0, 20.0, 40.0],
        "beta_gbps": [1.0, 0.5, 0.25],
        "measured_us": [[1.0, 2.0]] * 3,
    }
    return dict(
        date="2026-12-07 15:00 UTC",
        name="a CPU (2 cores)",
        memory_gb=25.3,
        cores=2,
        load=(1.0, 2.0),
        launch_us=16.0,
        bare_op_us=3.0,
        step_ops=287,
        memory_gbps=10.0,
        memory_detail={"copy 64 MiB": 9.0},
        matmul=[[64, 64, 64, 30.0]],
        matmul_calls=[[64, 64, 64, 20.0]],
        sizes=[1024, 4096],
        collectives={op: dict(table) for op in calibrate_cpu.OPS},
    )


def test_render_parses_in_the_schema_and_the_schema_refuses_a_gap():
    doc = tomllib.loads(calibrate_cpu.render(_measurement()))
    calibrate_cpu.check_schema(doc)
    assert doc["cpu"]["collectives"]["send_recv"]["beta_gbps"] == [1.0, 0.5, 0.25]
    del doc["cpu"]["collectives"]["all_gather"]["beta_gbps"]
    with pytest.raises(ValueError, match="all_gather"):
        calibrate_cpu.check_schema(doc)
    doc = tomllib.loads(calibrate_cpu.render(_measurement()))
    doc["cpu"]["matmul"].append([64, 64, 64])
    with pytest.raises(ValueError, match="matmul row"):
        calibrate_cpu.check_schema(doc)


def _grouped(m: dict) -> dict:
    """A measurement with all_to_all and groups of 2 in 4 and 8 ranks, 2 and 4 in 8."""
    groups = dict(
        group_ranks=[2, 2, 4],
        host_ranks=[4, 8, 8],
        group_alpha_us=[30.0, 60.0, 80.0],
        group_beta_gbps=[0.8, 0.4, 0.3],
        group_measured_us=[[1.0]] * 3,
    )
    table = m["collectives"]["all_reduce"]
    collectives = {op: dict(table, **groups) for op in calibrate_cpu.GROUP_OPS}
    collectives["send_recv"] = dict(table)
    return dict(m, collectives=collectives, group_sizes=[1024])


def test_groups_render_in_the_schema_the_device_model_reads(tmp_path):
    """The groups' entries and all_to_all written, parsed, and read by devices.cpu: a 2-rank
    all-reduce of a job with 4 ranks on the host costs the 4-rank host's figure. Planted: the
    device's group-size-only lookup gives the 2-ranks-alone 10 us and fails."""
    from megazero.dry_run import devices

    text = calibrate_cpu.render(_grouped(_measurement()))
    doc = tomllib.loads(text)
    calibrate_cpu.check_schema(doc)
    assert doc["cpu"]["collectives"]["all_to_all"]["host_ranks"] == [4, 8, 8]
    path = tmp_path / "cpu.toml"
    path.write_text(text)
    cpu = devices.cpu(path)
    cpu.ranks_on_host = 4
    assert cpu.collective_seconds("all_reduce", 1e3, (0, 1)) == pytest.approx(30e-6 + 1e3 / 0.8e9)
    cpu.ranks_on_host = 2
    assert cpu.collective_seconds("all_reduce", 1e3, (0, 1)) == pytest.approx(10e-6 + 1e3 / 1e9)
    doc["cpu"]["collectives"]["all_gather"]["host_ranks"] = [4, 8]
    with pytest.raises(ValueError, match=r"all_gather.*one entry per group measured"):
        calibrate_cpu.check_schema(doc)
    doc = tomllib.loads(text)
    doc["cpu"]["collectives"]["all_gather"]["group_ranks"] = [2, 8, 4]
    with pytest.raises(ValueError, match="below its host_ranks"):
        calibrate_cpu.check_schema(doc)


def test_a_file_before_groups_and_all_to_all_still_loads():
    """The schema before the groups (no all_to_all table, no group entries: _measurement's render, and
    the committed file while it predates them) passes check_schema and loads in the device model."""
    from megazero.dry_run import devices

    old = tomllib.loads(calibrate_cpu.render(_measurement()))
    assert "all_to_all" not in old["cpu"]["collectives"] and "group_ranks" not in str(old)
    calibrate_cpu.check_schema(old)
    committed = devices.cpu(calibrate_cpu.DEFAULT_OUTPUT)
    committed.ranks_on_host = 4
    assert committed.collective_seconds("all_to_all", 1e3, (0, 1)) > 0


def test_the_committed_measurement_is_in_the_schema_and_covers_the_layouts_gemms():
    text = calibrate_cpu.DEFAULT_OUTPUT.read_text()
    doc = tomllib.loads(text)
    calibrate_cpu.check_schema(doc)
    cpu = doc["cpu"]
    assert all(cpu["collectives"][op]["ranks"] == [2, 4, 8] for op in calibrate_cpu.OPS)
    assert {tuple(row[:3]) for row in cpu["matmul"]} >= set(calibrate_cpu.gemm_shapes())
    assert "load average" in text.split("[cpu]")[0] and cpu["cores"] >= 1


def test_the_committed_latencies_are_the_fit_of_the_committed_times():
    """alpha_us and beta_gbps are fit_alpha_beta's over the file's own measured_us (the timeline reads
    only alpha and beta). Planted: the file's earlier least-squares 2-rank all_reduce alpha, 654 us
    (1,176 by the medians), fails it."""
    for op, table in tomllib.loads(calibrate_cpu.DEFAULT_OUTPUT.read_text())["cpu"]["collectives"].items():
        for n, row, alpha, beta in zip(table["ranks"], table["measured_us"], table["alpha_us"], table["beta_gbps"]):
            wire = [calibrate_cpu.wire_bytes(op, n, size) for size in table["sizes_bytes"]]
            fitted = calibrate_cpu.fit_alpha_beta(wire, [t * 1e-6 for t in row])
            assert (alpha, beta) == pytest.approx(fitted, rel=1e-3), (op, n)


def test_the_one_rank_fit_is_written_and_read_back_by_the_layouts_bench():
    """render() with a one-rank step's fit: launch_us is the fitted figure, the tiny GPT's kept as
    tiny_step_op_us, and cpu_layouts' table header names the fit. Planted: render writing the tiny
    figure as launch_us fails the first assertion."""
    import cpu_layouts

    m = dict(
        _measurement(),
        tiny_launch_us=16.0,
        launch_us=23.5,
        one_rank_ms=81.2,
        one_rank_work_ms=39.8,
        one_rank_ops=1763,
        shared={"ranks": [1, 2], "slowdown": [1.0, 1.4]},
    )
    text = calibrate_cpu.render(m)
    doc = tomllib.loads(text)
    calibrate_cpu.check_schema(doc)
    assert doc["cpu"]["launch_us"] == 23.5 and doc["cpu"]["tiny_step_op_us"] == 16.0
    assert doc["cpu"]["shared_ranks"] == [1, 2] and doc["cpu"]["shared_slowdown"] == [1.0, 1.4]
    assert cpu_layouts.calibration_header(text).endswith(
        "launch_us 23.50 fitted on the one-rank step (81.2 ms measured, 39.8 ms the device's work, 1763 ops)"
    )


def test_the_sharing_slowdown_runs_on_pool_ranks(dist_pool):
    """calibrate_cpu_step.sharing_slowdown: one process's GEMM rate over two pool ranks' at once, a
    positive ratio (its size is the machine's: not asserted)."""
    import calibrate_cpu_step

    assert calibrate_cpu_step.sharing_slowdown(dist_pool(2), calibrate_cpu_step.gemm_rate, rounds=1, seconds=0.05) > 0


def test_a_group_sweep_with_no_slope_takes_the_worlds_bandwidth():
    """Four sizes at 8 loaded ranks can read flat (no bandwidth to fit); a group's entry then takes
    the whole world's beta and fits alpha on it (the median of the times less their wire time),
    where the world's own sweep still refuses. Planted: the fallback removed (the calibration of
    21:36 died so at 8 ranks, load 7.8) fails the first call."""
    import statistics

    from calibrate_cpu_comm import _fitted

    sizes = [1024, 16384, 262144, 4194304]
    flat = [3e-3, 2e-3, 3e-3, 2e-3]
    alpha, beta, _ = _fitted("all_reduce", 2, sizes, flat, world_beta=2.0)
    wire = [calibrate_cpu.wire_bytes("all_reduce", 2, s) for s in sizes]
    assert beta == 2.0
    assert alpha == pytest.approx(statistics.median(t - w / 2e9 for w, t in zip(wire, flat)) * 1e6, abs=0.01)
    with pytest.raises(ValueError, match="do not grow"):
        _fitted("all_reduce", 2, sizes, flat)
