"""The configuration record (megazero.core.records.Record): `replace` is the one way a record is
copied, and it checks what it copies."""

import ast
from pathlib import Path

import pydantic
import pytest

from megazero.zero.config import ZeroConfig

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("megazero", "models", "parallel", "tools")


def test_replace_checks_the_changes_and_keeps_which_fields_were_given():
    given = ZeroConfig.model_validate({"stage": 2})  # as read from a DeepSpeed file
    copy = given.replace(overlap_comm=True)
    assert copy.stage == 2 and copy.overlap_comm is True and given.overlap_comm is None
    # the flag merges ask which keys the file set: the file's and the changed ones, as model_copy's
    assert copy.model_fields_set == {"stage", "overlap_comm"}
    with pytest.raises(pydantic.ValidationError, match="stage"):
        given.replace(stage=7)  # model_copy(update=...) would keep it
    with pytest.raises(pydantic.ValidationError, match="no_such_field"):
        given.replace(no_such_field=1)


def test_no_library_code_copies_a_record_unchecked():
    found = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr == "model_copy":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"model_copy copies a record unchecked; use Record.replace: {found}"
