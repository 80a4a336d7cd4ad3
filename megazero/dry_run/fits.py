"""Does the job fit the GPU: each simulated rank's reserved peak (the caching allocator's segments, what
the GPU must hold) against the memory of a named GPU (gpus.toml, each figure from its vendor's
datasheet), and for the rank that needs the most one line saying by how much it fits or misses and the
flags that would lower it (megazero.training.out_of_memory's, for each owner holding a quarter or more
of its peak). Reads the report (megazero.dry_run.report); touches nothing of the simulation."""

from __future__ import annotations

import tomllib
from pathlib import Path

from megazero.training.out_of_memory import lowering_flags

GPUS_FILE = Path(__file__).with_name("gpus.toml")
MiB = 2**20
# The owner holding the most at the peak -> the phase whose lowering flags apply to it.
_PHASE_OF_OWNER = {
    "activations": "forward",
    "backward": "backward",
    "communication": "backward",
    "workspace": "forward",
    "model states": "optimizer step",
}


def gpus() -> dict[str, dict]:
    """--gpu name -> {"name", "memory_gb", "source"}."""
    with GPUS_FILE.open("rb") as f:
        return tomllib.load(f)


def capacity_bytes(gpu: dict) -> int:
    return int(gpu["memory_gb"] * 10**9)


def verdict(result: dict, key: str, cfg) -> dict:
    """The report's `gpu` field for GPU `key` (gpus.toml): per rank its reserved peak and whether it
    fits; the worst rank (the largest reserved peak) and the advice line. `cfg`: the job's TrainConfig
    (None: generic advice)."""
    gpu = gpus()[key]
    capacity = capacity_bytes(gpu)
    rows = [
        {
            "rank": r["rank"],
            "stands_for": r["stands_for"],
            "reserved": r["memory"]["reserved_peak"],
            "fits": r["memory"]["reserved_peak"] <= capacity,
        }
        for r in result["ranks"]
        if r.get("memory")
    ]
    out = {
        "key": key,
        "name": gpu["name"],
        "capacity": capacity,
        "source": gpu["source"],
        "ranks": rows,
        "fits": bool(rows) and all(row["fits"] for row in rows),
        "worst_rank": None,
        "advice": None,
    }
    if not rows:
        return out
    worst = max(rows, key=lambda row: row["reserved"])
    out["worst_rank"] = worst["rank"]
    record = next(r for r in result["ranks"] if r["rank"] == worst["rank"])
    owners = record["memory"].get("peak_by_owner") or {"activations": 1}
    # the owners holding a quarter of the peak or more, the largest first: their lowering flags
    large = sorted((o for o in owners if owners[o] >= sum(owners.values()) / 4), key=owners.get, reverse=True)
    gap = (capacity - worst["reserved"]) / MiB
    ranks_over = sum(row["stands_for"] for row in rows if not row["fits"])
    ranks_all = sum(row["stands_for"] for row in rows)
    where = f"rank {worst['rank']} reserves {worst['reserved'] / MiB:,.0f} MiB of the {gpu['name']}'s {capacity / MiB:,.0f} MiB"
    if worst["fits"]:
        out["advice"] = f"{where}: every rank fits, {gap:,.0f} MiB to spare on the fullest"
    else:
        flags = []
        for owner in large:
            flags += [
                f
                for f in lowering_flags(
                    _PHASE_OF_OWNER.get(owner, "training step"), cfg, on_host=False, math_attention=False
                )
                if f not in flags
            ]
        out["advice"] = (
            f"{where}: {-gap:,.0f} MiB over ({ranks_over} of the {ranks_all} ranks checked do not "
            f"fit; most of it {' and '.join(large)}); lower it with {', '.join(flags)}"
        )
    return out


def verdict_text(fit: dict) -> str:
    """The lines printed after the table."""
    lines = [f"fits {fit['name']} ({fit['capacity'] / MiB:,.0f} MiB; {fit['source']})?"]
    for row in fit["ranks"]:
        share = row["reserved"] / fit["capacity"]
        lines.append(
            f"{row['rank']:>6}  reserved {row['reserved'] / MiB:>10,.0f} MiB  {share:>6.1%}  "
            f"{'fits' if row['fits'] else 'DOES NOT FIT'}"
        )
    if fit["advice"] is not None:
        lines.append(fit["advice"])
    return "\n".join(lines)
