"""The documentation runs: every ```python block in README.md and docs/*.md executes as written
(on the real model) and prints something, and every Python name the README's lloyal.node table
maps to exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lloyal

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (doc.relative_to(ROOT).as_posix(), i, code)
    for doc in DOCS
    for i, code in enumerate(
        re.findall(r"^```python\n(.*?)^```", doc.read_text(encoding="utf-8"), re.S | re.M)
    )
]
# Classes whose attributes the lloyal.node table names as `Class.attr`.
TABLE_OWNERS: dict[str, object] = {
    name: getattr(lloyal, name)
    for name in ("Context", "Branch", "BranchStore", "Grammar", "PerplexityTracker", "Produced", "Token")
}
TABLE_OWNERS["lloyal"] = lloyal


def node_table_names() -> list[str]:
    """Backticked ``Owner.attr`` names in the Python and notes columns of the README's table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Coming from lloyal.node", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ")[1:] for line in section.splitlines() if line.startswith("| `")]
    names = []
    for cells in rows:
        for code in re.findall(r"`([^`]+)`", " ".join(cells)):
            match = re.match(r"(\w+)\.(\w+)", code)
            if match and match.group(1) in TABLE_OWNERS:
                names.append(match.group(0))
    return names


def test_readme_and_guides_have_python_examples() -> None:
    documented = {doc for doc, _, _ in BLOCKS}
    assert {"README.md", "docs/concepts.md", "docs/performance.md", "docs/threads.md"} <= documented


@pytest.mark.parametrize(("doc", "index", "code"), BLOCKS, ids=[f"{d}[{i}]" for d, i, _ in BLOCKS])
@pytest.mark.usefixtures("on_cpu")  # the examples are written for the CPU (some ask for batch invariance)
def test_doc_block_runs(doc: str, index: int, code: str, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": "__docs__"}
    exec(compile(code, f"{doc}[python block {index}]", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.strip(), "the example prints its result"


def test_node_table_names_exist() -> None:
    names = node_table_names()
    assert len(names) >= 60, f"the table should map the lloyal.node API, found {len(names)} names"
    missing = [n for n in names if not hasattr(TABLE_OWNERS[n.split(".")[0]], n.split(".")[1])]
    assert not missing, f"the README's lloyal.node table names what does not exist: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", doc.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://")):
                continue
            path = (doc.parent / target).resolve() if target else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target}")
            elif anchor:
                headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{doc.name}: {target}#{anchor}")
    assert not broken, f"links to missing files or headings: {broken}"
