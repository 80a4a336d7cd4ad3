"""The README's next steps (train with --save, export to Hugging Face, generate) in an environment of
the README's install alone: `pip install -e .`, no dev extra. The test environment has the dev extra
(transformers, wandb, ...), whose own requirements hide a missing dependency of ours (protobuf came
in through wandb, and sentencepiece's export needs it). So the commands run with every module of an
installed distribution outside megazero's declared dependencies (read from pyproject.toml, followed
through the installed distributions' requirements) made unimportable.
(Planted: protobuf dropped from pyproject.toml fails the export with "No module named 'google'".)"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import subprocess
import sys
import tomllib

from tests.driver import REPO

# Runs a script with the modules of `blocked` distributions unimportable, as if never installed.
BLOCKER = r"""
import importlib.machinery, json, runpy, sys
blocked = set(json.loads(sys.argv[1]))
class Uninstalled:          # the path finder, blind to the blocked distributions' modules
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
    def __getattr__(self, name):
        return getattr(importlib.machinery.PathFinder, name)
sys.meta_path[:] = [Uninstalled() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
script, sys.argv = sys.argv[2], sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _declared_closure() -> set[str]:
    """megazero's dependencies (pyproject.toml) and, installed, everything they require."""
    todo = [_name(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def _blocked_modules() -> list[str]:
    allowed = _declared_closure() | {"megazero"}
    blocked = set()
    for module, dists in metadata.packages_distributions().items():
        if module in sys.stdlib_module_names or module.startswith("_"):
            continue
        if not any(d.lower().replace("_", "-") in allowed for d in dists):
            blocked.add(module)
    return sorted(blocked)


def _run(blocked: list[str], *args: str, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER, json.dumps(blocked), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    )  # ~10 s: hangs only
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def test_the_readme_next_steps_run_on_the_readme_install_alone(tmp_path):
    blocked = _blocked_modules()
    assert {"transformers", "wandb"} <= set(blocked)  # the dev extra is really out of reach
    train = _run(
        blocked,
        REPO / "pretrain_gpt.py",
        "--train-iters",
        "1",
        "--num-layers",
        "1",
        "--hidden-size",
        "64",
        "--seq-length",
        "64",
        "--eval-iters",
        "0",
        "--save",
        "ckpt",
        cwd=tmp_path,
    )
    assert "saved checkpoint (final) of iteration 1: ckpt/iter_0000001" in train.stdout
    _run(
        blocked,
        REPO / "tools/convert_checkpoint.py",
        "export-hf",
        "--load",
        "ckpt",
        "--output",
        "hf",
        "--format",
        "gpt2",
        cwd=tmp_path,
    )
    assert (tmp_path / "hf" / "tokenizer.model").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    text = _run(
        blocked,
        REPO / "tools/generate.py",
        "--load",
        "ckpt",
        "--prompt",
        "def main(",
        "--max-new-tokens",
        "4",
        cwd=tmp_path,
    )
    assert text.stdout.strip()
