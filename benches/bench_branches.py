"""Best-of-N from one 128-token prompt, 64 steps per branch (temperature 0.8, top_k 40):
lloyal batched commits (one decode per step for all N) vs lloyal sequential single-branch
commits vs llama-cpp-python generating the N completions one after another."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import THREADS
from llama_peer import high_level

import lloyal

PARAMS = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


NS = [1, 2, 4, 8, 16]


def _ns(full: bool, n: int) -> int:
    """Steps per branch: 64 for real runs, 2 for the smoke run."""
    return 64 if full else 2


@pytest.mark.parametrize("n", NS)
def test_best_of_n_batched(benchmark, model_path: Path, prompt_tokens: list[int], full: bool, n: int) -> None:
    steps = _ns(full, n)
    benchmark.group = f"best-of-{n}"
    with lloyal.Context(model_path, n_ctx=4096, n_seq_max=n + 1, n_threads=THREADS) as ctx:
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

        counts = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=1 if full else 0)
    assert counts == [steps] * n


@pytest.mark.parametrize("n", NS)
def test_best_of_n_sequential(
    benchmark, model_path: Path, prompt_tokens: list[int], full: bool, n: int
) -> None:
    steps = _ns(full, n)
    benchmark.group = f"best-of-{n}"
    with lloyal.Context(model_path, n_ctx=4096, n_seq_max=n + 1, n_threads=THREADS) as ctx:

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

        counts = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=1 if full else 0)
    assert counts == [steps] * n


@pytest.mark.parametrize("n", NS)
def test_best_of_n_llama_cpp_python(
    benchmark, model_path: Path, prompt_tokens: list[int], full: bool, n: int
) -> None:
    steps = _ns(full, n)
    benchmark.group = f"best-of-{n}"
    llm = high_level(model_path, 1024, THREADS)

    def run() -> list[int]:
        llm.reset()  # no prompt cache carried over from the warm-up round: prefill once, like ours
        counts = []
        for i in range(n):
            out = llm.create_completion(
                prompt_tokens, max_tokens=steps, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1 + i
            )
            counts.append(out["usage"]["completion_tokens"])
        return counts

    counts = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=1 if full else 0)
    assert all(1 <= c <= steps for c in counts)
