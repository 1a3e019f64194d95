"""Single-stream decode speed: lloyal (flat path and Branch) vs llama-cpp-python (high-level
API and the raw C loop through its bindings), same model, threads and greedy sampling.

lloyal runs llama.cpp's own kernels here (``batch_invariant=False``) for a like-for-like
comparison; ``test_lloyal_branch_invariant`` is the Branch loop on the default kernels.
``test_paired_branch_vs_raw`` runs the raw loop, the flat path and the Branch loop turn about
(target 2's ratio; the separate benchmarks run minutes apart on a machine that drifts)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import THREADS
from interleave import interleaved, median_figures
from llama_peer import RawLoop, high_level

import lloyal

GROUP = "decode-single-stream"
PAIRED = "decode-single-stream-paired"
PAGES = "decode-weight-pages"
Run = Callable[[], list[int]]


def steps(full: bool) -> int:
    return 64 if full else 4


def flat_run(ctx: lloyal.Context, prompt_tokens: list[int], n: int) -> Run:
    """The flat path: ``Context.decode`` the prompt, then ``sample`` + ``decode`` n times."""

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

    return run


def branch_run(ctx: lloyal.Context, prompt_tokens: list[int], n: int) -> Run:
    """A Branch: create, prefill the prompt, then ``sample`` + ``commit`` n times."""

    def run() -> list[int]:
        ctx.kv_cache_clear()  # a paired flat run left its cells in seq 0: a branch never wipes them
        with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)) as b:
            b.prefill(prompt_tokens)
            out = []
            for _ in range(n):
                t = b.sample()
                b.commit(t)
                out.append(t)
            return out

    return run


def raw_run(raw: RawLoop, prompt_tokens: list[int], n: int) -> Run:
    """llama.cpp's C API: one llama_batch for the prompt, greedy sampler chain, one row per step."""
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

    return run


def context(model_path: Path, invariant: bool = False) -> lloyal.Context:
    return lloyal.Context(model_path, n_ctx=1024, n_threads=THREADS, batch_invariant=invariant)


def _lloyal_single(
    benchmark,
    model_path: Path,
    prompt_tokens: list[int],
    full: bool,
    build: Callable[[lloyal.Context, list[int], int], Run],
    invariant: bool = False,
) -> None:
    with context(model_path, invariant) as ctx:
        assert ctx.batch_invariant is invariant
        out = benchmark.pedantic(
            build(ctx, prompt_tokens, steps(full)), rounds=3 if full else 1, iterations=1
        )
    assert len(out) == steps(full)


@pytest.mark.benchmark(group=GROUP)
def test_lloyal_flat(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    _lloyal_single(benchmark, model_path, prompt_tokens, full, flat_run)


@pytest.mark.benchmark(group=GROUP)
def test_lloyal_branch(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    _lloyal_single(benchmark, model_path, prompt_tokens, full, branch_run)


@pytest.mark.benchmark(group=GROUP)
def test_lloyal_branch_invariant(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    _lloyal_single(benchmark, model_path, prompt_tokens, full, branch_run, invariant=True)


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
    raw = RawLoop(model_path, 1024, 1, THREADS)
    try:
        out = benchmark.pedantic(
            raw_run(raw, prompt_tokens, steps(full)), rounds=3 if full else 1, iterations=1
        )
    finally:
        raw.close()
    assert len(out) == steps(full)


@pytest.mark.benchmark(group=PAIRED)
def test_paired_branch_vs_raw(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    """Target 2 with interleaved rounds (``interleave.py``): raw loop, flat path, Branch loop,
    repeated; pytest-benchmark times the Branch loop."""
    n, rounds = steps(full), 9 if full else 1
    raw = RawLoop(model_path, 1024, 1, THREADS)
    try:
        with context(model_path) as ctx:
            runs = {
                "raw": raw_run(raw, prompt_tokens, n),
                "flat": flat_run(ctx, prompt_tokens, n),
                "branch": branch_run(ctx, prompt_tokens, n),
            }
            medians, outputs = interleaved(benchmark, runs, rounds)
    finally:
        raw.close()
    benchmark.extra_info.update(rounds=rounds, **median_figures(medians, ("branch", "raw"), ("flat", "raw")))
    assert all(len(out) == n for out in outputs.values())


@pytest.mark.benchmark(group=PAGES)
def test_paired_weights_read_vs_mapped(
    benchmark, model_path: Path, prompt_tokens: list[int], full: bool
) -> None:
    """The flat loop on weights mapped from the file (``use_mmap=True``: 4 KiB pages) and read
    into memory (``use_mmap=False``: 2 MiB pages, ``Model.huge_page_bytes``), turn about;
    pytest-benchmark times the read ones. The same tokens either way."""
    n, rounds = steps(full), 9 if full else 1
    mapped = lloyal.Model(model_path, use_mmap=True)
    read = lloyal.Model(model_path, use_mmap=False)
    with (
        lloyal.Context(mapped, n_ctx=1024, n_threads=THREADS) as a,
        lloyal.Context(read, n_ctx=1024, n_threads=THREADS) as b,
    ):
        runs = {"mapped": flat_run(a, prompt_tokens, n), "read": flat_run(b, prompt_tokens, n)}
        medians, outputs = interleaved(benchmark, runs, rounds)
    figures = median_figures(medians, ("read", "mapped"))
    benchmark.extra_info.update(rounds=rounds, huge_page_mb=read.huge_page_bytes >> 20, **figures)
    assert outputs["read"] == outputs["mapped"] and len(outputs["read"]) == n
