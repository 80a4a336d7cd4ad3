"""bench/bench_moe.py end to end at tiny sizes on the shared pools: every row is there, and the
all-to-all and all-gather dispatchers give the same outputs at ep 4 (checked inside), the
all-gather moving more bytes on the ep group."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_moe  # noqa: E402


def test_bench_moe_tiny(dist_pool):
    args = bench_moe.parse_args(["--tiny", "--eps", "4"])  # the pool of 4 other files share
    lines = bench_moe.report(args, bench_moe.one_process(args), bench_moe.expert_parallel(args, dist_pool))
    text = "\n".join(lines)
    for row in ("dense MLP", "MoE, loop", "MoE, grouped GEMM", "ep 4: alltoall"):
        assert row in text, text
    for ratio in re.findall(r"bytes (\d+\.\d+)", text):
        assert float(ratio) > 1.0, text
