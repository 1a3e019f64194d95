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
from typing import Any

import pytest

# Check the KV ledger against llama.cpp after every context call (crates/lloyal-core/src/
# ledger.rs); set before lloyal loads, read once.
os.environ.setdefault("LLOYAL_CHECK_LEDGER", "1")
# ggml's tiled matmul off for the whole session, so the fixture's contexts stay batch-invariant
# whichever test decoded first (tests/test_batch_invariance.py checks the switch in fresh
# processes without this).
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

from helpers import SERVER_KEY, serving

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
    # the suite can compare batched and single runs with ==. On a GPU run
    # (LLOYAL_N_GPU_LAYERS=99, benches/gpu_suite.sh) it is offloaded and its contexts are not
    # batch-invariant (GPU kernels are not): a test whose == needs invariance takes exact_model.
    return lloyal.Model(model_path, repack=False)


@pytest.fixture(scope="session")
def exact_model(model_path: Path) -> lloyal.Model:
    """The model on the CPU, not repacked: its contexts are batch-invariant on any run (without
    LLOYAL_N_GPU_LAYERS it is the same object as ``model``)."""
    return lloyal.Model(model_path, repack=False, n_gpu_layers=0)


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[str]:
    """A batch-invariant `lloyal serve` app for the module (4 running choices, 1024 cells,
    ``SERVER_KEY``), served on loopback: its URL. Modules that need another define their own."""
    pytest.importorskip("uvicorn", reason="the server extra: pip install 'lloyal[server]'")
    from lloyal.server import ServerConfig, create_app

    cfg = ServerConfig(
        model=model_path, n_ctx=1024, parallel=4, api_key=SERVER_KEY, n_threads=2, batch_invariant=True
    )
    with serving(create_app(cfg)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[Any]:
    """An `openai` client of the module's ``server`` fixture (a URL), with ``SERVER_KEY``."""
    openai = pytest.importorskip("openai", reason="the server extra: pip install 'lloyal[server]'")
    with openai.OpenAI(base_url=server + "/v1", api_key=SERVER_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def name(model_path: Path) -> str:
    """The id the OpenAI server tests' servers give the model (its file's stem)."""
    return model_path.stem


@pytest.fixture(scope="module")
def ref(exact_model: lloyal.Model) -> Iterator[lloyal.Context]:
    """The OpenAI server tests' own batch-invariant context (1024 cells), to compute what a
    batch-invariant server should answer."""
    with lloyal.Context(exact_model, n_ctx=1024, n_seq_max=2, n_threads=2, batch_invariant=True) as ctx:
        yield ctx


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Models this test loads without saying ``n_gpu_layers`` stay on the CPU, on a GPU run too
    (for tests of batch invariance, a CPU feature)."""
    monkeypatch.delenv("LLOYAL_N_GPU_LAYERS", raising=False)


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
    yield from _context_factory(model)


@pytest.fixture
def make_exact_context(exact_model: lloyal.Model) -> Iterator[Callable[..., lloyal.Context]]:
    """A factory for batch-invariant contexts (on ``exact_model``), all closed at teardown."""
    yield from _context_factory(exact_model)


def _context_factory(model: lloyal.Model) -> Iterator[Callable[..., lloyal.Context]]:
    made: list[lloyal.Context] = []

    def make(**options: object) -> lloyal.Context:
        made.append(lloyal.Context(model, **options))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for c in made:
        c.close()
