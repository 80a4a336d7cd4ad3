"""The device model of the dry run's timeline: how long one op takes on a named device.

Data, not code: the GPUs' figures are gpus.toml's (each citing its datasheet, the model's assumptions
marked so); this CPU's are cpu_measured.toml's, written by bench/calibrate_cpu.py (matmul GFLOP/s by
shape, memory bandwidth, per-op host overhead, gloo's alpha-beta per collective at 2, 4 and 8 ranks).
`Device` holds one of them and answers the costs the timeline (megazero.dry_run.timeline) asks for:

- a GEMM or attention kernel: a GPU, a roofline, max(FLOPs / (peak x efficiency), bytes /
  bandwidth), the efficiency by shape gemm_max x d / (d + gemm_half_dim), d the smallest of m, n,
  k; the CPU: FLOPs at the measured GFLOP/s of the nearest measured shape (by log distance), which
  includes that shape's memory traffic;
- any other kernel: its bytes at the memory bandwidth;
- a collective of n ranks: a ring's alpha-beta, the bytes on the wire by the ring's formula
  (all-reduce 2(n-1)/n of the buffer, all-gather / reduce-scatter / all-to-all / broadcast (n-1)/n,
  p2p the tensor); a GPU: NVLink within a node, the network across nodes, one latency per ring step;
  the CPU: the measured alpha and beta for that op and group size at the job's ranks on the host
  (cpu_alpha_beta: a 2-rank group among 4 live ranks on 2 cores is timed as such), interpolated.

A CPU "rank" has one stream and runs every op on its host thread; ranks sharing one host share its
`cores`: each op takes the calibration's measured slowdown at that many ranks running at once
(`shared_slowdown`), else ranks / cores past the cores, longer (`cpu_share`).
Owns no simulation: pure functions of the op's numbers and the device's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from pathlib import Path

from megazero.core.errors import UsageError

HERE = Path(__file__).parent
GPUS_FILE = HERE / "gpus.toml"
CPU_FILE = HERE / "cpu_measured.toml"
COLLECTIVE_TABLES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")  # all_to_all: optional
# The measured table a collective of the trace is timed by (the CPU), and its ring's steps and
# wire fraction (the GPU): op -> (table, latency steps(n), wire bytes / payload bytes(n)).
_RING = {
    "all_reduce": ("all_reduce", lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "reduce_scatter": ("reduce_scatter", lambda n: n - 1, lambda n: (n - 1) / n),
    "all_gather": ("all_gather", lambda n: n - 1, lambda n: (n - 1) / n),
    "all_to_all": ("all_to_all", lambda n: n - 1, lambda n: (n - 1) / n),
    "all_to_allv": ("all_to_all", lambda n: n - 1, lambda n: (n - 1) / n),
    "broadcast": ("all_gather", lambda n: n - 1, lambda n: (n - 1) / n),
    "barrier": ("all_reduce", lambda n: 2 * (n - 1), lambda n: 0.0),
    "send": ("send_recv", lambda n: 1, lambda n: 1.0),
    "recv": ("send_recv", lambda n: 1, lambda n: 1.0),
}


_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclasses.dataclass
class Device:
    key: str
    name: str
    kind: str  # "gpu" or "cpu"
    memory_gb: float
    peak_tflops: dict  # dtype -> dense TFLOP/s (the CPU: its best measured fp32 matmul)
    memory_gbps: float
    launch_us: float
    gpus_per_node: int = 8
    link_gbps: float = 0.0
    link_latency_us: float = 0.0
    net_gbps: float = 0.0
    net_latency_us: float = 0.0
    host_link_gbps: float = 0.0
    host_memory_gbps: float = 0.0
    efficiency: dict = dataclasses.field(default_factory=dict)
    matmul: list = dataclasses.field(default_factory=list)  # the CPU: [[m, n, k, gflops], ...]
    collectives: dict = dataclasses.field(default_factory=dict)  # the CPU: op -> {ranks, alpha_us, beta_gbps}
    cores: int = 1
    shared: dict = dataclasses.field(default_factory=dict)  # the CPU: {ranks, slowdown} measured
    ranks_on_host: int = 1  # set by the timeline: the job's ranks on one host (the CPU)
    sources: dict = dataclasses.field(default_factory=dict)

    # --- compute ------------------------------------------------------------------------------------
    def peak(self, dtype: str) -> float:
        """FLOP/s of a matmul in `dtype` (the datasheet's name or torch's: bf16 or bfloat16) at the
        datasheet's peak (fp32's for a dtype it does not list)."""
        table = self.peak_tflops
        dtype = _DTYPE_NAMES.get(dtype, dtype)
        return 1e12 * table.get(dtype, table.get("fp32", max(table.values())))

    def gemm_efficiency(self, dims) -> float:
        eff = self.efficiency
        smallest = max(1, min(dims)) if dims else 1
        half = eff.get("gemm_half_dim", 0)
        return eff.get("gemm_max", 1.0) * smallest / (smallest + half)

    def cpu_gflops(self, dims) -> float:
        """The measured rate of the measured shape nearest `dims` (m, n, k) in log distance."""
        m, n, k = (tuple(dims) + (1, 1, 1))[:3]

        def distance(row):
            return sum((math.log(max(a, 1)) - math.log(max(b, 1))) ** 2 for a, b in zip(row[:3], (m, n, k)))

        return min(self.matmul, key=distance)[3]

    def matmul_seconds(self, flops: float, nbytes: float, dtype: str, dims) -> float:
        if flops <= 0:
            return self.memory_seconds(nbytes)
        if self.kind == "cpu":  # the measured rate of that shape already includes its memory traffic
            return flops / (1e9 * self.cpu_gflops(dims)) * self.cpu_share()
        rate = self.peak(dtype) * self.gemm_efficiency(dims)
        return max(flops / rate, self.memory_seconds(nbytes))

    def memory_seconds(self, nbytes: float) -> float:
        return nbytes / (1e9 * self.memory_gbps * self.efficiency.get("memory", 1.0)) * self.cpu_share()

    def host_seconds(self, nbytes: float) -> float:
        """A host-side op of a GPU job (an offloaded optimizer's): its bytes at the host's bandwidth."""
        return nbytes / (1e9 * (self.host_memory_gbps or self.memory_gbps))

    def copy_seconds(self, nbytes: float) -> float:
        """A host<->device copy: PCIe (the CPU: its memory)."""
        if self.kind == "cpu" or not self.host_link_gbps:
            return self.memory_seconds(nbytes)
        return nbytes / (1e9 * self.host_link_gbps)

    def cpu_share(self) -> float:
        """How much longer an op takes with the host's ranks running at once than one rank alone (the
        CPU only): the calibration's measured slowdown at that many ranks where it has one, else
        ranks / cores past the cores."""
        if self.kind != "cpu":
            return 1.0
        if self.shared:
            return max(1.0, _interpolate(self.shared["ranks"], self.shared["slowdown"], self.ranks_on_host))
        return max(1.0, self.ranks_on_host / max(1, self.cores))

    # --- communication -----------------------------------------------------------------------------
    def same_node(self, ranks) -> bool:
        return self.kind == "cpu" or len({r // self.gpus_per_node for r in ranks}) == 1

    def collective_seconds(self, op: str, nbytes: float, ranks) -> float:
        """A collective (or one p2p message) of payload `nbytes` (the CommEntry's tensor) among `ranks`."""
        n = max(2, len(ranks))
        table, steps, wire = _RING.get(op, _RING["all_reduce"])
        on_wire = nbytes * wire(n)
        if self.kind == "cpu":
            # a calibration before all_to_all was timed: the all-gather's figures, as (n-1)/n on the wire
            row = self.collectives.get(table) or self.collectives["all_gather"]
            alpha, beta = cpu_alpha_beta(
                row, 2 if table == "send_recv" else n, self.ranks_on_host, table == "send_recv"
            )
            return 1e-6 * alpha + on_wire / (1e9 * beta)
        if self.same_node(ranks):
            latency, bandwidth = self.link_latency_us, self.link_gbps * self.efficiency.get("link", 1.0)
        else:
            latency, bandwidth = self.net_latency_us, self.net_gbps * self.efficiency.get("net", 1.0)
        return 1e-6 * latency * steps(n) + on_wire / (1e9 * bandwidth)


def cpu_alpha_beta(row: dict, group: int, host: int, pairs: bool = False) -> tuple[float, float]:
    """(alpha us, beta GB/s) of a `group`-rank collective in a job with `host` ranks on the host, from
    a calibration table (bench/calibrate_cpu.py's [cpu.collectives.<op>]): its `ranks` entries are
    the whole world in one group (`pairs`: send_recv's, pairs in a world of that many), its
    group_ranks / host_ranks entries groups inside a larger world, every group at once. On 2 cores
    a 2-rank group among 4 live ranks waits for its partner to be scheduled, which 2 ranks alone
    never do: the figure is the one measured at the job's ranks on the host (at least the group),
    linear in the host's ranks between measured worlds, then in the group size between measured
    groups; the nearest outside them. A table without group entries: the group's own world."""
    points = {}  # group -> [(host ranks, alpha, beta)]
    for n, a, b in zip(row["ranks"], row["alpha_us"], row["beta_gbps"]):
        points.setdefault(2 if pairs else n, []).append((n, a, b))
    for g, n, a, b in zip(
        row.get("group_ranks", ()),
        row.get("host_ranks", ()),
        row.get("group_alpha_us", ()),
        row.get("group_beta_gbps", ()),
    ):
        points.setdefault(g, []).append((n, a, b))

    def at(g: int) -> tuple[float, float]:
        worlds = [n for n, _, _ in points[g]]
        world = max(host, g)
        return (
            _interpolate(worlds, [a for _, a, _ in points[g]], world),
            _interpolate(worlds, [b for _, _, b in points[g]], world),
        )

    if group in points:
        return at(group)
    sizes = sorted(points)
    found = [at(g) for g in sizes]
    return _interpolate(sizes, [a for a, _ in found], group), _interpolate(sizes, [b for _, b in found], group)


def _interpolate(xs, ys, x: float) -> float:
    """Linear in x between the measured points, the nearest one's value outside them."""
    pairs = sorted(zip(xs, ys))
    if x <= pairs[0][0]:
        return pairs[0][1]
    for (x0, y0), (x1, y1) in zip(pairs, pairs[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pairs[-1][1]


_GPU_FIELDS = (
    "name",
    "memory_gb",
    "peak_tflops",
    "memory_gbps",
    "launch_us",
    "gpus_per_node",
    "link_gbps",
    "link_latency_us",
    "net_gbps",
    "net_latency_us",
)


def gpu(key: str, path: Path = GPUS_FILE) -> Device:
    with open(path, "rb") as f:
        table = tomllib.load(f)
    if key not in table:
        raise UsageError(
            f"--gpu {key}: no such device in {path.name}; choose one of {', '.join(sorted(table))}, or cpu"
        )
    row = table[key]
    missing = [f for f in _GPU_FIELDS if f not in row]
    if missing:
        raise UsageError(f"{path.name} [{key}] lacks {', '.join(missing)}: add them, each with its source")
    known = {f.name for f in dataclasses.fields(Device)}
    return Device(key=key, kind="gpu", **{k: v for k, v in row.items() if k in known and k != "source"})


def cpu(path: Path = CPU_FILE, cores: int | None = None) -> Device:
    """This CPU as bench/calibrate_cpu.py measured it (`path`); `cores`: the host's cores its ranks
    share (default the file's `cores`, else os.cpu_count())."""
    if not Path(path).exists():
        raise UsageError(
            f"--gpu cpu needs the CPU's measured model {Path(path).name}: run "
            f"python bench/calibrate_cpu.py first (it writes {path})"
        )
    with open(path, "rb") as f:
        row = tomllib.load(f)["cpu"]
    missing = [f for f in ("name", "launch_us", "memory_gbps", "matmul", "collectives") if f not in row]
    missing += [f"collectives.{op}" for op in COLLECTIVE_TABLES if op not in row.get("collectives", {})]
    if missing:
        raise UsageError(f"{Path(path).name} lacks {', '.join(missing)}: rerun bench/calibrate_cpu.py")
    best = max(r[3] for r in row["matmul"]) / 1000.0
    return Device(
        key="cpu",
        name=row["name"],
        kind="cpu",
        memory_gb=row.get("memory_gb", 0),
        peak_tflops={"fp32": best},
        memory_gbps=row["memory_gbps"],
        launch_us=row["launch_us"],
        matmul=[list(r) for r in row["matmul"]],
        collectives=dict(row["collectives"]),
        cores=int(cores or row.get("cores") or os.cpu_count() or 1),
        shared={"ranks": row["shared_ranks"], "slowdown": row["shared_slowdown"]}
        if "shared_ranks" in row and "shared_slowdown" in row
        else {},
        sources={"cpu": row.get("source", "")},
    )


def device(key: str) -> Device:
    """`--gpu` name -> its Device: a GPU of gpus.toml, or "cpu" (cpu_measured.toml)."""
    return cpu() if key == "cpu" else gpu(key)


def names() -> list[str]:
    with open(GPUS_FILE, "rb") as f:
        return sorted(tomllib.load(f)) + ["cpu"]
