"""Draws over the whole vocabulary: what an OpenAI client asks for by default.

``produce_all`` of 8 branches (one native call) with three samplers, in one group so the report
puts them side by side: temperature alone (OpenAI's defaults: no top-k, top-p 1, min-p 0; drawn
straight from the row since session 48), top-p 0.95 without top-k (llama.cpp's chain over a
262,144-entry candidate array), and top-k 40 (the k best found in one pass). Each round reseeds
the branches first (untimed): ``produce()`` keeps its draw until an input changes.

    python -m pytest benches/bench_full_vocab_draw.py --benchmark-enable -s
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import THREADS

import lloyal

N = 8
GROUP = "full-vocabulary draws, 8 branches"
SAMPLERS = {
    "temperature-only": lloyal.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "top-p-0.95-no-top-k": lloyal.SamplingParams(temperature=1.0, top_k=0, top_p=0.95, min_p=0.0),
    "top-k-40": lloyal.SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0),
}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_produce_all(benchmark, model_path: Path, prompt_tokens: list[int], full: bool, name: str) -> None:
    benchmark.group = GROUP
    with lloyal.Context(model_path, n_ctx=1024, n_seq_max=N + 1, n_threads=THREADS) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, 0, SAMPLERS[name])
        root.prefill(prompt_tokens)
        kids = [root.fork() for _ in range(N)]
        seeds = iter(range(100, 100_000))

        def fresh() -> None:
            for k in kids:
                k.reseed_sampler(next(seeds))

        produced = benchmark.pedantic(
            lambda: store.produce_all(kids), setup=fresh, rounds=40 if full else 1, iterations=1
        )
        assert len(produced) == N and all(0 <= p.token < ctx.n_vocab for p in produced)
