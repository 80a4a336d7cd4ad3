"""Regenerate megazero/config/megatron_flags.txt: the names of Megatron-LM's command-line flags, by
argument group, as Megatron-LM's own parser declares them.

    python tools/megatron_flag_list.py MEGATRON_LM_CHECKOUT [MORE_CHECKOUTS ...]

Each argument is a Megatron-LM source tree (its `megatron/training/arguments.py` and the
`megatron/core` it imports). The parser is built by running that file's `_add_*_args(parser)`
functions in the order its `parse_args` calls them, then read back: every long option string of
every argument group (dataclass-generated flags included, which a text search would miss). The
first tree listed names the groups; flags only an older tree has keep that tree's group. The
hand-kept section at the end of the file (names of older Megatron-LM releases and of
Megatron-DeepSpeed, which the trees above no longer declare) is carried over unchanged.

megazero reads the file in megazero/config/flags.py: a flag it lacks that is named there gets the
"Megatron-LM flag megazero does not have" line instead of a "did you mean".
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[1] / "megazero" / "config" / "megatron_flags.txt"
HAND_KEPT = "older Megatron-LM and Megatron-DeepSpeed"
HEADER = """\
# Megatron-LM's command-line flags, names only, grouped by the argument group of
# megatron/training/arguments.py that declares them (tools/megatron_flag_list.py writes this file
# from Megatron-LM's own parser; the last group is kept by hand). megazero/config/flags.py reads it:
# a flag named here that megazero's parser lacks gets the "Megatron-LM flag megazero does not have"
# line. Sources, the first naming the groups:
{sources}
"""


def groups_of(tree: Path) -> dict[str, list[str]]:
    """{group title: [--flag, ...]} of the Megatron-LM source tree at `tree`."""
    sys.path.insert(0, str(tree))
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]
    if not hasattr(typing, "override"):  # newer trees use Python 3.12's decorator
        typing.override = lambda f: f
    try:
        import megatron.training.arguments as arguments

        source = Path(arguments.__file__).read_text()
        order = list(dict.fromkeys(re.findall(r"parser = (_add_\w+_args)\(parser", source)))
        parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
        for name in order:
            getattr(arguments, name)(parser)
    finally:
        sys.path.remove(str(tree))
    found: dict[str, list[str]] = {}
    for group in parser._action_groups:
        flags = [s for action in group._group_actions for s in action.option_strings if s.startswith("--")]
        if flags:
            found.setdefault(group.title, []).extend(flags)
    return found


def version_of(tree: Path) -> str:
    """'Megatron-LM (megatron-core 0.16.0rc0)': the version its package_info.py declares."""
    text = (tree / "megatron" / "core" / "package_info.py").read_text()
    part = {
        k: re.search(rf"^{k} = '?([^'\n]*)'?", text, re.M).group(1) for k in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")
    }
    return f"Megatron-LM (megatron-core {part['MAJOR']}.{part['MINOR']}.{part['PATCH']}{part['PRE_RELEASE']})"


def read(path: Path) -> dict[str, list[str]]:
    """{group: [flags]} of a megatron_flags.txt."""
    groups: dict[str, list[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = groups.setdefault(line[1:-1], [])
        else:
            current.append(line)
    return groups


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="Megatron-LM source trees, newest first")
    args = parser.parse_args(argv)
    merged: dict[str, list[str]] = {}
    seen: set[str] = set()
    for tree in args.trees:
        for title, flags in groups_of(tree).items():
            new = [f for f in flags if f not in seen]
            seen.update(new)
            if new:
                merged.setdefault(title, []).extend(new)
    kept = read(OUTPUT).get(HAND_KEPT, []) if OUTPUT.exists() else []
    merged[HAND_KEPT] = [f for f in kept if f not in seen]
    lines = [HEADER.format(sources="\n".join(f"#   {version_of(t)}" for t in args.trees))]
    for title, flags in merged.items():
        lines.append(f"[{title}]\n" + "".join(f"{flag}\n" for flag in flags))
    OUTPUT.write_text("\n".join(lines))
    print(f"{OUTPUT}: {len(seen) + len(merged[HAND_KEPT])} flags in {len(merged)} groups")
    return 0


if __name__ == "__main__":
    sys.exit(main())
