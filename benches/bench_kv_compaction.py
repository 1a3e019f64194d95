"""A prompt after a burst, on a context that compacts its KV cache (the default) and on one that
does not (made with ``LLOYAL_KV_COMPACTION=0``), turn about (docs/performance.md, "Compacting the
KV cache").

A burst prefills ``burst`` prompts of ``length`` tokens and prunes all but the last, whose cells
sit highest (as a server's prefix cache keeps the branch of the request that finished last);
then a ``prompt``-token prompt is prefilled on a new branch and timed. Without compaction its
attention spans every cell up to the kept branch's; with it, the engine has moved the kept
branch's cells to the front first. The same model, threads and cache size (the server bench's
18,048 cells at full size)::

    python -m pytest benches/bench_kv_compaction.py --benchmark-enable -s
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest
from conftest import THREADS

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

GROUP = "kv-compaction"
GREEDY = SamplingParams(temperature=0)
VAR = "LLOYAL_KV_COMPACTION"


def _tokens(ctx: lloyal.Context, salt: str, n: int) -> list[int]:
    text = " ".join(f"Entry {i}{salt}: the {salt} archive lists {i * 13 % 97} boxes." for i in range(n))
    tokens = ctx.tokenize(text)[:n]
    assert len(tokens) == n
    return tokens


def _burst(ctx: lloyal.Context, burst: int, length: int, salt: str) -> Branch:
    """``burst`` prompts prefilled together, all pruned but the last (kept, highest)."""
    branches = [Branch.create(ctx, 0, GREEDY) for _ in range(burst)]
    BranchStore(ctx).prefill([(b, _tokens(ctx, f"{salt}-{k}", length)) for k, b in enumerate(branches)])
    for b in branches[:-1]:
        b.prune()
    return branches[-1]


def _prompt_seconds(ctx: lloyal.Context, tokens: list[int]) -> float:
    b = Branch.create(ctx, 0, GREEDY)
    t0 = time.perf_counter()
    b.prefill(tokens)
    seconds = time.perf_counter() - t0
    b.prune()
    return seconds


@pytest.mark.benchmark(group=GROUP)
def test_paired_prompt_after_a_burst(benchmark, model_path: Path, full: bool) -> None:
    """pytest-benchmark times the compacting context's prompt; the other's is timed by hand in
    the same round, just before it."""
    n_ctx, burst, length, prompt, rounds = (18048, 6, 1000, 1014, 7) if full else (2048, 6, 250, 64, 2)
    model = lloyal.Model(model_path, use_mmap=False)
    os.environ[VAR] = "0"
    try:
        off = lloyal.Context(model, n_ctx=n_ctx, n_seq_max=50, n_threads=THREADS, batch_invariant=False)
    finally:
        del os.environ[VAR]
    on = lloyal.Context(model, n_ctx=n_ctx, n_seq_max=50, n_threads=THREADS, batch_invariant=False)
    kept: dict[str, Branch] = {}
    times: dict[str, list[float]] = {"off": [], "on": []}
    rnd = iter(range(rounds))
    question: list[list[int]] = []

    def setup() -> None:
        k = next(rnd)
        question[:] = [_tokens(on, f"q{k}", prompt)]
        for name, ctx in (("off", off), ("on", on)):
            if name in kept:
                kept[name].prune()
            before = ctx.engine_stats().kv_compactions
            kept[name] = _burst(ctx, burst, length, f"r{k}")
            if name == "on":  # the engine compacts once it has nothing else to do
                deadline = time.monotonic() + 10
                while ctx.engine_stats().kv_compactions == before:
                    assert time.monotonic() < deadline, "no compaction after the burst"
                    time.sleep(0.001)
        times["off"].append(_prompt_seconds(off, question[0]))

    def timed() -> None:
        times["on"].append(_prompt_seconds(on, question[0]))

    try:
        benchmark.pedantic(timed, setup=setup, rounds=rounds, iterations=1)
        compactions = (off.engine_stats().kv_compactions, on.engine_stats().kv_compactions)
    finally:
        off.close()
        on.close()
    med = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in times.items()}
    benchmark.extra_info.update(
        rounds=rounds,
        burst=f"{burst} x {length} tokens, prompt {prompt}, n_ctx {n_ctx}",
        off_median_s=round(med["off"], 4),
        on_median_s=round(med["on"], 4),
        on_vs_off=round(med["off"] / med["on"], 3),
        compactions=compactions,
    )
    # one compaction per burst on the compacting context (a disabled benchmark runs one round)
    assert compactions[0] == 0 and compactions[1] >= len(times["on"]) >= 1
