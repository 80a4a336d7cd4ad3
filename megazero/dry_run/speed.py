"""How fast a job would run on a named device: the dry run's traces (megazero.dry_run.trace) of
the last training step, placed on the device's streams by the timeline (megazero.dry_run.timeline),
with MFU by megazero's FLOPs formula (megazero.training.flops: Megatron-LM's current count).

    predict(argv, "h100", world=8) -> {"device", "step_s", "ranks": [per-rank result, ...], ...}

is the one call a bench makes (it runs the dry run); `timeline_of(runs, ...)` is the same from runs
already simulated (tools/dry_run.py --gpu). Ranks a role stands for (megazero.dry_run.roles) are not
simulated: a collective waits only for its simulated members, a p2p with an unsimulated peer for
nobody. Owns the joining of traces and the report's `timeline` field; touches no simulation.
"""

from __future__ import annotations

import dataclasses

from megazero.dry_run import devices, timeline

ITEMS = ("compute_s", "exposed_comm_s", "bubble_s", "host_s")


def _dtype(cfg) -> str:
    return "bf16" if cfg.precision.bf16 else "fp16" if cfg.precision.fp16 else "fp32"


def step_traces(runs) -> dict[int, dict]:
    """rank -> its last training step's records (collectives joined) and host-thread streams."""
    return {run.rank: run.trace for run in runs if run.trace is not None and run.error is None and run.trace["records"]}


def timeline_of(runs, cfg, world: int, device, ranks_on_host: int | None = None) -> dict:
    """The report's `timeline` field: per simulated rank its step time, MFU, the four parts of the
    step and its most exposed ops, on `device` (a devices.Device or its --gpu name)."""
    from megazero.training.flops import step_flops

    if isinstance(device, str):
        device = devices.device(device)
    device.ranks_on_host = ranks_on_host or world
    traces = step_traces(runs)
    dtype = _dtype(cfg)
    out = {
        "device": device.key,
        "device_name": device.name,
        "dtype": dtype,
        "step_s": None,
        "tokens_per_s_per_device": None,
        "note": None,
        "ranks": [],
    }
    if not traces:
        out["note"] = "no rank has a traced training step (the timeline needs the stream check: drop --no-stream-check)"
        return out
    tokens = cfg.global_batch_size * cfg.model.seq_length
    try:
        result = timeline.schedule(traces, device, step_flops(cfg.model, tokens) / world, device.peak(dtype))
    except timeline.TimelineStuck as err:  # the trace orders ops so that no rank can go on
        out["note"] = f"the timeline cannot place the step: {err}"
        return out
    out["step_s"], out["ranks"] = result["step_s"], result["ranks"]
    out["tokens_per_s_per_device"] = tokens / out["step_s"] / world if out["step_s"] else None
    return out


def predict(
    argv: list[str],
    device,
    world: int,
    ranks: list[int] | None = None,
    ranks_per_node: int | None = None,
    processes: int | None = None,
) -> dict:
    """The dry run of pretrain_gpt.py's `argv` on `world` ranks and its timeline on `device` ("a100",
    "h100", "h200", "cpu", or a devices.Device): {"device", "device_name", "dtype", "step_s",
    "tokens_per_s_per_device", "note", "ranks": [{"rank", "step_s", "mfu", "compute_s",
    "exposed_comm_s", "bubble_s", "host_s", "top_exposed", "trace_tflop"}]} (docs/dry_run.md)."""
    from megazero.dry_run.job import job_config, simulate

    model = devices.device(device) if isinstance(device, str) else device  # fails before anything runs
    local = ranks_per_node or (model.gpus_per_node if model.kind == "gpu" else world)
    cfg = job_config(argv, world, local)
    runs = simulate(
        argv,
        world,
        ranks,
        local_world=local,
        processes=processes,
        device_kind="cpu" if model.kind == "cpu" else "cuda",
        save=False,
    )
    failed = [f"rank {r.rank}: {r.error}" for r in runs if r.error is not None]
    if failed:
        raise RuntimeError("the dry run failed: " + "; ".join(failed))
    return timeline_of(runs, cfg, world, model)


def issued_ops(records: list) -> int:
    """How many ops the timeline issues for one rank's step records, each paying the device's
    launch_us: its kernels, host ops, copies, collectives and p2p batches (not its events, waits and
    syncs, which cost no issue)."""
    return sum(1 for r in records if r[0] in ("k", "h", "x", "c", "p"))


def fitted_launch_us(traces: dict[int, dict], device, measured_s: float) -> tuple[float, float, int]:
    """The CPU's host cost per issued op from one real step: the one-rank job whose `traces` (its
    rank's step, speed.step_traces) measured `measured_s` a step. On the CPU one thread issues and
    runs every op, so the timeline's step is the device's work (the step timed at launch_us 0) plus
    launch_us per issued op; the launch_us returned makes it equal the measured step (0 where the
    device's work alone is slower). -> (launch_us, the device's work in seconds, issued ops).
    What it holds beyond the kernels' own calibrated time: the Python of the loop, the schedule, the
    optimizer and the hooks, autograd's engine, the views and metadata ops the trace leaves out, and
    each kernel's cost in a step beyond its back-to-back calibration (cold caches, fresh outputs)."""
    if len(traces) != 1 or device.kind != "cpu":
        raise ValueError(f"fitted_launch_us takes one CPU rank's step, got {len(traces)} rank(s) on {device.kind}")
    work = timeline.schedule(traces, dataclasses.replace(device, launch_us=0.0))["step_s"]
    ops = issued_ops(next(iter(traces.values()))["records"])
    if ops == 0:
        raise ValueError("the traced step issues no op: nothing to fit launch_us on")
    return max(0.0, (measured_s - work) / ops * 1e6), work, ops


def timeline_text(result: dict) -> str:
    """The lines tools/dry_run.py prints after the table."""
    lines = [
        f"timeline on {result['device_name']}: step {_ms(result['step_s'])} ms"
        + (
            f", {result['tokens_per_s_per_device']:,.0f} tokens/s/device"
            if result.get("tokens_per_s_per_device")
            else ""
        )
    ]
    if result.get("note"):
        return "\n".join(lines + [result["note"]])
    lines.append(
        f"{'rank':>6} {'step ms':>9} {'MFU':>6} {'compute':>9} {'exposed comm':>12} {'bubble':>9} {'host':>9}  (ms)"
    )
    for r in result["ranks"]:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        lines.append(
            f"{r['rank']:>6} {_ms(r['step_s']):>9} {mfu:>6} "
            + " ".join(f"{_ms(r[k]):>{w}}" for k, w in zip(ITEMS, (9, 12, 9, 9)))
        )
    for r in result["ranks"]:
        for i, op in enumerate(r["top_exposed"]):
            head = f"rank {r['rank']} most exposed:" if i == 0 else ""
            lines.append(f"{head:>22} {_ms(op['exposed_s']):>8} ms  {op['op']} x{op['calls']} at {op['site']}")
    return "\n".join(lines)


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.3f}"
