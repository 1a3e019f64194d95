"""Helpers shared by the test modules (import as ``from helpers import ...``)."""

from __future__ import annotations

import json
import os

import lloyal


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
