"""Shared setup for the benchmark suites: model path, sizes, and the llama-cpp-python peer.

`pytest benches` (benchmarks disabled by default) runs every benchmark once at small sizes
as a smoke test; `make bench` (``--benchmark-enable``) runs the full sizes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# These suites put fast and batch-invariant contexts in one process, and invariance needs ggml's
# process-wide tiled K-quant matmul off: every in-process row runs without it. The side-by-side
# scripts (batched_side_by_side.py, wheel_vs_source.py) run the default, tiled matmul on, each
# measurement in its own process.
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

import lloyal

THREADS = int(os.environ.get("LLOYAL_BENCH_THREADS", str(os.cpu_count() or 2)))


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("benchmark_enable", False):
        config.option.benchmark_disable = True


@pytest.fixture(scope="session")
def full(request: pytest.FixtureRequest) -> bool:
    """True when benchmarks really run (full sizes); False for the smoke run."""
    return not bool(request.config.getoption("benchmark_disable", True))


@pytest.fixture(scope="session")
def model_path() -> Path:
    return lloyal.default_model_path()


@pytest.fixture(scope="session")
def prompt_tokens(model_path: Path) -> list[int]:
    """A 128-token prompt (the benchmark spec's shared prefix)."""
    with lloyal.Context(model_path, n_ctx=512) as ctx:
        text = " ".join(
            f"In the year {1900 + i} the town council of Aldermoor met to discuss the harbour."
            for i in range(40)
        )
        tokens = ctx.tokenize(text)
    assert len(tokens) >= 128
    return tokens[:128]
