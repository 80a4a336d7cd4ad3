"""How a record of a step at m0 and at m0 + p microbatches extends to m = m0 + k p: a sequence with
the block(s) the second run inserts repeated k times (one contiguous block: `repeated`; a block at
each of two places, numbers alike counted a + k (b - a): `blocks_repeated`; blocks inserted at up
to four places and runs of a number moved at up to four, found in one pass linear in the logs, the
numbers and the runs' lengths counted a + k (b - a): `inserts_repeated`), and the traced step's
events renumbered around its repeated block (`extend_trace`). Pure list arithmetic: steady_state.py
decides which records extend and when a rank is simulated in full; this module owns only how, and
raises NotPeriodic where the two runs are not one record with blocks inserted."""

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


def inserts_repeated(a: list, b: list, k: int, what: str, places: int = 4) -> tuple[list, bool]:
    """`a` with what `b` inserts into it repeated k times at each place, and each run of a repeated
    number that b moves counted a + k (b - a), its number and its length; and whether one moved. b
    must be a with blocks inserted at `places` places at most (a step's allocator requests grow where
    it starts, a request per microbatch, by the steady block, and where it ends, a free per
    microbatch) and runs moved at `places` places at most (the last stage's stacked losses, 4 and 8
    bytes a microbatch; the frees of the blocks held a microbatch, whose place among the live blocks
    moves as the losses after them grow). Found in one pass (`_pieces`); where that finds none and
    the logs are short, difflib's inserts. A number that moves is a line through two points: the
    caller must check it against a third run (its log must equal these at k = 2)."""
    try:
        pieces = _pieces(a, b, what, places)
    except NotPeriodic:
        if len(a) + len(b) > DIFFLIB_AT_MOST:
            raise
        pieces = _difflib_inserts(a, b, what, places)
    out, moved = [], False
    for kind, x, y in pieces:
        if kind == "moved":
            out += [linear(x[0], y[0], k)] * linear(len(x), len(y), k)
            moved = True
        else:
            out += y * k if kind == "insert" else x
    return out, moved


DIFFLIB_AT_MOST = 4000  # entries of the two logs: difflib's matching grows faster than the logs
LOOKAHEAD = 3  # runs moved past a place, when choosing what b inserts there


def _pieces(a: list, b: list, what: str, places: int) -> list[tuple]:
    """b as pieces of a, in order: ("equal", a's, b's), ("insert", [], b's), ("moved", a's run of one
    number, b's run of another of its sign, at least as long). From the start, at each place the two
    part: of a run moved there and each insert (up to the entries b has left over), the one after
    which a's entries follow furthest (past up to LOOKAHEAD moved runs), a tie to the insert that
    repeats b's entries just before it (a steady block follows one like it). Linear in the logs but
    for each place's candidates. (difflib, matching the longest blocks first, cut the last stage's
    steady block where single requests of it matched a's, and had no moved runs.)"""
    pieces, i, j, inserts, moves = [], 0, 0, places, places
    while True:
        run = _run(a, i, b, j)
        if run:
            pieces.append(("equal", a[i : i + run], b[j : j + run]))
        i, j = i + run, j + run
        left = (len(b) - j) - (len(a) - i)
        if i == len(a) or left < 0:
            break
        best, choice = 0, None
        move = _moved(a, i, b, j, left) if moves else None
        if move:
            best = move[0] + _reach(a, i + move[0], b, j + move[1], left - move[1] + move[0])
            choice = ("moved", move)
        for n in range(1, left + 1) if inserts else ():
            if b[j + n] == a[i] or _moved(a, i, b, j + n, left - n):
                reach = _reach(a, i, b, j + n, left - n)
                if reach > best or (reach == best and choice[0] == "insert" and _repeats(b, j, n)):
                    best, choice = reach, ("insert", n)
        if choice is None:
            break
        if choice[0] == "insert":
            pieces.append(("insert", [], b[j : j + choice[1]]))
            j, inserts = j + choice[1], inserts - 1
        else:
            (na, nb) = choice[1]
            pieces.append(("moved", a[i : i + na], b[j : j + nb]))
            i, j, moves = i + na, j + nb, moves - 1
    if i < len(a) or (j < len(b) and inserts == 0):
        raise NotPeriodic(f"{what}: the runs differ past inserted blocks and moved numbers (at #{i + 1})")
    return pieces + ([("insert", [], b[j:])] if j < len(b) else [])


def _moved(a: list, i: int, b: list, j: int, left: int) -> tuple[int, int] | None:
    """(its length in a, in b) where a's run of one number at i and b's at j are alike but for the
    number (requests both, or frees both) and b's is no shorter, by no more than `left`."""
    x, y = a[i], b[j]
    if type(x) is not int or type(y) is not int or x == y or (x >= 0) != (y >= 0):
        return None
    na = nb = 1
    while i + na < len(a) and a[i + na] == x:
        na += 1
    while j + nb < len(b) and b[j + nb] == y:
        nb += 1
    return (na, nb) if 0 <= nb - na <= left else None


def _reach(a: list, i: int, b: list, j: int, left: int) -> int:
    """How many of a's entries from i follow b's from j, past up to LOOKAHEAD moved runs."""
    total = 0
    for _ in range(LOOKAHEAD + 1):
        run = _run(a, i, b, j)
        total, i, j = total + run, i + run, j + run
        move = _moved(a, i, b, j, left) if i < len(a) else None
        if move is None:
            break
        total, i, j, left = total + move[0], i + move[0], j + move[1], left - move[1] + move[0]
    return total


def _repeats(b: list, j: int, n: int) -> bool:
    return n <= j and b[j - n : j] == b[j : j + n]


def _difflib_inserts(a: list, b: list, what: str, places: int) -> list[tuple]:
    pieces = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            pieces.append(("equal", a[i1:i2], a[i1:i2]))
        elif op != "insert" or places == 0:
            raise NotPeriodic(f"{what}: the runs differ past inserted blocks (at #{i1 + 1})")
        else:
            pieces.append(("insert", [], b[j1:j2]))
            places -= 1
    return pieces


def _run(a: list, i: int, b: list, j: int) -> int:
    """How many of a[i:] and b[j:] agree from their start (slices compared whole, doubling and halving:
    the comparing is the C loop's)."""
    n = min(len(a) - i, len(b) - j)
    lo, step = 0, 8
    while lo < n:
        hi = min(n, lo + step)
        if a[i + lo : i + hi] == b[j + lo : j + hi]:
            lo, step = hi, step * 2
        elif hi - lo == 1:
            return lo
        else:
            step = (hi - lo) // 2
    return n


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
