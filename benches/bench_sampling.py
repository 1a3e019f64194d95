"""Per-step sampling overhead (issue target: under 10% of a decode step at N = 8).

One group, one run: ``produce_all`` of 8 branches (top-k/top-p/min-p, repeat penalty, over the
262,144-token vocabulary, one native call with the GIL released) against the batched commit of
the same 8 branches (one ``llama_decode``). The report prints the ratio.
"""

from __future__ import annotations

from pathlib import Path

from conftest import THREADS

import lloyal

N = 8
GROUP = "sampling-vs-step"
PARAMS = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1)


def _branches(ctx: lloyal.Context, prompt_tokens: list[int]) -> list[lloyal.Branch]:
    root = lloyal.Branch.create(ctx, 0, PARAMS)
    root.prefill(prompt_tokens)
    kids = [root.fork() for _ in range(N)]
    for i, k in enumerate(kids):
        k.reseed_sampler(1 + i)
    return kids


def test_produce_all(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    benchmark.group = GROUP
    with lloyal.Context(model_path, n_ctx=1024, n_seq_max=N + 1, n_threads=THREADS) as ctx:
        store = lloyal.BranchStore(ctx)
        kids = _branches(ctx, prompt_tokens)
        seeds = iter(range(100, 10_000))

        def fresh() -> None:  # produce() caches its draw until an input changes: reseed (untimed)
            for k in kids:
                k.reseed_sampler(next(seeds))

        produced = benchmark.pedantic(
            lambda: store.produce_all(kids), setup=fresh, rounds=50 if full else 1, iterations=1
        )
        assert len(produced) == N and all(0 <= p.token < ctx.n_vocab for p in produced)
        assert [k.position for k in kids] == [len(prompt_tokens)] * N  # sampling writes nothing


def test_commit(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    benchmark.group = GROUP
    rounds = 20 if full else 1
    with lloyal.Context(model_path, n_ctx=1024, n_seq_max=N + 1, n_threads=THREADS) as ctx:
        store = lloyal.BranchStore(ctx)
        kids = _branches(ctx, prompt_tokens)
        pairs = [(k, p.token) for k, p in zip(kids, store.produce_all(kids), strict=True)]
        calls = [0]

        def step() -> None:
            store.commit(pairs)
            calls[0] += 1

        benchmark.pedantic(step, rounds=rounds, iterations=1, warmup_rounds=1)
        assert calls[0] >= 1
        assert [k.position for k in kids] == [len(prompt_tokens) + calls[0]] * N
