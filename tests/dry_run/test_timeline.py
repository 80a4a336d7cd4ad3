"""The timeline (megazero.dry_run.timeline) against closed forms on hand-made traces, on a device
whose numbers make them exact (1 TFLOP/s at any shape, 1 GB/s links, no launch cost):

- two ranks, one all-reduce on the communicator's stream overlapped with one GEMM on the compute
  stream, joined by an event: step = max(G, A) + G2, exposed communication max(0, A - G); the same
  all-reduce moved onto the compute stream (after the GEMM): exposed communication grows by its
  whole duration A;
- a collective starts when its last member reaches it: the early rank's wait is bubble;
- a 4-stage 1F1B pipeline of m microbatches with unit forward and backward, p2p free: step
  (m + p - 1) x 2, every stage's bubble fraction (p - 1) / (m + p - 1).
One kernel on the H100 model: its FLOPs at its dtype's rate for its shape, after its launch.
The device model's ring formulas against the alpha-beta closed form (GPU within / across nodes;
the CPU's measured table from a fixture in the calibration's schema).
Planted (each fails a test here): the collective run on its issuing stream instead of the
communicator's; a collective starting at its own rank's readiness, not its last member's; a p2p
receive not waiting for its send; all-reduce's wire bytes taken as (n-1)/n; a kernel costed at the
bf16 peak whatever its dtype (ring attention's fp32 bmm 15x too fast); a p2p batch's matched messages placed
again on each retry while one peer has not posted.
"""

from pathlib import Path

import pytest

from megazero.core.comm import CommEntry
from megazero.dry_run import devices
from megazero.dry_run.devices import Device
from megazero.dry_run.timeline import Simulation, TimelineStuck, schedule

GEMM_FLOPS = 4e12  # 4 s at 1 TFLOP/s
TFLOP = 1e12
FIXTURE = Path(__file__).with_name("cpu_measured_fixture.toml")


def unit_device(**over) -> Device:
    fields = dict(
        key="unit",
        name="unit",
        kind="gpu",
        memory_gb=80,
        peak_tflops={"bf16": 1.0},
        memory_gbps=1e9,
        launch_us=0.0,
        gpus_per_node=8,
        link_gbps=1.0,
        link_latency_us=0.0,
        net_gbps=0.5,
        net_latency_us=0.0,
    )
    return Device(**{**fields, **over})


def gemm(flops, stream=0, site="model.py:1"):
    return ("k", stream, "mm.default", flops, 0, "bfloat16", (8192, 8192, 8192), site)


def all_reduce(nbytes, ranks=(0, 1), stream=1, issuing=0, site="engine.py:9"):
    return (
        "c",
        stream,
        issuing,
        CommEntry("all_reduce", "dp", tuple(ranks), "bfloat16", nbytes // 2, (nbytes // 2,), "sum", None, None, site),
    )


def two_ranks(records):
    return {r: {"records": list(records), "threads": []} for r in (0, 1)}


def test_all_reduce_overlapped_with_a_gemm_is_its_closed_form():
    nbytes = int(3e9)  # all-reduce of 2 ranks: 2 (n-1)/n x 3 GB at 1 GB/s = 3 s
    A, G, G2 = 3.0, GEMM_FLOPS / TFLOP, 1.0
    overlapped = [all_reduce(nbytes), ("r", 1, 7), gemm(GEMM_FLOPS), ("w", 0, 7), gemm(TFLOP)]
    result = schedule(two_ranks(overlapped), unit_device())
    assert result["step_s"] == pytest.approx(max(G, A) + G2)
    for row in result["ranks"]:
        assert row["exposed_comm_s"] == pytest.approx(max(0.0, A - G))
        assert row["compute_s"] == pytest.approx(G + G2)
        assert row["bubble_s"] == pytest.approx(0.0) and row["host_s"] == pytest.approx(0.0)
    # the same all-reduce longer than the GEMM: the part the GEMM does not hide is exposed
    long = [all_reduce(2 * 6 * 10**9 // 2), ("r", 1, 7), gemm(GEMM_FLOPS), ("w", 0, 7), gemm(TFLOP)]
    result = schedule(two_ranks(long), unit_device())
    assert result["step_s"] == pytest.approx(6.0 + G2)
    assert result["ranks"][0]["exposed_comm_s"] == pytest.approx(6.0 - G)
    assert result["ranks"][0]["top_exposed"] == [
        {"op": "all_reduce dp[2]", "site": "engine.py:9", "exposed_s": pytest.approx(6.0 - G), "calls": 1}
    ]
    # moved onto the compute stream, after the GEMM: exposed communication grows by its duration
    serial = [gemm(GEMM_FLOPS), all_reduce(nbytes, stream=0, issuing=0), gemm(TFLOP)]
    moved = schedule(two_ranks(serial), unit_device())
    assert moved["step_s"] == pytest.approx(G + A + G2)
    overlapped_exposed = schedule(two_ranks(overlapped), unit_device())["ranks"][0]["exposed_comm_s"]
    assert moved["ranks"][0]["exposed_comm_s"] - overlapped_exposed == pytest.approx(A)


def test_a_collective_starts_when_its_last_member_reaches_it():
    nbytes = int(2e9)  # 2 s
    early = [all_reduce(nbytes, stream=0, issuing=0)]
    late = [gemm(3 * TFLOP), all_reduce(nbytes, stream=0, issuing=0)]
    result = schedule({0: {"records": early}, 1: {"records": late}}, unit_device())
    assert result["step_s"] == pytest.approx(5.0)
    first, second = result["ranks"]
    assert first["step_s"] == second["step_s"] == pytest.approx(5.0)
    assert first["bubble_s"] == pytest.approx(3.0) and first["exposed_comm_s"] == pytest.approx(2.0)
    assert second["bubble_s"] == pytest.approx(0.0) and second["compute_s"] == pytest.approx(3.0)


def _one_f_one_b(stage: int, p: int, m: int) -> list:
    """Stage `stage`'s records of 1F1B (Megatron's order: warm-up forwards, then one forward one
    backward with the pairs' p2p batched, then the cool-down backwards); forward and backward 1 s,
    each p2p on stream 1 with an event the compute stream waits on."""
    recs, event = [], [0]
    prev, nxt = stage - 1, stage + 1

    def p2p(*msgs):
        msgs = tuple((kind, peer, 0) for kind, peer in msgs if 0 <= peer < p)
        if msgs:
            event[0] += 1
            recs.extend([("p", 1, 0, msgs, "schedules.py:1"), ("r", 1, event[0]), ("w", 0, event[0])])

    def forward():
        recs.append(gemm(TFLOP))

    def backward():
        recs.append(gemm(TFLOP))

    warmup = min(p - stage - 1, m)
    for _ in range(warmup):
        p2p(("recv", prev))
        forward()
        p2p(("send", nxt))
    if m > warmup:
        p2p(("recv", prev))
    for i in range(m - warmup):
        forward()
        p2p(("send", nxt), ("recv", nxt))
        backward()
        p2p(("send", prev), *((("recv", prev),) if i < m - warmup - 1 else ()))
    for _ in range(warmup):
        p2p(("recv", nxt))
        backward()
        p2p(("send", prev))
    return recs


@pytest.mark.parametrize("m", [4, 8])
def test_1f1b_bubble_is_its_closed_form(m):
    p = 4
    traces = {s: {"records": _one_f_one_b(s, p, m)} for s in range(p)}
    result = schedule(traces, unit_device())
    assert result["step_s"] == pytest.approx((m + p - 1) * 2.0)
    for row in result["ranks"]:
        assert row["compute_s"] == pytest.approx(2.0 * m)
        assert row["bubble_s"] / result["step_s"] == pytest.approx((p - 1) / (m + p - 1))


def test_ranks_waiting_on_each_other_are_named():
    # rank 0 waits for rank 1's receive that rank 1 posts only after its own receive from rank 0
    traces = {
        0: {"records": [("p", 1, 0, (("recv", 1, 4),), "a.py:1"), ("p", 1, 0, (("send", 1, 4),), "a.py:2")]},
        1: {"records": [("p", 1, 0, (("recv", 0, 4),), "b.py:1"), ("p", 1, 0, (("send", 0, 4),), "b.py:2")]},
    }
    with pytest.raises(TimelineStuck, match=r"rank 0 waits at p2p \[\('recv', 1\)\] at a.py:1"):
        Simulation(traces, unit_device()).run()


def test_ring_formulas_are_the_alpha_beta_closed_form():
    dev = unit_device(link_latency_us=2.0, net_latency_us=10.0)
    S = 8e9
    # within a node: all-reduce 2(n-1) latency steps, 2(n-1)/n of the buffer at 1 GB/s
    assert dev.collective_seconds("all_reduce", S, range(4)) == pytest.approx(6 * 2e-6 + 2 * 3 / 4 * 8.0)
    assert dev.collective_seconds("all_gather", S, range(4)) == pytest.approx(3 * 2e-6 + 3 / 4 * 8.0)
    assert dev.collective_seconds("reduce_scatter", S, range(4)) == pytest.approx(3 * 2e-6 + 3 / 4 * 8.0)
    # across nodes (ranks 0 and 8 of 8-GPU nodes): the network's 0.5 GB/s and latency
    assert dev.collective_seconds("all_reduce", S, (0, 8)) == pytest.approx(2 * 10e-6 + 8.0 / 0.5)
    assert dev.collective_seconds("send", S, (0, 1)) == pytest.approx(2e-6 + 8.0)


def test_cpu_model_reads_the_calibration_schema():
    cpu = devices.cpu(FIXTURE, cores=2)
    assert cpu.kind == "cpu" and cpu.cores == 2 and cpu.peak_tflops == {"fp32": 0.08}
    # gloo's all-reduce at 3 ranks: alpha and beta halfway between the 2- and 4-rank measurements
    alpha, beta = (100 + 200) / 2 * 1e-6, (2.0 + 1.0) / 2 * 1e9
    assert cpu.collective_seconds("all_reduce", 3e9, range(3)) == pytest.approx(alpha + 2 * 2 / 3 * 3e9 / beta)
    # the nearest measured shape's rate; 4 ranks on 2 cores take twice as long
    assert cpu.matmul_seconds(2 * 512**3, 0, "float32", (512, 512, 500)) == pytest.approx(2 * 512**3 / 60e9)
    cpu.ranks_on_host = 4
    assert cpu.matmul_seconds(2 * 512**3, 0, "float32", (512, 512, 500)) == pytest.approx(2 * 2 * 512**3 / 60e9)


def test_a_missing_cpu_model_says_how_to_make_it(tmp_path):
    from megazero.core.errors import UsageError

    with pytest.raises(
        UsageError,
        match=r"--gpu cpu needs the CPU's measured model cpu_measured.toml: run "
        r"python bench/calibrate_cpu.py first",
    ):
        devices.cpu(tmp_path / "cpu_measured.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text(FIXTURE.read_text().split("[cpu.collectives.send_recv]")[0])
    with pytest.raises(UsageError, match=r"broken.toml lacks collectives.send_recv: rerun bench/calibrate_cpu.py"):
        devices.cpu(broken)


def test_gpu_models_cite_each_number():
    for key in ("a100", "h100", "h200"):
        dev = devices.gpu(key)
        cited = set(dev.sources)
        assert {"peak_tflops", "memory_gbps", "link_gbps", "net_gbps", "launch_us", "gpus_per_node"} <= cited, key
        assert all("datasheet" in text or text.startswith("assumption") for text in dev.sources.values()), key
    assert devices.gpu("h100").peak("bf16") == devices.gpu("h100").peak("bfloat16") == pytest.approx(989.5e12)
    assert devices.gpu("h100").peak("float32") == pytest.approx(67e12)
    assert devices.gpu("a100").peak("bf16") == pytest.approx(312e12)


def test_a_kernel_on_a_gpu_is_its_flops_at_its_dtypes_rate():
    # one kernel on the H100 model: launch, then FLOPs / (peak of its inputs' dtype x gemm_max x
    # d / (d + gemm_half_dim)), d its smallest dim; a bf16 GEMM of the layer's shape and ring
    # attention's fp32 bmm (parallel/ring_attention.py: the scores of a 1024 x 512 block, d 128)
    h100 = devices.gpu("h100")
    eff = h100.efficiency
    for dtype, peak, dims in (("bfloat16", 989.5e12, (8192, 4096, 14336)), ("float32", 67e12, (1024, 512, 128))):
        flops = 2.0 * dims[0] * dims[1] * dims[2] * 128
        record = ("k", 0, "mm.default", flops, 0, dtype, dims, "model.py:1")
        rate = peak * eff["gemm_max"] * min(dims) / (min(dims) + eff["gemm_half_dim"])
        result = schedule({0: {"records": [record], "threads": []}}, h100)
        assert result["step_s"] == pytest.approx(h100.launch_us * 1e-6 + flops / rate, rel=1e-9), dtype
        assert result["ranks"][0]["compute_s"] == pytest.approx(flops / rate, rel=1e-9), dtype


def test_predict_times_a_real_dry_run_on_the_cpu_model():
    """predict(): a 2-rank data-parallel job simulated as this CPU, timed by the fixture's model: one
    host thread (compute and host time never overlap communication's wait), gloo's gradient
    all-reduce exposed, the four parts summing to the step, MFU against the best measured matmul."""
    from megazero.dry_run.speed import predict

    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "2",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "128",
        "--zero-stage",
        "1",
    ]
    cpu = devices.cpu(FIXTURE, cores=2)
    result = predict(argv, cpu, world=2, processes=1)
    assert result["device"] == "cpu" and result["dtype"] == "fp32" and result["note"] is None
    assert [r["rank"] for r in result["ranks"]] == [0, 1] and result["step_s"] > 0
    for r in result["ranks"]:
        assert r["compute_s"] + r["exposed_comm_s"] + r["bubble_s"] + r["host_s"] == pytest.approx(result["step_s"])
        assert r["host_s"] > 0 and r["exposed_comm_s"] > 0 and 0 < r["mfu"] < 1
        assert any(op["op"].startswith(("all_reduce", "reduce_scatter")) for op in r["top_exposed"])


def test_fitted_launch_us_makes_the_one_rank_step_its_measured_time():
    """speed.fitted_launch_us on a hand-made one-rank CPU step (a GEMM, an add, a host<->device copy,
    an event recorded and waited): the device's work W is the three ops' calibrated times, the ops
    issued 3 (events cost no issue), launch_us = (T - W) / 3; timed with it, the step is T exactly.
    Planted: counting the event records as issued ops (5) fits (T - W) / 5 and the step falls short;
    counting kernels ("k") only (2) overshoots."""
    import dataclasses

    from megazero.dry_run.speed import fitted_launch_us

    cpu = devices.cpu(FIXTURE, cores=2)
    cpu.ranks_on_host = 1
    records = [
        ("k", 0, "mm.default", 2 * 512**3, 0, "float32", (512, 512, 512), "model.py:1"),
        ("k", 0, "add.Tensor", 0.0, 3e6, "float32", None, ""),
        ("x", 0, 1e6, "loop.py:47"),
        ("r", 0, 1),
        ("w", 0, 1),
    ]
    work = 2 * 512**3 / 60e9 + 3e6 / 10e9 + 1e6 / 10e9
    measured = work + 3 * 40e-6
    launch, found_work, ops = fitted_launch_us({0: {"records": records, "threads": []}}, cpu, measured)
    assert (launch, found_work, ops) == (pytest.approx(40.0), pytest.approx(work), 3)
    fitted = dataclasses.replace(cpu, launch_us=launch)
    assert schedule({0: {"records": records, "threads": []}}, fitted)["step_s"] == pytest.approx(measured)
    assert fitted_launch_us({0: {"records": records, "threads": []}}, cpu, work / 2)[0] == 0.0
    with pytest.raises(ValueError, match="one CPU rank"):
        fitted_launch_us(two_ranks(records), cpu, measured)


def test_cpu_ranks_beyond_the_cores_share_the_hosts_per_op_cost_too():
    """4 ranks on 2 cores, each one GEMM: each op (its launch_us and its kernel) takes twice as long
    as on a rank of its own. Planted: launch_us left unshared gives 5 us + 2 x kernel."""
    cpu = devices.cpu(FIXTURE, cores=2)
    kernel = 2 * 512**3 / 60e9
    records = [("k", 0, "mm.default", 2 * 512**3, 0, "float32", (512, 512, 512), "model.py:1")]
    cpu.ranks_on_host = 4
    four = schedule({r: {"records": list(records), "threads": []} for r in range(4)}, cpu)
    assert four["step_s"] == pytest.approx(2 * (5e-6 + kernel))
    cpu.ranks_on_host = 2
    assert schedule(two_ranks(records), cpu)["step_s"] == pytest.approx(5e-6 + kernel)


def test_cpu_async_collective_takes_its_time_from_the_host_when_no_core_is_spare():
    """Two CPU ranks, an all-reduce issued on the communicator's stream, then a GEMM, then the wait:
    on 2 cores (no core spare for gloo's polling threads) the step is launches + A + G; on 4 cores
    the all-reduce hides behind the GEMM (launches + G). Planted: the async op free on every CPU
    (the timeline before this rule) gives launches + G on 2 cores."""
    cpu = devices.cpu(FIXTURE, cores=2)
    a = 100e-6 + 2e6 / 2e9  # fixture's 2-rank alpha + B / beta
    g = 2 * 512**3 / 60e9
    records = [
        all_reduce(2_000_000),
        ("k", 0, "mm.default", 2 * 512**3, 0, "float32", (512, 512, 512), "m.py:1"),
        ("r", 1, 1),
        ("w", 0, 1),
    ]
    cpu.ranks_on_host = 2
    assert schedule(two_ranks(records), cpu)["step_s"] == pytest.approx(2 * 5e-6 + a + g)
    roomy = devices.cpu(FIXTURE, cores=4)
    roomy.ranks_on_host = 2
    assert schedule(two_ranks(records), roomy)["step_s"] == pytest.approx(2 * 5e-6 + g)


def test_cpu_share_is_the_measured_slowdown_of_ranks_running_at_once(tmp_path):
    """A calibration with shared_slowdown (2 ranks at once 1.5x slower than one alone, 4 ranks 3x):
    the CPU share follows it, interpolated between measured counts, where ranks / cores would say
    1 at 2 ranks. Planted: the table ignored (ranks / cores) fails at 2 ranks."""
    measured = tmp_path / "cpu.toml"
    measured.write_text(
        FIXTURE.read_text().replace(
            "[cpu.collectives.all_reduce]",
            "shared_ranks = [1, 2, 4]\nshared_slowdown = [1.0, 1.5, 3.0]\n\n[cpu.collectives.all_reduce]",
        )
    )
    cpu = devices.cpu(measured, cores=2)
    for ranks, share in ((1, 1.0), (2, 1.5), (3, 2.25), (4, 3.0), (8, 3.0)):
        cpu.ranks_on_host = ranks
        assert cpu.cpu_share() == pytest.approx(share), ranks
    cpu.ranks_on_host = 2
    assert cpu.matmul_seconds(2 * 512**3, 0, "float32", (512, 512, 512)) == pytest.approx(1.5 * 2 * 512**3 / 60e9)


def test_a_p2p_batch_waiting_on_one_peer_is_placed_once():
    # rank 1 posts [send to 0, recv from 2]: rank 0's receive is there (lanes run in rank order),
    # rank 2 sends only after a 4 s GEMM: the batch is retried until rank 2 posts, and each of its
    # messages is placed once (it was placed on every try: the top exposed ops counted twice)
    traces = {
        0: {"records": [("p", 1, 0, (("recv", 1, int(1e9)),), "a.py:1")]},
        1: {"records": [("p", 1, 0, (("send", 0, int(1e9)), ("recv", 2, int(1e9))), "b.py:1")]},
        2: {"records": [gemm(GEMM_FLOPS), ("p", 1, 0, (("send", 1, int(1e9)),), "c.py:1")]},
    }
    result = schedule(traces, unit_device())
    second = result["ranks"][1]
    calls = {row["op"]: row["calls"] for row in second["top_exposed"]}
    assert calls == {"send to 0": 1, "recv from 2": 1}
    assert sum(row["exposed_s"] for row in second["top_exposed"]) == pytest.approx(second["exposed_comm_s"])
