"""What scoring a prompt costs (``Branch.score``: every row's logits summarised, the prompt logprobs
of the server's ``echo`` with ``logprobs``), turn about with the same tokens written by a plain
``prefill`` and, for a continuation after a context, committed one token at a time (the way to
read each token's logits without ``score``)::

    python -m pytest benches/bench_score.py --benchmark-enable -s
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import THREADS

import lloyal
from lloyal import Branch, SamplingParams

GROUP = "score"
GREEDY = SamplingParams(temperature=0)


def _tokens(ctx: lloyal.Context, n: int) -> list[int]:
    text = " ".join(f"Line {i}: the archive lists {i * 13 % 97} boxes of letters." for i in range(n))
    tokens = ctx.tokenize(text)[:n]
    assert len(tokens) == n
    return tokens


def _seconds(ctx: lloyal.Context, head: list[int], run: Callable[[Branch], object]) -> float:
    with Branch.create(ctx, 0, GREEDY) as b:
        b.prefill(head)
        t0 = time.perf_counter()
        run(b)
        return time.perf_counter() - t0


def _commit_each(tokens: list[int]) -> Callable[[Branch], object]:
    def run(b: Branch) -> None:
        for t in tokens:
            b.commit(t)

    return run


@pytest.mark.benchmark(group=GROUP)
def test_score_against_prefill_and_commits(benchmark, model_path: Path, full: bool) -> None:
    """pytest-benchmark times the scored prompt; the plain prefill and the continuation's
    commits are timed by hand in the same round."""
    prompt, context, continuation, rounds = (512, 256, 32, 5) if full else (80, 16, 8, 1)
    with lloyal.Context(lloyal.Model(model_path), n_ctx=2048, n_seq_max=2, n_threads=THREADS) as ctx:
        tokens = _tokens(ctx, prompt)
        head, tail = tokens[:context], tokens[context : context + continuation]
        times: dict[str, list[float]] = {"prefill": [], "score": [], "tail_score": [], "tail_commits": []}

        def setup() -> None:
            times["prefill"].append(_seconds(ctx, [], lambda b: b.prefill(tokens)))
            times["tail_score"].append(_seconds(ctx, head, lambda b: b.score(tail, 1)))
            times["tail_commits"].append(_seconds(ctx, head, _commit_each(tail)))

        def timed() -> None:
            with Branch.create(ctx, 0, GREEDY) as b:
                t0 = time.perf_counter()
                b.score(tokens, 1)
                times["score"].append(time.perf_counter() - t0)

        benchmark.pedantic(timed, setup=setup, rounds=rounds, iterations=1)
    med = {k: statistics.median(v) for k, v in times.items()}
    benchmark.extra_info.update(
        rounds=rounds,
        prompt=prompt,
        continuation=f"{continuation} tokens after {context}",
        prefill_s=round(med["prefill"], 4),
        score_s=round(med["score"], 4),
        score_vs_prefill=round(med["score"] / med["prefill"], 3),
        tail_score_s=round(med["tail_score"], 4),
        tail_commits_s=round(med["tail_commits"], 4),
        commits_vs_score=round(med["tail_commits"] / med["tail_score"], 2),
    )
    assert all(len(v) == rounds for v in times.values())
