"""The house's size bars on the library (megazero/, models/, parallel/: the installed package): no
file over 450 lines, no function over 80 lines. An argparse table (a function that only adds flags
to a parser) may be longer when it is listed by name in ARGPARSE_TABLES, and stays a table."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("megazero", "models", "parallel")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
# "path:function" of the argparse tables allowed past MAX_FUNCTION_LINES: one flag per call, which the
# formatter writes one argument per line where a call passes 120 characters.
ARGPARSE_TABLES: set[str] = {
    "megazero/config/model_flags.py:add_model_flags",
    "megazero/config/parallel_flags.py:add_parallel_flags",
    "megazero/config/data_flags.py:add_data_flags",
    "megazero/config/moe_flags.py:add_moe_flags",
    "megazero/config/zero_flags.py:add_zero_flags",
}


def _is_argparse_table(node: ast.FunctionDef) -> bool:
    """Every statement adds flags: a docstring, `g = p.add_argument_group(...)`, or a call."""
    for statement in node.body:
        value = statement.value if isinstance(statement, (ast.Expr, ast.Assign)) else None
        if isinstance(statement, ast.Expr) and isinstance(value, ast.Constant):
            continue
        if not isinstance(value, ast.Call):
            return False
    return True


def oversized(source: str, name: str, tables=frozenset()) -> list[str]:
    """What in one file's `source` breaks the bars, one line each."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"{name}: {lines} lines (the bar is {MAX_FILE_LINES}): split it by what it owns")
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        listed = f"{name}:{node.name}" in tables
        if listed and not _is_argparse_table(node):
            found.append(f"{name}:{node.lineno} {node.name} is listed as an argparse table but does more")
        elif length > MAX_FUNCTION_LINES and not listed:
            found.append(f"{name}:{node.lineno} {node.name} is {length} lines (the bar is {MAX_FUNCTION_LINES})")
    return found


def test_the_bars_catch_a_long_file_a_long_function_and_a_listed_table_that_does_more():
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert oversized(long_function, "a.py") == [f"a.py:1 f is {MAX_FUNCTION_LINES + 1} lines (the bar is 80)"]
    table = "def flags(p):\n    g = p.add_argument_group('x')\n" + "    g.add_argument('--y')\n" * 90
    assert oversized(table, "a.py", {"a.py:flags"}) == []
    assert "does more" in oversized(table + "    return g\n", "a.py", {"a.py:flags"})[0]
    assert "lines (the bar is 450)" in oversized("x = 1\n" * (MAX_FILE_LINES + 1), "a.py")[0]


def test_no_library_file_or_function_is_over_the_bars():
    found = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += oversized(path.read_text(), path.relative_to(ROOT).as_posix(), ARGPARSE_TABLES)
    assert not found, "\n".join(found)
