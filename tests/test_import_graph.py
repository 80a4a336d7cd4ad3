"""megazero's import graph, derived from the source, runs one way: the direction docs/design.md states.

Every module of megazero/, models/ and parallel/ (installed as megazero.models and megazero.parallel) is
parsed with ast, and every import in it counts: at module level or inside a function, absolute or
relative, and `importlib.import_module("megazero...")` with a literal name. The modules fall into rooms:
a package directly under megazero (core, config, zero, ops, ...) is a room with all its subpackages
(zero/stage3 is zero's), the modules left at the top (testing.py) are the room `megazero`,
and the compiled extensions setup.py builds (megazero._C, megazero._quant) are ops', whose modules load
them. The table of what each room may import is read from docs/design.md, so the page and this test
cannot drift apart.

Checked: the table runs one way (each row names only rooms below it) and places every room; every
import between rooms is in the table (the failure names file:line and the import), and every edge the
table lists is made by some module, so the page stays the diagram of the code; no two rooms import each
other; no cycle between modules; every import of ours names a module that exists (a function-level
import left at an old path after a move would otherwise pass until that function runs).

Planted to see them fail: `from megazero.training import train` inside a function of zero/storage.py
(zero -> megazero: named with its line, and the room and module cycles it closes, both named),
`import megazero.zero.engine` in ops/quantize.py (ops -> zero), `from megazero.zero.stage3_units import
Unit` in a function (an old path), and in the table `parallel -> zero` (points up) and `data -> ops`
(an import no module makes).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = {
    "megazero": REPO / "megazero",
    "megazero.models": REPO / "models",
    "megazero.parallel": REPO / "parallel",
}
DIRECTION_MARK = "<!-- import-direction: checked by tests/test_import_graph.py -->"


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every .py of ours."""
    modules = {}
    for package, folder in SOURCE_ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _extensions() -> set[str]:
    """The compiled modules setup.py builds from csrc/ (no Python source to parse)."""
    return set(re.findall(r'Extension\(\s*"(megazero\.[\w.]+)"', (REPO / "setup.py").read_text()))  # any layout


MODULES = _modules()
EXTENSIONS = _extensions()
KNOWN = set(MODULES) | EXTENSIONS


def room(module: str) -> str:
    if module in EXTENSIONS:
        return "ops"
    parts = module.split(".")
    if len(parts) >= 2 and MODULES.get(f"megazero.{parts[1]}", Path()).name == "__init__.py":
        return parts[1]
    return "megazero"


def _imports(module: str, path: Path):
    """(line, the module imported, that module if it exists else None) for every import of megazero in
    one module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import sub` loads the submodule when there is one, else an attribute of pkg
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in KNOWN else base for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id == "__import__")
            )
        ):
            names = [node.args[0].value]
        for name in names:
            if name == "megazero" or name.startswith("megazero."):
                yield node.lineno, name, name if name in KNOWN else None


EDGES = [
    (module, line, name, target) for module, path in MODULES.items() for line, name, target in _imports(module, path)
]


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(REPO)}:{line}"


def direction_table() -> dict[str, set[str]]:
    """docs/design.md's table, in its order: the fenced block after DIRECTION_MARK, one
    `room -> rooms it imports` per line, the rooms that import most first."""
    text = (REPO / "docs" / "design.md").read_text()
    assert DIRECTION_MARK in text, f"docs/design.md lost its direction table (the line {DIRECTION_MARK})"
    block = text.split(DIRECTION_MARK, 1)[1].split("```", 2)[1]
    table = {}
    for line in block.splitlines()[1:]:
        if line.strip():
            source, arrow, targets = line.partition("->")
            assert arrow, f"docs/design.md direction table: {line!r} is not `room -> room, room`"
            table[source.strip()] = {t for t in re.split(r"[,\s]+", targets) if t and t != "nothing"}
    return table


def room_graph() -> dict[str, dict[str, list[str]]]:
    """room -> imported room -> where (file:line and the import), from the source."""
    graph: dict[str, dict[str, list[str]]] = {}
    for m, line, name, target in EDGES:
        if target and room(m) != room(target):
            graph.setdefault(room(m), {}).setdefault(room(target), []).append(f"{_where(m, line)}: {name}")
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_documented_table_runs_one_way_over_every_room():
    """Each row may only name rooms listed below it: the table's order is the direction."""
    table = direction_table()
    rooms = {room(m) for m in KNOWN}
    assert rooms - set(table) == set(), f"rooms missing from docs/design.md's direction table: {rooms - set(table)}"
    named = set(table) | set().union(*table.values())
    assert named - rooms == set(), f"docs/design.md's direction table names rooms that do not exist: {named - rooms}"
    order = list(table)
    upward = [
        f"{source} -> {target}"
        for source, targets in table.items()
        for target in targets
        if order.index(target) <= order.index(source)
    ]
    assert not upward, f"docs/design.md's direction table points up (or at itself): {upward}"


def test_every_import_of_ours_names_an_existing_module():
    stale = [f"{_where(m, line)}: {name}" for m, line, name, target in EDGES if target is None]
    assert not stale, "imports of modules that do not exist:\n" + "\n".join(stale)


def test_every_import_between_rooms_goes_the_documented_way():
    table = direction_table()
    against = [
        where
        for source, targets in room_graph().items()
        for target, places in targets.items()
        if target not in table.get(source, set())
        for where in places
    ]
    assert not against, (
        "imports against docs/design.md's direction table (if the direction is right, "
        "add the edge to the table):\n" + "\n".join(against)
    )


def test_the_documented_table_claims_no_import_the_code_lacks():
    graph = room_graph()
    claimed = [
        f"{source} -> {target}"
        for source, targets in direction_table().items()
        for target in targets
        if target not in graph.get(source, {})
    ]
    assert not claimed, f"docs/design.md's direction table lists imports no module makes: {claimed}"


def test_no_two_rooms_import_each_other():
    cycle = _find_cycle({source: set(targets) for source, targets in room_graph().items()})
    assert cycle is None, "rooms import each other: " + " -> ".join(cycle)


def test_no_cycle_between_modules():
    graph: dict[str, set[str]] = {}
    for m, _, _, target in EDGES:
        if target and target != m and target in MODULES:
            graph.setdefault(m, set()).add(target)
    cycle = _find_cycle(graph)
    assert cycle is None, "modules import each other: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "module,expected",
    [
        ("megazero.run.launch", "run"),
        ("megazero.testing", "megazero"),
        ("megazero.dry_run.job", "dry_run"),
        ("megazero.core.comm", "core"),
        ("megazero.zero.stage3.units", "zero"),
        ("megazero._C", "ops"),
        ("megazero.parallel.pipeline.p2p", "parallel"),
    ],
)
def test_rooms_are_what_the_page_says(module, expected):
    assert module in KNOWN and room(module) == expected


DRIVER = "megazero.run.launch"


def test_the_simulator_reaches_the_recipe_and_not_the_driver():
    """The dry run runs the recipe (megazero.run.pretrain) in an environment of its own: no module it
    reaches, directly or through others, is the driver it stands in for. (Planted: `from
    megazero.run.launch import Launch` in dry_run/job.py fails it, naming the chain.)"""
    graph: dict[str, set[str]] = {}
    for m, _, _, target in EDGES:
        if target in MODULES:
            graph.setdefault(m, set()).add(target)
    chains = {m: [m] for m in MODULES if room(m) == "dry_run"}
    todo = list(chains)
    while todo:
        module = todo.pop()
        for nxt in sorted(graph.get(module, ())):
            if nxt not in chains:
                chains[nxt] = chains[module] + [nxt]
                todo.append(nxt)
    assert DRIVER not in chains, "the dry run reaches the driver: " + " -> ".join(chains[DRIVER])
