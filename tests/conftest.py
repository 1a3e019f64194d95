"""Shared fixtures: the real model (Gemma 3 270M or LLOYAL_MODEL), loaded once per session.

Contexts are kept small (n_ctx <= 2048) so the suite stays fast on a 2-core CPU.

Tests marked ``gemma`` assert what only Gemma 3 270M does (its tokens, its answers, its chat
format, its sliding-window layers); they are skipped when ``LLOYAL_MODEL`` names another
model, so ``LLOYAL_MODEL=<any.gguf> pytest tests`` runs the model-independent rest.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Check the KV ledger against llama.cpp after every context call (crates/lloyal-core/src/
# ledger.rs); set before lloyal loads, read once.
os.environ.setdefault("LLOYAL_CHECK_LEDGER", "1")
# ggml's tiled matmul off for the whole session, so the fixture's contexts stay batch-invariant
# whichever test decoded first (tests/test_batch_invariance.py checks the switch in fresh
# processes without this).
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

import lloyal


def _other_model() -> str | None:
    """A description of the LLOYAL_MODEL model when it is not Gemma 3 270M, else None."""
    env = os.environ.get("LLOYAL_MODEL")
    if not env:
        return None
    m = lloyal.Model(env)
    if (m.architecture, m.n_vocab, m.n_layer, m.n_embd) == ("gemma3", 262144, 18, 640):
        return None
    return f"{m.architecture} model {Path(env).name}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("gemma" in item.keywords for item in items):
        return
    other = _other_model()
    if other is None:
        return
    skip = pytest.mark.skip(reason=f"Gemma 3 270M specific; LLOYAL_MODEL is a {other}")
    for item in items:
        if "gemma" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return lloyal.default_model_path()


@pytest.fixture(scope="session")
def model(model_path: Path) -> lloyal.Model:
    # Not repacked: contexts made from it are batch-invariant unless a test says otherwise, so
    # the suite can compare batched and single runs with ==.
    return lloyal.Model(model_path, repack=False)


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
