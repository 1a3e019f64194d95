"""Helpers shared by the test modules (import as ``from helpers import ...``)."""

from __future__ import annotations

import lloyal


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
