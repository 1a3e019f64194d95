"""Best-of-N from one 128-token prompt, 64 steps per branch (temperature 0.8, top_k 40):
lloyal batched commits (one decode per step for all N) vs lloyal sequential single-branch
commits vs llama-cpp-python generating the N completions one after another, and the floor:
the same batched loop written directly on llama.cpp's C API (llama_batch with N sequences,
llama_memory_seq_cp for the shared prompt, llama.cpp's own sampler chain per sequence).

The lloyal rows compared with llama.cpp use its own kernels (``batch_invariant=False``);
``test_best_of_n_invariant`` is the same batched loop on the default batch-invariant kernels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import THREADS
from interleave import interleaved, median_figures
from llama_peer import RawLoop, high_level

import lloyal

PARAMS = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


NS = [1, 2, 4, 8, 16]
ROUNDS = 3  # timed rounds per benchmark in a real run (after one warm-up round); means are reported


def lloyal_batched_run(
    ctx: lloyal.Context, prompt_tokens: list[int], n: int, steps: int
) -> Callable[[], list[int]]:
    """One best-of-N round on lloyal: prefill, fork N, ``steps`` x (produce_all + one commit)."""
    store = lloyal.BranchStore(ctx)

    def run() -> list[int]:
        with lloyal.Branch.create(ctx, 0, PARAMS) as root:
            root.prefill(prompt_tokens)
            kids = [root.fork() for _ in range(n)]
            for i, k in enumerate(kids):
                k.reseed_sampler(1 + i)
            counts = [0] * n
            for _ in range(steps):
                produced = store.produce_all(kids)
                store.commit([(k, p.token) for k, p in zip(kids, produced, strict=True)])
                for i in range(n):
                    counts[i] += 1
            best = min(kids, key=lambda k: k.perplexity)
            assert best.position == len(prompt_tokens) + steps
            return counts

    return run


def raw_batched_run(raw: RawLoop, prompt_tokens: list[int], n: int, steps: int) -> Callable[[], list[int]]:
    """The same round on llama.cpp's C API: seq_cp for the prompt, one llama_batch per step."""

    def run() -> list[int]:
        raw.clear()
        p = len(prompt_tokens)
        raw.decode([(t, i, 0, i == p - 1) for i, t in enumerate(prompt_tokens)])
        for i in range(1, n + 1):
            raw.seq_cp(0, i)
        chains = [raw.sampler(1 + i, 0.8, 40, 0.95, 0.05) for i in range(n)]
        rows = [-1] * n  # first step: every sequence samples the prompt's last row
        counts = [0] * n
        for step in range(steps):
            toks = [raw.sample(c, r) for c, r in zip(chains, rows, strict=True)]
            raw.decode([(t, p + step, i + 1, True) for i, t in enumerate(toks)])
            rows = list(range(n))
            for i in range(n):
                counts[i] += 1
        for c in chains:
            raw.ll.llama_sampler_free(c)
        return counts

    return run


def _ns(full: bool, n: int) -> int:
    """Steps per branch: 64 for real runs, 2 for the smoke run."""
    return 64 if full else 2


def _best_of(benchmark, full: bool, n: int) -> int:
    """Puts the benchmark in the best-of-``n`` group (its N's implementations side by side):
    the steps per branch."""
    benchmark.group = f"best-of-{n}"
    return _ns(full, n)


def _context(model_path: Path, n: int, invariant: bool = False) -> lloyal.Context:
    """A context for best-of-``n``: the prompt's sequence and one per branch."""
    return lloyal.Context(
        model_path, n_ctx=4096, n_seq_max=n + 1, n_threads=THREADS, batch_invariant=invariant
    )


def _timed(benchmark, run: Callable[[], list[int]], full: bool) -> list[int]:
    """``run`` timed by pytest-benchmark: ROUNDS rounds after one warm-up round (one round
    and no warm-up in the smoke run)."""
    return benchmark.pedantic(run, rounds=ROUNDS if full else 1, iterations=1, warmup_rounds=1 if full else 0)


def _batched(
    benchmark, model_path: Path, prompt_tokens: list[int], full: bool, n: int, invariant: bool
) -> None:
    steps = _best_of(benchmark, full, n)
    with _context(model_path, n, invariant) as ctx:
        assert ctx.batch_invariant is invariant
        counts = _timed(benchmark, lloyal_batched_run(ctx, prompt_tokens, n, steps), full)
    assert counts == [steps] * n


@pytest.mark.parametrize("n", NS)
def test_best_of_n_batched(benchmark, model_path: Path, prompt_tokens: list[int], full: bool, n: int) -> None:
    """llama.cpp's own kernels (batch_invariant=False): the like-for-like comparison."""
    _batched(benchmark, model_path, prompt_tokens, full, n, invariant=False)


@pytest.mark.parametrize("n", NS)
def test_best_of_n_invariant(
    benchmark, model_path: Path, prompt_tokens: list[int], full: bool, n: int
) -> None:
    """The default batch-invariant kernels: what they cost against the line above."""
    _batched(benchmark, model_path, prompt_tokens, full, n, invariant=True)


@pytest.mark.parametrize("n", NS)
def test_best_of_n_sequential(
    benchmark, model_path: Path, prompt_tokens: list[int], full: bool, n: int
) -> None:
    steps = _best_of(benchmark, full, n)
    with _context(model_path, n) as ctx:

        def run() -> list[int]:
            with lloyal.Branch.create(ctx, 0, PARAMS) as root:
                root.prefill(prompt_tokens)
                kids = [root.fork() for _ in range(n)]
                counts = []
                for i, k in enumerate(kids):
                    k.reseed_sampler(1 + i)
                    for _ in range(steps):
                        k.commit(k.sample())
                    counts.append(k.position - len(prompt_tokens))
                return counts

        counts = _timed(benchmark, run, full)
    assert counts == [steps] * n


def llama_cpp_python_run(llm: Any, prompt_tokens: list[int], n: int, steps: int) -> Callable[[], list[int]]:
    """What a Python user does today: ``Llama.create_completion`` N times from the same prompt."""

    def run() -> list[int]:
        llm.reset()  # no prompt cache carried over from the previous round: prefill once, like ours
        counts = []
        for i in range(n):
            out = llm.create_completion(
                prompt_tokens, max_tokens=steps, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1 + i
            )
            counts.append(out["usage"]["completion_tokens"])
        return counts

    return run


@pytest.mark.parametrize("n", NS)
def test_best_of_n_llama_cpp_python(
    benchmark, model_path: Path, prompt_tokens: list[int], full: bool, n: int
) -> None:
    steps = _best_of(benchmark, full, n)
    run = llama_cpp_python_run(high_level(model_path, 1024, THREADS), prompt_tokens, n, steps)
    counts = _timed(benchmark, run, full)
    assert all(1 <= c <= steps for c in counts)


@pytest.mark.parametrize("n", NS)
def test_best_of_n_raw_batched(
    benchmark, model_path: Path, prompt_tokens: list[int], full: bool, n: int
) -> None:
    steps = _best_of(benchmark, full, n)
    raw = RawLoop(model_path, 4096, n + 1, THREADS)
    try:
        counts = _timed(benchmark, raw_batched_run(raw, prompt_tokens, n, steps), full)
    finally:
        raw.close()
    assert counts == [steps] * n


@pytest.mark.parametrize("n", NS)
def test_best_of_n_paired(benchmark, model_path: Path, prompt_tokens: list[int], full: bool, n: int) -> None:
    """Target 1 with interleaved rounds: the raw C-API batched loop, llama-cpp-python's N
    sequential completions, then lloyal batched (llama.cpp's kernels), repeated. The separate
    benchmarks above run minutes apart and a shared machine drifts between them; here each
    lloyal round follows one round of each peer. pytest-benchmark times the lloyal round; the
    peers run (timed by hand) as its setup."""
    steps = _ns(full, n)
    benchmark.group = "best-of-n-paired"
    rounds = ROUNDS + 1 if full else 1
    raw = RawLoop(model_path, 4096, n + 1, THREADS)
    llm = high_level(model_path, 1024, THREADS)
    try:
        with _context(model_path, n) as ctx:
            runs = {
                "raw": raw_batched_run(raw, prompt_tokens, n, steps),
                "llama_cpp_python": llama_cpp_python_run(llm, prompt_tokens, n, steps),
                "lloyal": lloyal_batched_run(ctx, prompt_tokens, n, steps),
            }
            med, counts = interleaved(benchmark, runs, rounds)
    finally:
        raw.close()
    benchmark.extra_info.update(
        n=n, rounds=rounds, **median_figures(med, ("lloyal", "raw"), ("lloyal", "llama_cpp_python"))
    )
    assert counts["raw"] == counts["lloyal"] == [steps] * n
    assert all(1 <= c <= steps for c in counts["llama_cpp_python"])
