"""The dry run's output: one JSON document (schema "megazero.dry_run/1", documented field by field in
docs/dry_run.md) and the table printed from it."""

from __future__ import annotations

import dataclasses

import torch

from megazero.parallel.pipeline.zero_bubble import ZERO_BUBBLE_SCHEDULES, zero_bubble_schedule

SCHEMA = "megazero.dry_run/1"

_ITEMSIZE = {}


def _itemsize(dtype: str) -> int:
    if dtype not in _ITEMSIZE:
        _ITEMSIZE[dtype] = getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 0
    return _ITEMSIZE[dtype]


def _op(entry) -> dict:
    out = dataclasses.asdict(entry)
    return {**out, "ranks": list(entry.ranks), "shape": list(entry.shape)}


def last_step(run) -> list:
    """The ops of the run's last training step (steady state: the first step also records traces)."""
    if not run.step_ends:
        return []
    start = run.step_ends[-2] if len(run.step_ends) > 1 else 0
    return run.entries[start : run.step_ends[-1]]


def per_group(entries) -> dict[str, dict]:
    """group name -> {"calls", "bytes"}: the payload each op hands the backend (a p2p: its tensor)."""
    out: dict[str, dict] = {}
    for e in entries:
        row = out.setdefault(e.group, {"calls": 0, "bytes": 0})
        row["calls"] += 1
        row["bytes"] += e.numel * _itemsize(e.dtype)
    return dict(sorted(out.items()))


def rank_record(run, stands_for: int = 1) -> dict:
    coords = dict(zip(("tp", "dp", "pp"), run.coords)) if run.coords is not None else None
    return {
        "rank": run.rank,
        "coords": coords,
        "stands_for": stands_for,
        "error": run.error,
        "steps": len(run.step_ends),
        "skipped_steps": run.skipped_steps,
        "ops": [_op(e) for e in run.entries],
        "step_comm": per_group(last_step(run)),
        "host_reads": list(run.host_reads),
        "memory": run.memory,
        "engine_model_states": run.model_states,
        "stream_check": None
        if run.stream_check is None
        else {k: run.stream_check[k] for k in ("semantics", "side_ops", "violations")},
        "steady_state": run.steady_state,
    }


def report(
    runs,
    problems: list[str],
    world: int,
    seconds: float,
    stands_for: dict | None = None,
    microbatches: dict | None = None,
) -> dict:
    """`stands_for`: simulated rank -> ranks of the job it represents (its role's; None: itself);
    `microbatches`: how the step's microbatches were simulated (steady_state.Plan.record)."""
    return {
        "schema": SCHEMA,
        "world_size": world,
        "seconds": round(seconds, 2),
        "ok": not problems,
        "problems": list(problems),
        "microbatches": microbatches,
        "ranks": [rank_record(r, (stands_for or {}).get(r.rank, 1)) for r in runs],
        "gpu": None,
        "timeline": None,
    }


def _mib(x) -> str:
    return f"{x / 2**20:,.1f}" if x is not None else "-"


def table(result: dict) -> str:
    verdict = "all checks passed" if result["ok"] else f"{len(result['problems'])} problem(s)"
    lines = [f"dry run: {len(result['ranks'])} of {result['world_size']} ranks in {result['seconds']:.1f} s; {verdict}"]
    steps = result.get("microbatches")
    if steps:
        lines.append(f"microbatches: {steps['note']}")
    lines += [
        f"rank {r['rank']}: {r['steady_state']['why']}"
        for r in result["ranks"]
        if (r.get("steady_state") or {}).get("why")
    ]
    lines += [  # (steady_state.REPLAYED: the reserved figures are the full count's; said only where not)
        f"rank {r['rank']}: reserved memory counted {r['steady_state']['reserved']}"
        for r in result["ranks"]
        if not (r.get("steady_state") or {}).get("reserved", "replayed").startswith("replayed")
    ]
    lines += [
        "",
        f"{'rank':>6} {'tp':>3} {'dp':>4} {'pp':>3} {'x':>4} {'peak MiB':>10} {'reserved':>10} "
        f"{'planner':>10} {'ratio':>6} {'host MiB':>9}  "
        f"at the peak (MiB): model states / activations / backward / communication / workspace",
    ]
    for r in result["ranks"]:
        c = r["coords"] or {"tp": "-", "dp": "-", "pp": "-"}
        m = r["memory"] or {}
        peak, plan = m.get("peak"), (m.get("planner") or {}).get("total")
        ratio = f"{plan / peak:.2f}" if peak and plan else "-"
        owners = " / ".join(_mib(v) for v in (m.get("peak_by_owner") or {}).values()) or "-"
        host = (m.get("host") or {}).get("peak")
        lines.append(
            f"{r['rank']:>6} {c['tp']:>3} {c['dp']:>4} {c['pp']:>3} {r['stands_for']:>4} {_mib(peak):>10} "
            f"{_mib(m.get('reserved_peak')):>10} {_mib(plan):>10} {ratio:>6} {_mib(host):>9}  {owners}"
        )
    lines += [
        "",
        f"{'rank':>6}  {'ops':>6}  {'stream ops':>10}  {'races':>5}  {'skipped':>7}  "
        f"collectives per step by group (calls, MiB)",
    ]
    for r in result["ranks"]:
        groups = ", ".join(f"{g} {v['calls']}x {v['bytes'] / 2**20:.2f}" for g, v in r["step_comm"].items())
        streams = r["stream_check"] or {"side_ops": "-", "violations": "-"}
        lines.append(
            f"{r['rank']:>6}  {len(r['ops']):>6}  {streams['side_ops']:>10}  {streams['violations']:>5}  "
            f"{r['skipped_steps'] if r['skipped_steps'] is not None else '-':>7}  {groups or '-'}"
        )
    return "\n".join(lines)


def schedule_text(cfg, world: int) -> str | None:
    """A zero-bubble pipeline schedule's lists of actions per stage for the job's step, with the ideal
    timeline's idle fraction and each stage's peak of activations and waiting W inputs
    (ListSchedule.describe); None under the other schedules."""
    par = cfg.parallel
    if par.schedule not in ZERO_BUBBLE_SCHEDULES or par.pipeline_parallel < 2:
        return None
    dp = world // (par.tensor_parallel * par.pipeline_parallel * par.context_parallel)
    lists = zero_bubble_schedule(par.schedule, par.pipeline_parallel, par.virtual_stages, cfg.num_microbatches(dp))
    return lists.describe()
