"""docs/api.md agrees with the code: every public name of the stub (each class's members in its
own section) and of ``lloyal.__all__`` appears on the page, and every ``Class.attr`` it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import lloyal

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
STUB = ast.parse(Path(lloyal.__file__).with_name("_lloyal.pyi").read_text(encoding="utf-8"))
STUB_CLASSES = {
    node.name: [m.name for m in node.body if isinstance(m, ast.FunctionDef) and not m.name.startswith("_")]
    for node in STUB.body
    if isinstance(node, ast.ClassDef)
}


def section(name: str) -> str:
    """The text under the ``### `name``` heading, up to the next heading."""
    match = re.search(rf"^### `{name}`\n(.*?)(?=^#|\Z)", PAGE, re.S | re.M)
    assert match, f"docs/api.md has no '### `{name}`' section"
    return match.group(1)


def mentions(text: str, name: str) -> bool:
    """Whether ``name`` appears in a code span (alone, called, or as ``Owner.name``)."""
    return re.search(rf"`(?:[\w.]+\.)?{re.escape(name)}\b[^`]*`", text) is not None


@pytest.mark.parametrize("cls", sorted(STUB_CLASSES))
def test_each_stub_class_has_a_section_naming_its_members(cls: str) -> None:
    text = section(cls)
    missing = [m for m in STUB_CLASSES[cls] if not mentions(text, m)]
    assert not missing, f"docs/api.md's `{cls}` section does not mention {missing}"


def test_every_exported_name_is_on_the_page() -> None:
    missing = [name for name in lloyal.__all__ if not mentions(PAGE, name)]
    assert not missing, f"docs/api.md does not mention {missing}"


def test_the_page_names_only_attributes_that_exist() -> None:
    owners = {
        name: getattr(lloyal, name) for name in lloyal.__all__ if isinstance(getattr(lloyal, name), type)
    }
    named = set(re.findall(r"`(\w+)\.(\w+)", PAGE))
    assert len(named) >= 10
    stale = [f"{o}.{a}" for o, a in sorted(named) if o in owners and not hasattr(owners[o], a)]
    assert not stale, f"docs/api.md names attributes that do not exist: {stale}"


def test_readme_links_the_reference() -> None:
    assert "(docs/api.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
