"""Every ```python block in README.md runs as written (on the real model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_python_examples() -> None:
    assert BLOCKS, "README.md should carry at least one runnable python example"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.strip(), "the example prints its result"
