"""bench/gpu_check.sh and its Python half, bench/gpu_check.py, as far as a CPU can check them: the
script's exit on a machine without a GPU (one line, within 5 s), the summary that judges the steps'
figures (a failed step, a figure out of bounds, a NaN, a missing step each fail it, by name), the
junit report's skip accounting, the profiler-trace overlap count, bench_gpu_step's comparisons, and
the gloo probe and two-rank layouts of the gloo-cuda step, run here on CPU tensors."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import bench_adam_norm  # noqa: E402
import bench_gpu_step  # noqa: E402
import gpu_check  # noqa: E402


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_a_gpu_the_script_exits_1_in_one_line_within_5_seconds(tmp_path):
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, GPU_CHECK_OUT=str(tmp_path / "out")),
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 1 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and "no usable NVIDIA GPU" in proc.stderr
    assert elapsed < 5, elapsed
    assert not (tmp_path / "out").exists(), "nothing is written before the GPU check"


def test_prepare_downloads_the_wheels_the_gpu_image_lacks(tmp_path):
    """`bash bench/gpu_check.sh --prepare`: CPython 3.12 x86-64 wheels of pydantic (its compiled core
    included), pytest and a setuptools that builds the package, in one folder, and the line saying to
    carry it. (Planted: with manylinux_2_28 as the only Linux tag pip finds no pydantic-core: exit 1.)"""
    wheels = tmp_path / "wheels"
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--prepare"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, GPU_CHECK_WHEELS=str(wheels)),
    )
    offline = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable")
    if proc.returncode != 0 and any(word in proc.stderr for word in offline):
        pytest.skip(f"pip reaches no package index here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in wheels.iterdir())
    for wanted in ("pydantic-2", "pytest-", "setuptools-", "pluggy-", "annotated_types-"):
        assert any(n.startswith(wanted) for n in names), (wanted, names)
    core = [n for n in names if n.startswith("pydantic_core-")]
    assert len(core) == 1 and "-cp312-cp312-" in core[0] and "x86_64" in core[0], names
    assert f"carry: {wheels}" in proc.stdout, proc.stdout


def _step(work: Path, step: str, **figures):
    (work / f"{step}.json").write_text(json.dumps({"step": step, "figures": figures}))


def test_the_summary_fails_by_name_on_a_failed_step_a_bound_a_nan_or_missing_figures(tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "steps.tsv").write_text("versions\t0\t3\nparity\t0\t40\nbench_gpu_step\t0\t90\n")
    _step(work, "parity", fp32_gpu_vs_cpu=gpu_check.figure(3e-6, True, "<= 1e-05"))
    _step(work, "bench_gpu_step", mfu=gpu_check.figure(0.41, True, "reported"))
    assert gpu_check.summary(work, out, ["parity", "bench_gpu_step"]) == 0
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["passed"] and result["figures"]["parity"]["fp32_gpu_vs_cpu"]["value"] == 3e-6
    assert any("NCCL between ranks" in line for line in result["unverified"])
    assert "gpu_check: passed" in capsys.readouterr().out

    (work / "steps.tsv").write_text("versions\t0\t3\nparity\t0\t40\nbench_gpu_step\t1\t90\n")
    _step(
        work,
        "parity",
        fp32_gpu_vs_cpu=gpu_check.figure(3e-5, False, "<= 1e-05"),
        zero3_vs_zero0_gpu=gpu_check.figure(float("nan"), True, "<= 1e-06"),
    )
    (work / "bench_gpu_step.json").unlink()
    assert gpu_check.summary(work, out, ["parity", "bench_gpu_step", "overlap"]) == 1
    failures = json.loads((out / "gpu_check.json").read_text())["failures"]
    assert failures == [
        "step bench_gpu_step: exit 1",
        "parity: fp32_gpu_vs_cpu = 3e-05 outside <= 1e-05",
        "parity: zero3_vs_zero0_gpu = nan outside <= 1e-06",
        "step bench_gpu_step: wrote no figures (it failed or ran out of time; see the log)",
        "step overlap: wrote no figures (it failed or ran out of time; see the log)",
    ]
    assert "gpu_check: FAILED" in capsys.readouterr().out


def test_the_pytest_report_allows_only_the_expected_skips(tmp_path):
    xml = tmp_path / "report.xml"
    xml.write_text("""<testsuites><testsuite>
      <testcase classname="tests.gpu.test_streams_cuda" name="test_priorities_are_the_devices[torch]"/>
      <testcase classname="tests.gpu.test_trainer_gpu" name="test_two_gpus_nccl_match_one_process_fp32[tp2]">
        <skipped message="needs 2 CUDA devices, found 1"/></testcase>
      <testcase classname="tests.gpu.test_trainer_gpu" name="test_one_gpu_bf16_smoke_run_learns[3]">
        <skipped message="no CUDA device"/></testcase>
      <testcase classname="tests.gpu.test_trainer_gpu" name="test_one_gpu_bf16_smoke_run_learns[1]">
        <failure message="boom"/></testcase>
    </testsuite></testsuites>""")
    gpu_check.pytest_report(tmp_path, xml, ["test_two_gpus_nccl_match_one_process_fp32[tp2]"])
    figures = json.loads((tmp_path / "pytest.json").read_text())["figures"]
    assert figures["gpu_tests_passed"]["value"] == 1 and figures["gpu_tests_passed"]["ok"]
    assert figures["gpu_tests_failed"]["value"] == 1 and not figures["gpu_tests_failed"]["ok"]
    assert figures["gpu_tests_unexpected_skips"]["value"] == 1
    assert "smoke_run_learns[3]" in figures["gpu_tests_unexpected_skips"]["note"]
    gpu_check.pytest_report(tmp_path, tmp_path / "missing.xml", [])
    figures = json.loads((tmp_path / "pytest.json").read_text())["figures"]
    assert not figures["gpu_tests_passed"]["ok"] and not figures["gpu_tests_failed"]["ok"]


def test_gathers_overlapping_compute_are_counted_from_the_trace():
    def event(cat, name, stream, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    trace = {
        "traceEvents": [
            event("kernel", "gemm", 7, 0, 100),
            event("kernel", "gemm", 7, 150, 100),
            event("kernel", "tiny", 20, 0, 5),  # another stream's kernel
            event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 20, 90, 20),  # overlaps the first gemm
            event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 20, 110, 30),  # between the gemms
            event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 13, 10, 50),  # the copy stream's tokens
            event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 7, 10, 5),  # on the compute stream
            {"ph": "i", "name": "marker"},
        ]
    }
    assert gpu_check.gather_overlap(trace) == (2, 1, "compute stream 7, prefetch stream 20")
    assert gpu_check.gather_overlap({"traceEvents": []})[:2] == (0, 0)


def _side(losses, ms=100.0, peak=None):
    return {"losses": losses, "ms": ms, "peak_gib": peak, "tokens": 1000, "params": 10}


def test_the_step_bench_checks_gaps_learning_nan_and_memory():
    good = bench_gpu_step.compare(
        {"ours": _side([10.0, 9.0, 8.0], 110, peak=40.0), "peer": _side([10.0, 9.1, 8.1])},
        1e12,
        989.0,
        planned_gib=38.0,
    )
    assert all(f["ok"] for f in good.values()), good
    assert good["time_ratio_ours_over_peer"]["value"] == pytest.approx(1.1)
    assert good["ours_mfu"]["value"] == pytest.approx(1e12 / 0.11 / 1e12 / 989.0)
    assert good["ours_hfu"]["value"] == good["ours_mfu"]["value"]  # no recomputation
    assert "goal >= 0.5: not met" in good["ours_mfu"]["note"]
    assert "goal <= 1.053" in good["time_ratio_ours_over_peer"]["note"]
    recomputed = bench_gpu_step.compare(
        {"ours": _side([10.0, 9.0], 110), "peer": _side([10.0, 9.0])},
        1e12,
        989.0,
        None,
        hardware_flops_per_step=1.25e12,
    )
    assert recomputed["ours_hfu"]["value"] == pytest.approx(1.25 * recomputed["ours_mfu"]["value"])
    bad = bench_gpu_step.compare(
        {"ours": _side([10.0, 9.0, float("nan")], peak=50.0), "peer": _side([10.0, 9.5, 9.6])},
        1e12,
        989.0,
        planned_gib=38.0,
    )
    failed = {name for name, f in bad.items() if not f["ok"]}
    assert failed == {"ours_losses_finite", "ours_loss_falls", "loss_gap_ours_vs_peer", "memory_measured_over_plan"}
    assert math.isnan(bad["loss_gap_ours_vs_peer"]["value"])
    missing = bench_gpu_step.compare({"ours": _side([3.0, 2.0]), "peer": None}, 1e12, 989.0, None)
    assert not missing["peer_ran"]["ok"] and "loss_gap_ours_vs_peer" not in missing


def probe_on_cpu(ctx):
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check as step

    return step.probe_worker(ctx, "cpu")


def layout_on_cpu(ctx, layout):
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check as step

    return step.layout_worker(ctx, layout, "cpu", steps=3)


def test_the_gloo_step_probes_every_op_and_compares_a_layout_with_one_process(dist_pool):
    """What the gloo-cuda step does on the GPU, on CPU tensors (which gloo takes for every op)."""
    from megazero.parallel.process_groups import ProcessGroups

    pool = dist_pool(2)
    found = pool.run(probe_on_cpu)
    assert found[0] == found[1] == dict.fromkeys(gpu_check.OPS, "ok")
    two = pool.run(layout_on_cpu, "tp2")[0]
    one = gpu_check.train(gpu_check.layout_config("tp2", tp=1, steps=3), ProcessGroups.single(), "cpu")
    assert len(two) == 3 and gpu_check.max_rel_gap(two, one) <= gpu_check.PARITY_RTOL, (two, one)


TINY = [
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--num-layers",
    "2",
    "--vocab-size",
    "512",
    "--bucket-size",
    "20000",
    "--rounds",
    "1",
    "--warmup",
    "1",
    "--steps",
    "1",
]


def test_the_adam_norm_bench_cuts_runs_as_the_storage_and_judges_the_new_paths(tmp_path, monkeypatch):
    """bench_adam_norm.py on CPU with a tiny GPT: every figure passes, the new paths dispatch fewer
    ops than the old. Planted: the fused side stepping with 1% more learning rate fails the
    parameter gap (and the run exits 1)."""
    runs, norm_runs = bench_adam_norm.partition_runs([4, 2, 6, 3, 5], [0.1, 0.1, 0.0, 0.0, 0.1], bucket=10)
    assert runs == [(0, 6, 0.1), (6, 12, 0.0), (12, 15, 0.0), (15, 20, 0.1)]  # never across a bucket
    assert norm_runs == [(0, 12), (12, 20)]
    assert bench_adam_norm.main(TINY + ["--json", str(tmp_path / "ok.json")]) == 0
    figures = json.loads((tmp_path / "ok.json").read_text())["figures"]
    assert all(f["ok"] for f in figures.values()), figures
    assert figures["norm_foreach_vs_exact"]["value"] <= bench_adam_norm.EXACT_BOUND
    for key in ("adam_fp32_fused_ops", "adam_bf16_weights_fused_ops", "norm_foreach_ops"):
        before = int(figures[key]["note"].split(" before")[0])
        assert figures[key]["value"] < before, (key, figures[key])

    fused = bench_adam_norm.adam_update_fused
    monkeypatch.setattr(
        bench_adam_norm, "adam_update_fused", lambda segments, *, lr, **kw: fused(segments, lr=lr * 1.01, **kw)
    )
    assert bench_adam_norm.main(TINY + ["--json", str(tmp_path / "bad.json")]) == 1
    figures = json.loads((tmp_path / "bad.json").read_text())["figures"]
    assert not figures["adam_fp32_param"]["ok"] and figures["adam_fp32_exp_avg"]["ok"]
