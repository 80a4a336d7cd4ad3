"""The dry run's cross-rank checks: what would hang or fail on a cluster, found from every rank's
trace (megazero.dry_run.RankRun), each finding one line naming where.

- collectives: every member of a group issues the same collectives in the same order, with equal
  op, dtype, element count, reduce op and root (NCCL matches ops by position alone: a mismatch is a
  hang or corrupt data, reported by its watchdog without a rank's name);
- p2p: the k-th send from rank a to rank b meets b's k-th receive from a, of the same shape and dtype;
- placement: a rank that stopped because a host tensor met a device tensor, at the line that did it;
- host reads: a rank that read a device value (.item(), .tolist(), nonzero) other than through
  megazero.core.host_read, at its line;
- streams: the stream checker's violations (megazero.core.stream_check, run in every rank: a race
  between the modelled streams or a use-after-free, naming the tensor and both call sites), one
  line per rank's first violation, ranks with the same first one in the same line.

Groups whose members were not all simulated (`--ranks`) are checked among the simulated ones.
"""

from __future__ import annotations

import re
from collections import defaultdict

from megazero.core import source_paths


def describe(entry) -> str:
    """An op as a finding names it: `all_reduce float32 x1024 (sum) at engine.py:268`."""
    if entry is None:
        return "nothing (its sequence ends there)"
    if entry.op in ("send", "recv"):
        return f"{entry.op} {entry.dtype} {list(entry.shape)} at {entry.site}"
    extra = "".join(f" ({v})" for v in (entry.reduce_op,) if v) + (
        f" root {entry.root}" if entry.root is not None else ""
    )
    return f"{entry.op} {entry.dtype} x{entry.numel}{extra} at {entry.site}"


def collective_sequences(runs) -> dict[tuple[str, tuple[int, ...]], dict[int, list]]:
    """(group name, its ranks) -> {rank: that rank's collectives on it, in order}."""
    seqs: dict = defaultdict(dict)
    for run in runs:
        for entry in run.entries:
            if entry.op not in ("send", "recv"):
                seqs[(entry.group, entry.ranks)].setdefault(run.rank, []).append(entry)
    for run in runs:  # a member that issued nothing on a group its peers used
        for (name, ranks), by_rank in seqs.items():
            if run.rank in ranks and run.rank not in by_rank and run.error is None:
                by_rank[run.rank] = []
    return seqs


def check_collectives(runs) -> list[str]:
    """One line per group whose members disagree, at the first position where they do."""
    problems = []
    for (name, ranks), by_rank in sorted(collective_sequences(runs).items()):
        members = sorted(by_rank)
        first = members[0]
        for other in members[1:]:
            a, b = by_rank[first], by_rank[other]
            for i in range(max(len(a), len(b))):
                x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
                if x is None or y is None or x.signature() != y.signature():
                    problems.append(
                        f"group {name} {list(ranks)}: collective #{i + 1} differs: rank {first} "
                        f"issued {describe(x)}; rank {other} issued {describe(y)}"
                    )
                    break
    return problems


def check_p2p(runs) -> list[str]:
    """One line per pair of ranks whose sends and receives do not meet."""
    simulated = {run.rank for run in runs}
    sends, recvs = defaultdict(list), defaultdict(list)
    for run in runs:
        for entry in run.entries:
            if entry.op == "send":
                sends[(run.rank, entry.peer)].append(entry)
            elif entry.op == "recv":
                recvs[(entry.peer, run.rank)].append(entry)
    problems = []
    for src, dst in sorted(set(sends) | set(recvs)):
        if src not in simulated or dst not in simulated:
            continue
        a, b = sends.get((src, dst), []), recvs.get((src, dst), [])
        for i in range(max(len(a), len(b))):
            x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
            if x is None or y is None or (x.dtype, x.shape) != (y.dtype, y.shape):
                problems.append(
                    f"p2p rank {src} -> rank {dst}: message #{i + 1} does not meet: rank {src} "
                    f"issued {describe(x)}; rank {dst} issued {describe(y)}"
                )
                break
    return problems


_DEVICE_MIX = re.compile(
    r"(Expected all tensors to be on the same device|is not on the expected device"
    r"|is on cpu but group|Tensor on device cpu)"
)
# A device value read by the host without megazero.core.host_read (meta has no values to give).
_HOST_READ = re.compile(
    r"(cannot be called on meta tensors|Cannot copy out of meta tensor|torch.nonzero\(\)"
    r"|data-dependent)"
)
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
# The layers a traceback passes through on its way from the code that asked (the site) to torch.
_WRAPPERS = (
    "megazero/core/comm.py",
    "megazero/zero/quantized_comm.py",
    "megazero/core/stream_check.py",
    "megazero/core/op_access.py",
    "megazero/core/host_read.py",
)


def _site_of(detail: str) -> str:
    """The last frame of megazero's own code in a traceback, the collective wrappers' callers
    standing for them (their device check is where a host tensor meets the group's device)."""
    site = "?"
    for path, line in _FRAME.findall(detail or ""):
        inside = source_paths.repository_path(path)
        if inside is not None and inside not in _WRAPPERS and not inside.startswith("megazero/dry_run/"):
            site = f"{inside}:{line}"  # the simulator itself (megazero/dry_run/) is no site
    return site


def check_ranks_ran(runs) -> list[str]:
    """One line per rank that stopped: a misplaced tensor at its line, or the error it raised."""
    problems = []
    for run in runs:
        if run.error is None:
            continue
        if _DEVICE_MIX.search(run.error) or _DEVICE_MIX.search(run.detail or ""):
            problems.append(
                f"rank {run.rank}: a tensor made on the host meets a device tensor at "
                f"{_site_of(run.detail)} ({run.error})"
            )
        elif _HOST_READ.search(run.error):
            problems.append(
                f"rank {run.rank}: the host reads a device value at {_site_of(run.detail)} without "
                f"megazero.core.host_read (a host sync the step does not list; {run.error[:80]})"
            )
        else:
            problems.append(f"rank {run.rank}: stopped at {_site_of(run.detail)}: {run.error}")
    return problems


def check_streams(runs) -> list[str]:
    """One line per first stream-check violation, naming the ranks that hit it first and how many
    violations (and distinct ones) they counted in all: a race repeats every step, in every bucket."""
    first: dict[str, list] = {}
    for run in runs:
        found = (run.stream_check or {}).get("found") or []
        if found:
            first.setdefault(found[0], []).append(run)
    problems = []
    for message, hit in first.items():
        ranks = ", ".join(str(run.rank) for run in hit)
        total = sum(run.stream_check["violations"] for run in hit)
        distinct = len({m for run in hit for m in run.stream_check["found"]})
        problems.append(
            f"rank{'s' if len(hit) > 1 else ''} {ranks}: {message} (the first of {total} "
            f"violations, {distinct} distinct, on {'these ranks' if len(hit) > 1 else 'it'})"
        )
    return problems


def check_all(runs) -> list[str]:
    return check_ranks_ran(runs) + check_collectives(runs) + check_p2p(runs) + check_streams(runs)
