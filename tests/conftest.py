"""Shared fixtures: the real model (Gemma 3 270M or LLOYAL_MODEL), loaded once per session.

Contexts are kept small (n_ctx <= 2048) so the suite stays fast on a 2-core CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


@pytest.fixture
def make_context(model: lloyal.Model) -> Iterator[Callable[..., lloyal.Context]]:
    """A factory for contexts on the session model, all closed at teardown."""
    made: list[lloyal.Context] = []

    def make(**options: object) -> lloyal.Context:
        made.append(lloyal.Context(model, **options))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for c in made:
        c.close()
