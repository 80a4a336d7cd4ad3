"""The declared seams (megazero.core.kernels) and the rule that replaced run-time patches."""

import ast
from pathlib import Path

import pytest

from megazero.core import comm, kernels
from megazero.ops import adam
from megazero.training import model_builder

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("megazero", "models", "parallel", "tools")


def test_swapped_puts_a_replacement_in_force_and_restores_it_after_an_error():
    k = kernels.Kernel("test kernel", lambda x: x + 1)  # not declared: no global name taken
    with pytest.raises(RuntimeError):
        with kernels.swapped((k, lambda real: lambda x: real(x) * 10)):
            assert k(1) == 20
            with kernels.swapped((k, lambda real: lambda x: -real(x))):
                assert k(1) == -20
            assert k(1) == 20
            raise RuntimeError("leaves the block")
    assert k(1) == 2 and k.impl is k.default
    with pytest.raises(TypeError, match="no declared kernel"):
        with kernels.swapped((lambda x: x, lambda real: real)):
            pass


def test_the_seams_the_dry_run_and_the_sanitizer_use_are_declared_once_by_name():
    declared = kernels.declared()
    for seam in (
        adam.route,
        adam.adam_update,
        comm.all_gather_single,
        comm.reduce_scatter_single,
        kernels.resize_storage,
        model_builder.initial_value,
    ):
        assert declared[seam.name] is seam
    with pytest.raises(ValueError, match="declared twice"):
        kernels.declare("adam route", lambda device: "cpu")


def _patches(path: Path) -> list[str]:
    """Run-time patches in a source file: unittest.mock, or an assignment to an attribute of torch
    (torch.X = ..., torch.X.Y = ..., F.X = ...)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(n and (n == "mock" or n.startswith("unittest.mock") or n == "unittest.mock") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports unittest.mock")
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for target in targets:
            base = target
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(target, ast.Attribute) and isinstance(base, ast.Name) and base.id in ("torch", "F", "dist"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns {ast.unparse(target)}")
    return found


def test_no_library_file_patches_at_run_time():
    """The dry run and the stream sanitizer take their seams (kernels, phases, torch's modes); a
    patch coming back into library code fails here with its line."""
    files = [p for d in LIBRARY for p in (ROOT / d).rglob("*.py")] + [ROOT / "pretrain_gpt.py"]
    found = [hit for p in files for hit in _patches(p)]
    assert not found, "\n".join(found)


def test_the_patch_finder_finds_what_it_looks_for(tmp_path):
    planted = ROOT / "megazero" / "_planted_patch_test.py"
    planted.write_text("from unittest import mock\nimport torch\ntorch.UntypedStorage.resize_ = None\n")
    try:
        assert len(_patches(planted)) == 2
    finally:
        planted.unlink()
