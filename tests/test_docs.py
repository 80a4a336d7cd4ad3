"""Every link and every repository path the documentation names exists, and every `megazero.` name
it cites resolves: the pages cannot point at a file that moved or a function that is gone.

The pages are every Markdown file of the repository: README.md, docs/*.md, bench/README.md,
tests/README.md (and any page added later). What counts, in prose, tables and code blocks alike:

- A link `[text](target)` whose target has no scheme (http:, mailto:, ...): the file, resolved
  against the page's folder, exists; a `#fragment` is a heading of that page (GitHub's anchors:
  lower case, punctuation dropped, spaces to hyphens, "-1", "-2" for repeats). `(#fragment)` alone
  is a heading of the page itself.
- A repository path: a run of path characters (letters, digits, `_ - . / *`) that starts with a
  top-level folder of the repository (`megazero/`, `models/`, `parallel/`, `tests/`, `docs/`,
  `bench/`, `tools/`, `csrc/`, `.ci/`) or is a top-level file (`pretrain_gpt.py`, `setup.py`,
  `pyproject.toml`, `Dockerfile`, `README.md`), and is not preceded by a path character (so
  `/tmp/megazero/...` and `github.com/org/repo/docs/...` are not ours; another project's file is
  written with its own prefix, e.g. `megatron/core/...`, `DeepSpeed/tests/...`). It exists relative
  to the repository root or to the page's folder (tests/README.md says `parallel/test_layers.py`),
  a `*` matching at least one file; a path under a folder .gitignore names (bench/out/, runs/: what
  a run writes) need not exist.
- A bare file name (no folder) ending in .py, .md, .sh, .cpp, .h or .toml, as pages name a module
  inside the folder they describe (`storage.py`): some file of the repository has that name.
  (.json names are what runs write: metrics.json, ds.json; they are not checked.)
- A `megazero.`-dotted name in backticks (`megazero.training.setup`, `megazero.models.GPT`): the
  longest importable module prefix imports and the rest are attributes of it.

Planted, each failed naming its page, line and text: in README.md a link to docs/zeroo.md, one to
docs/zero.md#no-such-heading and one to #tests (README.md has no such heading; the link to
docs/zero.md#storage beside them passed); in docs/design.md `tests/test_zero_exactness.py` (the
flat path before the tests mirrored the tree) and `engine_old.py`; in docs/zero.md
`megazero.training.stage3_blocks` (`megazero.training.setup` beside it passed). Found when first
run: README.md's `tests/test_x.py` and `megazero/models/loss.py` (the repository path is
models/loss.py), both fixed.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", "__pycache__", "build", "dist", "node_modules"}
CHECKED_SUFFIXES = (".py", ".md", ".sh", ".cpp", ".h", ".toml")


def _gitignore() -> list[str]:
    lines = (REPO / ".gitignore").read_text().splitlines() if (REPO / ".gitignore").is_file() else []
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


IGNORED = _gitignore()


def _ignored(rel: str) -> bool:
    """rel (a path under the repository) is one .gitignore names, or lies under a folder it names."""
    parts = rel.strip("/").split("/")
    for pattern in IGNORED:
        anchored, pattern = pattern.startswith("/"), pattern.strip("/")
        width = pattern.count("/") + 1
        starts = [0] if anchored or width > 1 else range(len(parts))
        if any(fnmatch.fnmatch("/".join(parts[i : i + width]), pattern) for i in starts):
            return True
    return False


def _kept(path: Path) -> bool:
    return (
        path.name not in SKIP_DIRS
        and not path.name.endswith(".egg-info")
        and not _ignored(path.relative_to(REPO).as_posix())
    )


# The top level as it is, and the rooms docs/design.md draws (so a page naming a folder that is gone
# is still checked).
TOP_FOLDERS = sorted(
    {p.name for p in REPO.iterdir() if p.is_dir() and _kept(p)}
    | {"megazero", "models", "parallel", "tests", "docs", "bench", "tools", "csrc", ".ci"}
)
TOP_FILES = sorted(
    {p.name for p in REPO.iterdir() if p.is_file() and _kept(p) and not p.name.startswith(".")}
    | {"pretrain_gpt.py", "setup.py", "pyproject.toml", "Dockerfile", "README.md"}
)


def _alternatives(words) -> str:
    return "|".join(re.escape(w) for w in words)


_PATH_CHARS = r"[\w./*-]"
REPO_PATH = re.compile(
    rf"(?<!{_PATH_CHARS})((?:{_alternatives(TOP_FOLDERS)})/{_PATH_CHARS}*"
    rf"|(?:{_alternatives(TOP_FILES)})(?![\w.-]))"
)
BARE_NAME = re.compile(rf"(?<!{_PATH_CHARS})([\w-]+(?:{_alternatives(CHECKED_SUFFIXES)}))(?![\w.-])")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
DOTTED = re.compile(r"`(megazero(?:\.\w+)+)")


def _walk(root: Path):
    for path in root.iterdir():
        if not _kept(path):
            continue
        if path.is_dir():
            yield from _walk(path)
        else:
            yield path


FILES = sorted(_walk(REPO))
PAGES = [p for p in FILES if p.suffix == ".md"]
BASENAMES = {p.name for p in FILES}


def _slug(heading: str) -> str:
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        slug = _slug(line.lstrip("#"))
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def _exists(target: str, page: Path) -> bool:
    for base in (REPO, page.parent):
        if "*" in target:
            if any(base.glob(target.rstrip("/"))):
                return True
        elif (base / target).exists():
            return True
    return _ignored(target)


def _lines(page: Path, prose_only: bool = False):
    """(line number, text); with prose_only, code blocks are skipped and inline code blanked (code
    such as `layers[i](x)` is no link)."""
    in_code = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if prose_only:
            if in_code:
                continue
            line = re.sub(r"`[^`]*`", "``", line)
        yield number, line


def broken_links(page: Path) -> list[str]:
    out = []
    for number, line in _lines(page, prose_only=True):
        for match in LINK.finditer(line):
            target = match.group(1)
            if re.match(r"[a-zA-Z][\w+.-]*:", target):
                continue  # a URL
            path, _, fragment = target.partition("#")
            linked = (page.parent / path) if path else page
            where = f"{page.relative_to(REPO)}:{number}"
            if not linked.exists():
                out.append(f"{where}: link to {target!r}: no such file")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                out.append(f"{where}: link to {target!r}: {linked.name} has no heading #{fragment}")
    return out


def missing_paths(page: Path) -> list[str]:
    out = []
    for number, line in _lines(page):
        where = f"{page.relative_to(REPO)}:{number}"
        for match in REPO_PATH.finditer(line):
            path = match.group(1).rstrip(".")
            if not _exists(path, page):
                out.append(f"{where}: {path!r} is not a path of the repository")
        for match in BARE_NAME.finditer(line):
            name = match.group(1)
            if name not in BASENAMES:
                out.append(f"{where}: {name!r} is no file's name in the repository")
    return out


def unresolved_names(page: Path) -> list[str]:
    out = []
    for number, line in _lines(page):
        for match in DOTTED.finditer(line):
            name = match.group(1)
            parts = name.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                try:
                    for attr in parts[cut:]:
                        obj = getattr(obj, attr)
                except AttributeError:
                    out.append(
                        f"{page.relative_to(REPO)}:{number}: `{name}`: "
                        f"{'.'.join(parts[:cut])} has no {'.'.join(parts[cut:])}"
                    )
                break
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_and_repository_path_exists(page):
    problems = broken_links(page) + missing_paths(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_megazero_name_resolves(page):
    problems = unresolved_names(page)
    assert not problems, "\n".join(problems)


def test_the_checks_see_the_pages_and_what_they_name():
    """The rules are not vacuous: the pages are found, and on them links, repository paths, bare
    module names and megazero names are all found in numbers."""
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/design.md", "docs/zero.md", "bench/README.md", "tests/README.md"} <= names
    text = "\n".join(p.read_text() for p in PAGES)
    counts = [
        len(LINK.findall(text)),
        len(REPO_PATH.findall(text)),
        len(BARE_NAME.findall(text)),
        len(DOTTED.findall(text)),
    ]
    assert counts[0] >= 3 and counts[1] >= 100 and counts[2] >= 50 and counts[3] >= 5, counts


def _design_tree() -> set[str]:
    """The paths docs/design.md's tree names (the fenced block under "## The tree"): each line's
    leading run of names (`flags.py`, `stage3/`), under the folder its indentation says (two spaces
    a level: the repository root, megazero/, a room of megazero/)."""
    text = (REPO / "docs" / "design.md").read_text()
    block = text.split("## The tree", 1)[1].split("```", 2)[1]
    named, folders = set(), {}
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip(" "))
        names = []
        for token in line.split():
            if not re.fullmatch(r"[\w.]+(\.py|/)", token):
                break
            names.append(token)
        if not names or indent % 2 or indent > 4:
            continue  # a description's continuation
        parent = "" if indent == 0 else folders[indent - 2]
        for name in names:
            named.add(parent + name)
            if name.endswith("/"):
                folders[indent] = parent + name
    return named


def test_the_design_tree_names_every_room_and_only_what_exists():
    """docs/design.md's tree and megazero/'s packages and top-level modules are the same rooms, and
    every module of the run, training and dry-run rooms is on the map. (Planted: a stale
    `megazero/dry_run.py` line and a room left off the map each fail it.)"""
    named = _design_tree()
    missing_files = sorted(p for p in named if not (REPO / p.rstrip("/")).exists())
    assert not missing_files, f"docs/design.md's tree names what does not exist: {missing_files}"
    package = REPO / "megazero"
    rooms = {
        f"megazero/{p.relative_to(package).as_posix()}/"
        for p in package.rglob("__init__.py")
        for p in [p.parent]
        if p != package
    }
    top = {f"megazero/{p.name}" for p in package.glob("*.py")}
    listed = {
        f"megazero/{room}/{p.name}"
        for room in ("run", "training", "dry_run")
        for p in (package / room).glob("*.py")
        if p.name != "__init__.py"
    }
    unnamed = sorted((rooms | top | listed) - named)
    assert not unnamed, f"rooms and modules docs/design.md's tree leaves out: {unnamed}"
