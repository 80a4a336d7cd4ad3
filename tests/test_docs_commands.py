"""The command blocks docs/*.md marks runnable (a fence opened as ```bash runnable): each line is a whole
pretrain_gpt.py command (`python pretrain_gpt.py ...`, or `torchrun --nproc-per-node N [--nnodes M]
... pretrain_gpt.py ...`), and its flags pass, as written, every check the launch makes before
anything runs (megazero.config.train_flags.config_from_args at the command's world size and ranks per
node, on a CPU machine). That is where docs/parallelism.md's context-parallel example failed: ring
attention refuses the default attention dropout. Training each layout is what tests/parallel/ and
tests/dry_run/ do; here the flags are checked in-process, milliseconds a command."""

import re
import shlex
from pathlib import Path

import pytest

from megazero.config.train_flags import config_from_args, parse_args

REPO = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```bash runnable\n(.*?)^```", re.S | re.M)


def runnable_commands() -> list[tuple[str, str]]:
    """(page:line, command) of every line of every block marked runnable, continuations joined."""
    found = []
    for page in sorted((REPO / "docs").glob("*.md")):
        text = page.read_text()
        for block in FENCE.finditer(text):
            first = text[: block.start(1)].count("\n") + 1
            joined = block.group(1).replace("\\\n", " \\\n")
            for offset, line in _logical_lines(joined):
                found.append((f"{page.relative_to(REPO)}:{first + offset}", line))
    return found


def _logical_lines(block: str):
    start, pending = 0, []
    for number, line in enumerate(block.splitlines()):
        if not pending:
            start = number
        pending.append(line.rstrip("\\ ").split("  #")[0])
        if not line.rstrip().endswith("\\"):
            command = " ".join(pending).strip()
            pending = []
            if command and not command.startswith("#"):
                yield start, command


def world_and_flags(command: str) -> tuple[int, int, list[str]]:
    """(world size, ranks per node, pretrain_gpt.py's flags) of a command line."""
    words = shlex.split(command)
    script = next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py"))
    per_node, nodes = 1, 1
    if words[0] == "torchrun":
        launcher = words[1:script]
        for i, word in enumerate(launcher):
            name, _, value = word.partition("=")
            value = value or (launcher[i + 1] if i + 1 < len(launcher) else "")
            if name in ("--nproc-per-node", "--nproc_per_node"):
                per_node = int(value)
            elif name == "--nnodes":
                nodes = int(value.split(":")[-1])
    else:
        assert words[:1] == ["python"], command
    return per_node * nodes, per_node, words[script + 1 :]


COMMANDS = runnable_commands()


def test_the_pages_mark_their_launch_examples_runnable():
    pages = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"docs/parallelism.md", "docs/flags.md", "docs/zero.md"} <= pages, pages
    assert all("..." not in command for _, command in COMMANDS), "a runnable line must be whole"


@pytest.mark.parametrize("where,command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_runnable_command_passes_its_checks_as_written(where, command):
    """(Planted: docs/parallelism.md's context-parallel line without --attention-dropout 0, as it was,
    fails with ring attention's refusal.)"""
    world, per_node, flags = world_and_flags(command)
    config_from_args(parse_args(flags), world, per_node, cuda_available=False)
