"""The figures of bench/gpu_check.sh, one subcommand per step, and the summary that judges them.

Each step writes <work>/<step>.json, {"step": ..., "figures": {name: {value, ok, bound, note}}}
(bench_gpu_step.py --json writes its own); `summary` reads them all, writes gpu_check.json (every
figure with pass/fail, every step's exit code and time, what one GPU cannot show) and exits 1 naming
each failure: a step that failed or did not finish, a figure outside its bound, a value not finite.

    parity     fp32, deterministic algorithms, SDPA's math kernel on both devices: the same 20-step
               run on the GPU and on the CPU (loss within 1e-5 relative at every step); on the GPU,
               ZeRO-3 on groups of one (every gather a copy on the prefetch stream, the stream race's
               witness) against ZeRO-0, the optimizer offloaded to the CPU against the device run
               (ZeRO-1), parameters in host memory and optimizer states in nvme files against the
               device run (ZeRO-3): each within 1e-6
    overlap    a torch.profiler trace of one bf16 ZeRO-3 step: how many of the prefetch stream's
               gathers (device-to-device copies off the compute stream) overlap compute kernels
    gloo-cuda  two ranks on the one GPU over gloo, when gloo moves CUDA tensors for the ops a layout
               uses: tp 2 and dp 2 ZeRO-3 against one process (1e-5); otherwise "unverified", naming
               the ops gloo lacks
    pytest     tests/gpu's junit report: something passed, nothing failed, nothing skipped but the
               expected skips (tests that need two GPUs)
    summary    gpu_check.json

    python bench/gpu_check.py parity --work DIR
    python bench/gpu_check.py summary --work DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)

PARITY_RTOL = 1e-5  # GPU vs CPU, and gloo over CUDA vs one process
SAME_DEVICE_RTOL = 1e-6  # ZeRO-3 vs ZeRO-0, offloaded vs device, on the GPU
UNVERIFIED = [
    "NCCL between ranks (all-reduce, reduce-scatter, all-gather, all-to-all, batched "
    "send/recv) and work.wait()'s stream edges across ranks: one GPU has no second rank; "
    "tests/gpu's gpu(2) tests and a multi-GPU run of this script show them"
]


def figure(value, ok: bool, bound: str, note: str = "") -> dict:
    return {"value": value, "ok": bool(ok), "bound": bound, "note": note}


def write_step(work: Path, step: str, figures: dict, **extra) -> None:
    (work / f"{step}.json").write_text(json.dumps({"step": step, "figures": figures, **extra}, indent=1))
    for name, f in figures.items():
        print(f"{'ok  ' if f['ok'] else 'FAIL'} {name} = {f['value']} ({f['bound']}) {f['note']}".rstrip(), flush=True)


def max_rel_gap(a: list[float], b: list[float]) -> float:
    """The largest |a - b| / |b| over the steps; nan when the curves differ in length or hold one."""
    if len(a) != len(b) or not a:
        return float("nan")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def gap_figure(a, b, rtol: float, what: str) -> dict:
    gap = max_rel_gap(a, b)
    return figure(gap, gap <= rtol, f"<= {rtol:g} relative at every step", what)


# --- training runs ---------------------------------------------------------------------------------
def train_config(
    stage: int = 0,
    bf16: bool = False,
    zero_extra: dict | None = None,
    tp: int = 1,
    global_batch: int = 8,
    steps: int = 20,
    **model,
):
    """A small fp32 GPT on learnable tokens, micro batch 4, clipping on."""
    from megazero.config.train_config import OptimizerConfig, ParallelConfig, TrainConfig
    from megazero.zero.config import PrecisionConfig
    from megazero.models.config import GPTConfig, padded_vocab_size
    from megazero.ops.adam_config import AdamConfig
    from megazero.zero.config import ZeroConfig

    shape = dict(
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        seq_length=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    shape.update(model)
    shape["padded_vocab_size"] = padded_vocab_size(shape["vocab_size"], 8, tp)
    zero = ZeroConfig(**{"stage": stage, "param_persistence_threshold": 100, **(zero_extra or {})})
    lr = 1e-3
    opt = OptimizerConfig(
        lr=lr,
        min_lr=lr / 10,
        warmup_iters=2,
        decay_style="cosine",
        adam=AdamConfig(lr=lr, weight_decay=0.1),
        clip_grad=1.0,
    )
    return TrainConfig(
        model=GPTConfig(**shape),
        zero=zero,
        optimizer=opt,
        micro_batch_size=4,
        global_batch_size=global_batch,
        train_iters=steps,
        seed=7,
        precision=PrecisionConfig(bf16=bf16),
        parallel=ParallelConfig(tensor_parallel=tp),
    )


def trainer(cfg, groups, device):
    """megazero.training set up on `device`: a function running step `it` (0-based), returning the
    global loss."""
    from megazero.data.synthetic import ArithmeticTokens
    from megazero.training.lr_schedule import learning_rate
    from megazero.data.sampler import MicrobatchSource
    from megazero.training import setup, train_step

    state = setup(cfg, groups, device)
    source = MicrobatchSource(
        ArithmeticTokens(cfg.model.vocab_size, cfg.model.seq_length, seed=3),
        cfg.global_batch_size,
        cfg.micro_batch_size,
        groups.coords.dp,
        groups.topology.dp,
    )
    return lambda it: train_step(state, source.batch(it), learning_rate(cfg.optimizer, it + 1, cfg.train_iters)).loss


def train(cfg, groups, device) -> list[float]:
    """cfg.train_iters steps; the global losses."""
    step = trainer(cfg, groups, device)
    return [step(it) for it in range(cfg.train_iters)]


def parity(work: Path) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from megazero.parallel.process_groups import ProcessGroups

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    cuda, cpu = torch.device("cuda", torch.cuda.current_device()), torch.device("cpu")
    swap = tempfile.mkdtemp(prefix="gpu_check_swap")
    offload_cpu = {"offload_optimizer": {"device": "cpu"}}
    offload_nvme = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme", "nvme_path": swap}}
    runs = {
        "cpu zero0": (0, {}, cpu),
        "gpu zero0": (0, {}, cuda),
        "gpu zero3": (3, {}, cuda),
        "gpu zero1": (1, {}, cuda),
        "gpu zero1 offload": (1, offload_cpu, cuda),
        "gpu zero3 offload": (3, offload_nvme, cuda),
    }
    curves, notes = {}, set()
    with warnings.catch_warnings(record=True) as caught, sdpa_kernel([SDPBackend.MATH]):
        warnings.simplefilter("always")
        for name, (stage, extra, device) in runs.items():
            groups = ProcessGroups.single(device=device)
            curves[name] = train(train_config(stage, zero_extra=extra), groups, device)
            print(f"{name}: " + " ".join(f"{x:.7f}" for x in curves[name]), flush=True)
    notes = sorted({str(w.message).split("\n")[0] for w in caught if "deterministic" in str(w.message)})
    why = "; ".join(notes) or "every op deterministic"
    write_step(
        work,
        "parity",
        {
            "fp32_gpu_vs_cpu": gap_figure(
                curves["gpu zero0"], curves["cpu zero0"], PARITY_RTOL, f"20 steps ZeRO-0, GPU against CPU ({why})"
            ),
            "zero3_vs_zero0_gpu": gap_figure(
                curves["gpu zero3"], curves["gpu zero0"], SAME_DEVICE_RTOL, "ZeRO-3 on groups of one against ZeRO-0"
            ),
            "offload_optimizer_vs_device_gpu": gap_figure(
                curves["gpu zero1 offload"], curves["gpu zero1"], SAME_DEVICE_RTOL, "ZeRO-1, optimizer on the CPU"
            ),
            "offload_params_nvme_optimizer_vs_device_gpu": gap_figure(
                curves["gpu zero3 offload"],
                curves["gpu zero3"],
                SAME_DEVICE_RTOL,
                "ZeRO-3, parameters in host memory, optimizer states in nvme files",
            ),
        },
        curves=curves,
    )


# --- the prefetch stream in a profiler trace ----------------------------------------------------------
def gather_overlap(trace: dict) -> tuple[int, int, str]:
    """(gathers, gathers overlapping a compute kernel, how they were found) from a chrome trace:
    the compute stream is the one with the most kernel time; the gathers are device-to-device copies
    on the other stream that carries the most of them (stage 3 on groups of one copies each unit's
    partition into its full buffer on the prefetch stream)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "stream" in e.get("args", {})]
    busy: dict[int, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            busy[e["args"]["stream"]] = busy.get(e["args"]["stream"], 0.0) + e["dur"]
    if not busy:
        return 0, 0, "no kernels in the trace"
    compute = max(busy, key=busy.get)
    copies: dict[int, list] = {}
    for e in events:
        if e.get("cat") == "gpu_memcpy" and "DtoD" in e.get("name", "") and e["args"]["stream"] != compute:
            copies.setdefault(e["args"]["stream"], []).append((e["ts"], e["ts"] + e["dur"]))
    if not copies:
        return 0, 0, f"no device-to-device copies off the compute stream {compute}"
    side = max(copies, key=lambda s: len(copies[s]))
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and e["args"]["stream"] == compute
    )
    overlapping = sum(any(k0 < g1 and g0 < k1 for k0, k1 in kernels) for g0, g1 in copies[side])
    return len(copies[side]), overlapping, f"compute stream {compute}, prefetch stream {side}"


def overlap(work: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from megazero.parallel.process_groups import ProcessGroups

    cuda = torch.device("cuda", torch.cuda.current_device())
    cfg = train_config(
        3,
        bf16=True,
        steps=3,
        hidden_size=1024,
        num_layers=8,
        num_attention_heads=8,
        seq_length=1024,
        vocab_size=32000,
        zero_extra={"prefetch_bucket_size": 20_000_000, "param_persistence_threshold": 10_000},
    )
    trace_path = work / "stage3_trace.json"
    step = trainer(cfg, ProcessGroups.single(device=cuda), cuda)
    losses = [step(0), step(1)]  # step 1 records the unit order; prefetch runs from step 2
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        losses.append(step(2))
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    gathers, overlapped, how = gather_overlap(json.loads(trace_path.read_text()))
    fraction = overlapped / gathers if gathers else float("nan")
    write_step(
        work,
        "overlap",
        {
            "stage3_prefetch_gathers": figure(gathers, gathers > 0, "> 0 on a stream of their own", how),
            "stage3_gathers_overlapping_compute": figure(
                fraction, math.isfinite(fraction), "reported", f"{overlapped} of {gathers}; losses {losses}"
            ),
        },
    )


# --- two ranks on one GPU over gloo -------------------------------------------------------------------
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
LAYOUT_OPS = {
    "tp2": ("all_reduce", "all_gather", "broadcast"),
    "dp2 zero3": ("all_reduce", "all_gather", "reduce_scatter", "broadcast"),
}


def probe_worker(ctx, device: str = "cuda:0") -> dict:
    """Pool entry: each collective on `device` tensors over gloo, checked; op -> "ok" or the error."""
    import torch
    import torch.distributed as dist

    cuda, rank, found = torch.device(device), ctx.rank, {}
    one = lambda: torch.full((4,), float(rank + 1), device=cuda)  # noqa: E731
    tries = {
        "all_reduce": lambda: (lambda t: (dist.all_reduce(t), t)[1])(one()).tolist() == [3.0] * 4,
        "all_gather": lambda: (
            (lambda o: (dist.all_gather_into_tensor(o, one()), o)[1])(torch.empty(8, device=cuda)).tolist()
            == [1.0] * 4 + [2.0] * 4
        ),
        "reduce_scatter": lambda: (
            (lambda o: (dist.reduce_scatter_tensor(o, torch.cat([one(), one()])), o)[1])(
                torch.empty(4, device=cuda)
            ).tolist()
            == [3.0] * 4
        ),
        "all_to_all": lambda: (
            (lambda o: (dist.all_to_all_single(o, one()), o)[1])(torch.empty(4, device=cuda)).tolist()
            == [1.0, 1.0, 2.0, 2.0]
        ),
        "broadcast": lambda: (lambda t: (dist.broadcast(t, 0), t)[1])(one()).tolist() == [1.0] * 4,
        "send_recv": lambda: _send_recv(one(), rank, cuda),
    }
    for op, attempt in tries.items():
        try:
            found[op] = "ok" if attempt() else "wrong values"
        except Exception as err:  # gloo refuses CUDA tensors op by op
            found[op] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return found


def _send_recv(tensor, rank: int, cuda) -> bool:
    import torch.distributed as dist

    got = tensor.new_empty(4)
    for work in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, tensor, 1 - rank), dist.P2POp(dist.irecv, got, 1 - rank)]
    ):
        work.wait()
    return got.tolist() == [float(2 - rank)] * 4


def layout_config(layout: str, tp: int, steps: int = 10):
    """`layout`'s run ("tp2", "dp2 zero3") at tensor-parallel size `tp` (1: its one-process peer):
    the same global batch either way."""
    return train_config(3 if "zero3" in layout else 0, tp=tp, global_batch=16 if "dp2" in layout else 8, steps=steps)


def layout_worker(ctx, layout: str, device: str = "cuda:0", steps: int = 10) -> list[float]:
    """Pool entry: `steps` fp32 steps of `layout` on two ranks sharing `device`, over gloo."""
    import torch
    from megazero.parallel.process_groups import ProcessGroups
    from megazero.parallel.topology import Topology

    cuda = torch.device(device)
    tp = 2 if layout == "tp2" else 1
    groups = ProcessGroups.build(Topology(world_size=2, tp=tp), ctx.rank, ctx.factory, device=cuda)
    return train(layout_config(layout, tp, steps), groups, cuda)


def gloo_cuda(work: Path) -> None:
    import torch
    from megazero.parallel.process_groups import ProcessGroups
    from megazero.testing import DistributedPool

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_check as me  # the pool's workers import this module by name

    pool = DistributedPool(2)
    figures, unverified = {}, []
    try:
        try:
            found = pool.run(me.probe_worker, timeout=120)[0]
        except AssertionError as err:  # a gloo op that hangs or crashes on CUDA tensors
            found = {op: f"the probe did not finish: {str(err).splitlines()[-1][:200]}" for op in OPS}
        print("gloo with CUDA tensors: " + ", ".join(f"{op} {found[op]}" for op in OPS), flush=True)
        cuda = torch.device("cuda", torch.cuda.current_device())
        for layout, ops in LAYOUT_OPS.items():
            lacking = [op for op in ops if found.get(op) != "ok"]
            if lacking:
                unverified.append(
                    f"{layout} over gloo on one GPU: gloo lacks CUDA {', '.join(lacking)} "
                    f"({'; '.join(found[op] for op in lacking)})"
                )
                continue
            one = train(layout_config(layout, tp=1), ProcessGroups.single(device=cuda), cuda)
            two = pool.run(me.layout_worker, layout, timeout=240)[0]
            figures[f"gloo_cuda_{layout.replace(' ', '_')}_vs_one_process"] = gap_figure(
                two, one, PARITY_RTOL, "2 ranks sharing the GPU over gloo, fp32, 10 steps"
            )
    finally:
        pool.close()
    figures["gloo_cuda_ops"] = figure(found, True, "reported", "op -> ok, or why gloo refused CUDA tensors")
    write_step(work, "gloo_cuda", figures, unverified=unverified)


# --- the pytest step ----------------------------------------------------------------------------------
def pytest_report(work: Path, xml: Path, expected_skips: list[str]) -> None:
    """Figures from tests/gpu's junit xml: passes, failures (and errors), unexpected skips."""
    import xml.etree.ElementTree as ET

    passed, failed, skipped = [], [], []
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(name)
            elif case.find("skipped") is not None:
                skipped.append(name)
            else:
                passed.append(name)
    unexpected = [s for s in skipped if not any(s.endswith(e) or e in s for e in expected_skips)]
    write_step(
        work,
        "pytest",
        {
            "gpu_tests_passed": figure(
                len(passed), len(passed) > 0, "> 0", "" if xml.is_file() else f"no report at {xml}"
            ),
            "gpu_tests_failed": figure(len(failed), not failed and xml.is_file(), "0", ", ".join(failed)),
            "gpu_tests_unexpected_skips": figure(
                len(unexpected), not unexpected, "0", f"skipped: {', '.join(skipped) or 'none'}"
            ),
        },
    )


# --- the summary --------------------------------------------------------------------------------------
def finite(value) -> bool:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, (int, float)):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(finite(v) for v in value)
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    return True


def summarize(work: Path, steps: list[tuple[str, int, int]], figure_steps: list[str]) -> dict:
    """gpu_check.json's content: `steps` are (name, exit code, seconds) as the script ran them;
    `figure_steps` the steps whose <work>/<step>.json must exist."""
    failures = [f"step {name}: exit {rc}" for name, rc, _ in steps if rc != 0]
    figures, unverified = {}, list(UNVERIFIED)
    for step in figure_steps:
        path = work / f"{step}.json"
        if not path.is_file():
            failures.append(f"step {step}: wrote no figures (it failed or ran out of time; see the log)")
            continue
        content = json.loads(path.read_text())
        figures[step] = content["figures"]
        unverified += content.get("unverified", [])
        for name, f in content["figures"].items():
            if not f["ok"] or not finite(f["value"]):
                failures.append(
                    f"{step}: {name} = {f['value']} outside {f['bound']}" + (f" ({f['note']})" if f.get("note") else "")
                )
    return {
        "passed": not failures,
        "failures": failures,
        "steps": [{"name": n, "exit": rc, "seconds": s} for n, rc, s in steps],
        "figures": figures,
        "unverified": unverified,
    }


def read_steps(path: Path) -> list[tuple[str, int, int]]:
    """The script's step log: one `name<TAB>exit<TAB>seconds` line per step."""
    if not path.is_file():
        return []
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    return [(name, int(rc), int(seconds)) for name, rc, seconds in rows]


def summary(work: Path, out: Path, figure_steps: list[str]) -> int:
    result = summarize(work, read_steps(work / "steps.tsv"), figure_steps)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(f"\n=== gpu_check.json ({out / 'gpu_check.json'}) ===")
    for step, figs in result["figures"].items():
        for name, f in figs.items():
            mark = "ok  " if f["ok"] and finite(f["value"]) else "FAIL"
            note = f" {f['note']}" if f.get("note") and step != "pytest" else ""  # pytest's: long lists
            print(f"{mark} {step}: {name} = {f['value']} ({f['bound']}){note}")
    for line in result["unverified"]:
        print(f"unverified: {line}")
    if result["passed"]:
        print("gpu_check: passed")
        return 0
    print("gpu_check: FAILED\n" + "\n".join(f"  {line}" for line in result["failures"]))
    return 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=["parity", "overlap", "gloo-cuda", "pytest", "summary"])
    p.add_argument("--work", type=Path, required=True, help="where the steps' figures go")
    p.add_argument("--out", type=Path, help="summary: where gpu_check.json goes")
    p.add_argument("--xml", type=Path, help="pytest: the junit report")
    p.add_argument("--expected-skips", default="", help="pytest: comma-separated test names skipped on one GPU")
    p.add_argument(
        "--figure-steps",
        default="pytest,parity,overlap,bench_gpu_step,adam_norm,gloo_cuda",
        help="summary: the steps that must have written figures",
    )
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.step == "summary":
        return summary(args.work, args.out or args.work, [s for s in args.figure_steps.split(",") if s])
    if args.step == "pytest":
        pytest_report(args.work, args.xml, [s for s in args.expected_skips.split(",") if s])
    else:
        {"parity": parity, "overlap": overlap, "gloo-cuda": gloo_cuda}[args.step](args.work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
