"""Single-stream decode speed: lloyal (flat path and Branch) vs llama-cpp-python (high-level
API and the raw C loop through its bindings), same model, threads and greedy sampling.

lloyal runs llama.cpp's own kernels here (``batch_invariant=False``) for a like-for-like
comparison; ``test_lloyal_branch_invariant`` is the Branch loop on the default kernels."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import THREADS
from llama_peer import RawLoop, high_level

import lloyal

GROUP = "decode-single-stream"


def steps(full: bool) -> int:
    return 64 if full else 4


@pytest.mark.benchmark(group=GROUP)
def test_lloyal_flat(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    n = steps(full)
    with lloyal.Context(model_path, n_ctx=1024, n_threads=THREADS, batch_invariant=False) as ctx:

        def run() -> list[int]:
            ctx.kv_cache_clear()
            ctx.decode(prompt_tokens, 0)
            out, pos = [], len(prompt_tokens)
            for _ in range(n):
                t = ctx.sample(temperature=0)
                out.append(t)
                ctx.decode([t], pos)
                pos += 1
            return out

        out = benchmark.pedantic(run, rounds=3 if full else 1, iterations=1)
    assert len(out) == n


def _branch_loop(benchmark, model_path: Path, prompt_tokens: list[int], full: bool, invariant: bool) -> None:
    n = steps(full)
    with lloyal.Context(model_path, n_ctx=1024, n_threads=THREADS, batch_invariant=invariant) as ctx:

        def run() -> list[int]:
            with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)) as b:
                b.prefill(prompt_tokens)
                out = []
                for _ in range(n):
                    t = b.sample()
                    b.commit(t)
                    out.append(t)
                return out

        out = benchmark.pedantic(run, rounds=3 if full else 1, iterations=1)
    assert len(out) == n


@pytest.mark.benchmark(group=GROUP)
def test_lloyal_branch(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    _branch_loop(benchmark, model_path, prompt_tokens, full, invariant=False)


@pytest.mark.benchmark(group=GROUP)
def test_lloyal_branch_invariant(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    _branch_loop(benchmark, model_path, prompt_tokens, full, invariant=True)


@pytest.mark.benchmark(group=GROUP)
def test_llama_cpp_python_high_level(
    benchmark, model_path: Path, prompt_tokens: list[int], full: bool
) -> None:
    n = steps(full)
    llm = high_level(model_path, 1024, THREADS)

    def run() -> list[int]:
        llm.reset()
        out = []
        for t in llm.generate(prompt_tokens, temp=0.0, reset=True):
            out.append(t)
            if len(out) == n:
                break
        return out

    out = benchmark.pedantic(run, rounds=3 if full else 1, iterations=1)
    assert len(out) == n


@pytest.mark.benchmark(group=GROUP)
def test_llama_cpp_raw_loop(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    n = steps(full)
    raw = RawLoop(model_path, 1024, 1, THREADS)
    chain = raw.sampler(0, 0.0, 40, 0.95, 0.05)

    def run() -> list[int]:
        raw.clear()
        raw.decode([(t, i, 0, i == len(prompt_tokens) - 1) for i, t in enumerate(prompt_tokens)])
        out, pos = [], len(prompt_tokens)
        for _ in range(n):
            t = raw.sample(chain, -1)
            out.append(t)
            raw.decode([(t, pos, 0, True)])
            pos += 1
        return out

    out = benchmark.pedantic(run, rounds=3 if full else 1, iterations=1)
    raw.close()
    assert len(out) == n


PAIRED = "decode-single-stream-paired"


@pytest.mark.benchmark(group=PAIRED)
def test_paired_branch_vs_raw(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    """Target 2 measured with the rounds interleaved: raw loop, flat path, Branch loop, repeated.

    On a shared 2-core machine the separate single-stream benchmarks above run minutes apart
    and drift by several percent; here every round of each implementation sits next to a round
    of the others, and the ratio is taken of per-implementation medians. pytest-benchmark times
    the Branch loop; the raw loop and the flat path run (timed by hand) as its untimed setup.
    """
    n = steps(full)
    rounds = 9 if full else 1
    raw = RawLoop(model_path, 1024, 1, THREADS)
    chain = raw.sampler(0, 0.0, 40, 0.95, 0.05)
    times: dict[str, list[float]] = {"raw": [], "flat": [], "branch": []}
    outputs: dict[str, list[int]] = {}

    def timed(name: str, fn: Callable[[], list[int]]) -> None:
        t0 = time.perf_counter()
        outputs[name] = fn()
        times[name].append(time.perf_counter() - t0)

    def run_raw() -> list[int]:
        raw.clear()
        raw.decode([(t, i, 0, i == len(prompt_tokens) - 1) for i, t in enumerate(prompt_tokens)])
        out, pos = [], len(prompt_tokens)
        for _ in range(n):
            t = raw.sample(chain, -1)
            out.append(t)
            raw.decode([(t, pos, 0, True)])
            pos += 1
        return out

    with lloyal.Context(model_path, n_ctx=1024, n_threads=THREADS, batch_invariant=False) as ctx:

        def run_flat() -> list[int]:
            ctx.kv_cache_clear()
            ctx.decode(prompt_tokens, 0)
            out, pos = [], len(prompt_tokens)
            for _ in range(n):
                t = ctx.sample(temperature=0)
                out.append(t)
                ctx.decode([t], pos)
                pos += 1
            return out

        def run_branch() -> None:
            def loop() -> list[int]:
                with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)) as b:
                    b.prefill(prompt_tokens)
                    out = []
                    for _ in range(n):
                        t = b.sample()
                        b.commit(t)
                        out.append(t)
                    return out

            timed("branch", loop)

        def others() -> None:
            timed("raw", run_raw)
            timed("flat", run_flat)

        try:
            benchmark.pedantic(run_branch, setup=others, rounds=rounds, iterations=1)
        finally:
            raw.close()
    # Warm-up: the first round of each is dropped when there are several.
    medians = {k: statistics.median(v[1:] if len(v) > 2 else v) for k, v in times.items()}
    benchmark.extra_info.update(
        rounds=len(times["branch"]),
        raw_median_s=round(medians["raw"], 4),
        flat_median_s=round(medians["flat"], 4),
        branch_median_s=round(medians["branch"], 4),
        branch_vs_raw=round(medians["raw"] / medians["branch"], 3),
        flat_vs_raw=round(medians["raw"] / medians["flat"], 3),
    )
    assert {len(v) for v in times.values()} == {rounds}
    assert all(len(out) == n for out in outputs.values())
