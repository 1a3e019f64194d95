"""Helpers shared by the test modules (import as ``from helpers import ...``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import lloyal

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as module ``name`` (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_example_jsonl(name: str, *args: str, stdin: str = "") -> list[dict[str, Any]]:
    """Run ``examples/<name>.py --jsonl *args``: it must exit 0 and print one JSON object a line."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--jsonl", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines, proc.stderr
    events = [json.loads(line) for line in lines]
    assert all(isinstance(e, dict) for e in events)
    return events


def soak_report(name: str, **figures: object) -> None:
    """Append ``figures`` as one JSON line to ``$LLOYAL_SOAK_REPORT`` (set by ``make soak``)."""
    path = os.environ.get("LLOYAL_SOAK_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")


def produce_commit(branch: lloyal.Branch, n: int, *, forbid_stop: bool = False) -> list[int]:
    """``n`` produce/commit steps on one branch; the committed tokens.

    With ``forbid_stop`` a stop token fails the test (the prompt was meant to avoid one).
    """
    out = []
    for _ in range(n):
        p = branch.produce()
        assert not (forbid_stop and p.is_stop), "test prompt hit a stop token unexpectedly"
        branch.commit(p.token)
        out.append(p.token)
    return out


def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``cond`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        time.sleep(0.001)
