"""Shared fixtures: the real model (Gemma 3 270M or LLOYAL_MODEL), loaded once per session.

Contexts are kept small (n_ctx <= 2048) so the suite stays fast on a 2-core CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import lloyal


@pytest.fixture(scope="session")
def model_path() -> Path:
    return lloyal.default_model_path()


@pytest.fixture(scope="session")
def model(model_path: Path) -> lloyal.Model:
    return lloyal.Model(model_path)


@pytest.fixture
def ctx(model: lloyal.Model) -> Iterator[lloyal.Context]:
    c = lloyal.Context(model, n_ctx=1024, n_batch=512)
    try:
        yield c
    finally:
        c.close()
