"""Interleaved rounds: several implementations timed turn about within one benchmark.

On a shared machine, benchmarks that run minutes apart drift by several percent (up to ~20% in
our runs); a ratio of two such means can be off by as much. Here one round of each
implementation runs in turn, ``rounds`` times, and ratios are taken of per-implementation
medians, so a slow spell hits every implementation alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def interleaved(
    benchmark: Any, runs: dict[str, Callable[[], Any]], rounds: int
) -> tuple[dict[str, float], dict[str, Any]]:
    """Run every entry of ``runs`` once per round, in order, ``rounds`` times.

    pytest-benchmark times the last entry (so the benchmark's own statistics are that
    implementation's); the others run as its untimed setup and are timed by hand. Returns the
    median seconds of each entry, without the first (warm-up) round when there are several,
    and each entry's output from its last round.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs: dict[str, Any] = {}
    *peers, last = runs

    def timed(name: str) -> None:
        t0 = time.perf_counter()
        outputs[name] = runs[name]()
        times[name].append(time.perf_counter() - t0)

    def setup() -> None:
        for name in peers:
            timed(name)

    benchmark.pedantic(lambda: timed(last), setup=setup, rounds=rounds, iterations=1)
    assert {len(v) for v in times.values()} == {rounds}
    medians = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in times.items()}
    return medians, outputs


def median_figures(medians: dict[str, float], *versus: tuple[str, str]) -> dict[str, float]:
    """For ``benchmark.extra_info``: ``<name>_median_s`` for every entry of ``medians`` and, for
    each ``(a, b)`` of ``versus``, ``<a>_vs_<b>``, b's median over a's (how many times faster a ran)."""
    figures = {f"{name}_median_s": round(m, 4) for name, m in medians.items()}
    figures.update({f"{a}_vs_{b}": round(medians[b] / medians[a], 3) for a, b in versus})
    return figures
