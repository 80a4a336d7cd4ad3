"""How a record of a step at m0 and at m0 + p microbatches extends to m = m0 + k p: a sequence with
the block(s) the second run inserts repeated k times (one contiguous block: `repeated`; a block at
each of two places, numbers alike counted a + k (b - a): `blocks_repeated`; difflib's inserts at up
to four places: `inserts_repeated`), and the traced step's events renumbered around its repeated
block (`extend_trace`). Pure list arithmetic: steady_state.py decides which records extend and when
a rank is simulated in full; this module owns only how, and raises NotPeriodic where the two runs
are not one record with blocks inserted."""

from __future__ import annotations

import difflib


class NotPeriodic(Exception):
    """The two reduced runs do not differ by one repeated block (the message says where)."""


def repeated(a: list, b: list, k: int, what: str) -> list:
    """`a` with the block `b` inserts into it repeated k times where b has it: b must be a with one
    contiguous block inserted (found at their longest common prefix; empty when a == b)."""
    extra = len(b) - len(a)
    if extra < 0:
        raise NotPeriodic(f"{what}: the run with more microbatches has fewer ({len(b)} < {len(a)})")
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    if a[i:] != b[i + extra :]:
        raise NotPeriodic(f"{what}: the runs differ past one inserted block (at #{i + 1})")
    return a[:i] + b[i : i + extra] * k + a[i:]


def blocks_repeated(a: list, b: list, k: int, what: str) -> list:
    """`a` with the blocks `b` inserts into it repeated k times where b has them: b must be a with a
    block inserted at each of two places at most (a traced step's records grow where the step starts,
    a slot per microbatch, and by the steady block), found from the two ends: their common start and
    common end (where a record may differ only in its numbers, counted a + k (b - a): a kernel over
    every microbatch's loss, its bytes; a wait on an event recorded before the step), and between
    them a's records in b after the shortest first block."""
    extra = len(b) - len(a)
    if extra < 0:
        raise NotPeriodic(f"{what}: the run with more microbatches has fewer ({len(b)} < {len(a)})")
    lo = 0
    while lo < len(a) and (a[lo] == b[lo] or _numbers_apart(a[lo], b[lo])):
        lo += 1
    hi = 0
    while hi < len(a) - lo and (a[-1 - hi] == b[-1 - hi] or _numbers_apart(a[-1 - hi], b[-1 - hi])):
        hi += 1
    middle, grown = a[lo : len(a) - hi], b[lo : len(b) - hi]
    first = next((n for n in range(extra + 1) if grown[n : n + len(middle)] == middle), None)
    if first is None:
        raise NotPeriodic(f"{what}: the runs differ past two inserted blocks (at #{lo + 1})")
    start = [_linear_record(u, v, k) for u, v in zip(a[:lo], b[:lo])]
    end = [_linear_record(u, v, k) for u, v in zip(a[len(a) - hi :], b[len(b) - hi :])]
    return start + grown[:first] * k + middle + grown[first + len(middle) :] * k + end


def inserts_repeated(a: list, b: list, k: int, what: str, places: int = 4) -> list:
    """`a` with what `b` inserts into it repeated k times at each place: b must be a with blocks
    inserted at `places` places at most (difflib's alignment; a step's allocator requests grow where
    it starts, a request per microbatch, by the steady block, and where it ends, a free per
    microbatch). Where a third run is made, its requests must equal these at k = 2."""
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            out += a[i1:i2]
        elif op != "insert" or places == 0:
            raise NotPeriodic(f"{what}: the runs differ past inserted blocks (at #{i1 + 1})")
        else:
            out += b[j1:j2] * k
            places -= 1
    return out


def _linear_record(u, v, k: int):
    return u if u == v else tuple(linear(x, y, k) if x != y else x for x, y in zip(u, v))


def _numbers_apart(x, y) -> bool:
    """Two records alike but for some of their numbers."""
    return (
        type(x) is tuple
        and type(y) is tuple
        and len(x) == len(y)
        and all(u == v or (type(u) in (int, float) and type(v) in (int, float)) for u, v in zip(x, y))
    )


def linear(a, b, k: int):
    return a + k * (b - a)


def same(a, b, what: str):
    if a != b:
        raise NotPeriodic(f"{what} differs between the reduced runs ({a} against {b})")
    return a


# --- the op trace of the last step (megazero.dry_run.trace), for the timeline ------------------------
def _event_base(records: list) -> int:
    """The events recorded before the step (its first record's serial - 1; 0 without one)."""
    return next((r[2] - 1 for r in records if r[0] == "r"), 0)


def _relative(records: list) -> list:
    """The records with each event a wait names counted back: from the step's latest record (0: the
    latest) for one recorded in the step, from the step's start (-1: the last before it) for one
    recorded before; None for an event never recorded. A steady block's waits then read alike in
    every repetition, where their serials grow."""
    out, last = [], _event_base(records)
    base = last
    for r in records:
        if r[0] == "r":
            last += 1
            if r[2] != last:
                raise NotPeriodic(f"the traced step's events are not numbered in order (#{r[2]} for #{last})")
            out.append(("r", r[1]))
        elif r[0] in ("w", "e"):
            event = r[-1]
            out.append((*r[:-1], None if event == 0 else last - event if event > base else event - base - 1))
        else:
            out.append(r)
    return out


def _absolute(records: list, base: int) -> list:
    out, last = [], base
    for r in records:
        if r[0] == "r":
            last += 1
            out.append((*r, last))
        elif r[0] in ("w", "e"):
            back = r[-1]
            out.append((*r[:-1], 0 if back is None else last - back if back >= 0 else base + back + 1))
        else:
            out.append(r)
    return out


def extend_trace(a: dict | None, b: dict | None, k: int) -> dict | None:
    """The last step's trace with the block the second run inserts repeated k times; its events
    numbered on from the events before the step, a + k (b - a)."""
    if a is None or b is None:
        return same(a, b, "the op trace")
    base = linear(_event_base(a["records"]), _event_base(b["records"]), k)
    records = blocks_repeated(_relative(a["records"]), _relative(b["records"]), k, "the traced step")
    return {
        **a,
        "records": _absolute(records, base),
        "threads": same(a["threads"], b["threads"], "the trace's host threads"),
        "streams": same(a["streams"], b["streams"], "the trace's streams"),
    }
