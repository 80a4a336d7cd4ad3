"""The CPU device model's collectives by group and by the job's ranks on the host
(megazero.dry_run.devices.cpu_alpha_beta, bench/calibrate_cpu.py's group_ranks / host_ranks
entries): a 2-rank group of a 4-rank job on 2 cores is costed by the figure measured with 4 ranks
alive (two groups of 2 at once), not by 2 ranks alone; linear between measured worlds and group
sizes; all_to_all by its own table, by the all-gather's where a file has none; a file without the
group entries (every calibration before them) costs as it did. Made-up numbers in the fixture's
schema. Planted (each fails a test here): the group-size-only lookup (the table's `ranks` alone);
send_recv taken at 2 ranks whatever the job's ranks; all_to_all costed by the all-gather's table
when the file has its own."""

from pathlib import Path

import pytest

from megazero.core.comm import CommEntry
from megazero.dry_run import devices
from megazero.dry_run.timeline import schedule

FIXTURE = Path(__file__).with_name("cpu_measured_fixture.toml")
GROUPS = """
group_ranks = [2, 2, 4]
host_ranks = [4, 8, 8]
group_alpha_us = [300.0, 700.0, 900.0]
group_beta_gbps = [1.5, 0.75, 0.4]
"""
ALL_TO_ALL = """
[cpu.collectives.all_to_all]
ranks = [2, 4, 8]
alpha_us = [60.0, 120.0, 240.0]
beta_gbps = [4.0, 2.0, 1.0]
"""


@pytest.fixture
def grouped(tmp_path):
    """The fixture with an all_reduce measured over groups of 2 and 4 inside 4 and 8 ranks, and an
    all_to_all table."""
    text = FIXTURE.read_text().replace("[cpu.collectives.all_gather]", GROUPS + "\n[cpu.collectives.all_gather]")
    path = tmp_path / "cpu.toml"
    path.write_text(text + ALL_TO_ALL)
    return devices.cpu(path, cores=2)


def _seconds(dev, op, nbytes, ranks, host):
    dev.ranks_on_host = host
    return dev.collective_seconds(op, nbytes, ranks)


def test_a_two_rank_group_of_a_four_rank_job_costs_the_four_rank_hosts_figure(grouped):
    """B = 3 MB: wire 2(2-1)/2 B. At 4 ranks on the host: alpha 300 us, 1.5 GB/s (two groups of 2 at
    once), not the 2-ranks-alone 100 us / 2 GB/s."""
    b = 3e6
    assert _seconds(grouped, "all_reduce", b, (0, 1), 4) == pytest.approx(300e-6 + b / 1.5e9)
    assert _seconds(grouped, "all_reduce", b, (2, 3), 2) == pytest.approx(100e-6 + b / 2e9)
    # between measured worlds: 6 ranks halfway from (2 of 4) to (2 of 8); the whole world's own entry
    assert _seconds(grouped, "all_reduce", b, (0, 1), 6) == pytest.approx(500e-6 + b / 1.125e9)
    assert _seconds(grouped, "all_reduce", b, range(4), 4) == pytest.approx(200e-6 + 1.5 * b / 1e9)
    # a group of 3 among 8: halfway between the groups of 2 and 4 measured among 8
    assert _seconds(grouped, "all_reduce", b, range(3), 8) == pytest.approx(800e-6 + 4 / 3 * b / 0.575e9)


def test_the_new_table_moves_a_four_rank_step(grouped):
    """Four CPU ranks, two tp groups of 2 each running one all-reduce (synchronous, on the issuing
    stream): the step is one launch (shared 4 ranks / 2 cores) and the 4-rank host's 2-rank
    all-reduce."""
    b = 2_000_000

    def entry(ranks):
        return ("c", 0, 0, CommEntry("all_reduce", "tp", ranks, "float32", b // 4, (b // 4,), "sum", None, None, "x:1"))

    traces = {r: {"records": [entry((0, 1) if r < 2 else (2, 3))], "threads": []} for r in range(4)}
    grouped.ranks_on_host = 4
    assert schedule(traces, grouped)["step_s"] == pytest.approx(2 * 5e-6 + 300e-6 + b / 1.5e9)


def test_send_recv_and_all_to_all_follow_the_jobs_ranks(grouped, tmp_path):
    b = 1e6
    # send_recv's ranks are worlds of pairs: a p2p of a 4-rank job, the 4-rank world's pairs (the fixture's
    # alpha is 50 us at every world: its beta, 3 GB/s, too); made up here 50 / 90 us
    grouped.collectives["send_recv"] = dict(ranks=[2, 4], alpha_us=[50.0, 90.0], beta_gbps=[3.0, 3.0])
    assert _seconds(grouped, "send", b, (0, 1), 4) == pytest.approx(90e-6 + b / 3e9)
    assert _seconds(grouped, "recv", b, (0, 1), 2) == pytest.approx(50e-6 + b / 3e9)
    assert _seconds(grouped, "all_to_all", b, range(4), 4) == pytest.approx(120e-6 + 0.75 * b / 2e9)
    assert _seconds(grouped, "all_to_allv", b, range(2), 2) == pytest.approx(60e-6 + 0.5 * b / 4e9)
    old = devices.cpu(FIXTURE, cores=2)  # no all_to_all table: the all-gather's figures
    assert _seconds(old, "all_to_all", b, range(4), 4) == pytest.approx(160e-6 + 0.75 * b / 1e9)


def test_a_file_without_group_entries_costs_as_before():
    """The fixture (the schema before groups): a group's own world at any ranks on the host, linear
    between worlds, as the group-size lookup was."""
    old = devices.cpu(FIXTURE, cores=2)
    for host in (1, 2, 4, 8):
        assert _seconds(old, "all_reduce", 3e9, range(2), host) == pytest.approx(100e-6 + 3e9 / 2e9)
        assert _seconds(old, "all_gather", 3e9, range(3), host) == pytest.approx(120e-6 + 2 / 3 * 3e9 / 1.5e9)
