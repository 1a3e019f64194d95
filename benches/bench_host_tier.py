"""A conversation evicted from the context comes back: its next turn's prompt made ready from the
prefix cache's host tier (the copy written back, only the new turn prefilled) against a cache
with no host tier (the whole history prefilled again), turn about; and what copying costs the
eviction (docs/server.md, "Evicted prompts wait in host memory")::

    python -m pytest benches/bench_host_tier.py --benchmark-enable -s
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import pytest
from conftest import THREADS

import lloyal
from lloyal import _lloyal

GROUP = "host-tier"
GREEDY = lloyal.SamplingParams(temperature=0)
MIB = 1 << 20


def _history(ctx: lloyal.Context, n: int, salt: int) -> list[int]:
    text = " ".join(f"Turn {i} of chat {salt}: the ledger shows {i * 7 % 31} crates." for i in range(n))
    tokens = ctx.tokenize(text)[:n]
    assert len(tokens) == n
    return tokens


def _evicted(ctx: lloyal.Context, cache: _lloyal.PrefixCache, history: list[int]) -> float:
    """Cache a branch holding ``history`` and evict it (copied when the cache keeps copies):
    the eviction's seconds."""
    b = lloyal.Branch.create(ctx, 0, GREEDY)
    b.prefill(history)
    cache.add(b, history)
    t0 = time.perf_counter()
    asyncio.run(cache.amake_room(cells=ctx.n_ctx - 8))
    seconds = time.perf_counter() - t0
    assert b.disposed
    return seconds


def _ready(ctx: lloyal.Context, book: _lloyal.Admission, prompt: list[int]) -> lloyal.Branch:
    """The next turn's branch as the scheduler makes it: the copy written back and forked, or
    a new branch; the rest of the prompt prefilled."""
    plan = book.plan(prompt, 1)
    assert plan is not None
    book.reserve(plan)
    base = asyncio.run(book.arestore(plan)) if plan.restores else plan.base
    b = base.fork(at=plan.at) if base is not None else lloyal.Branch.create(ctx, 0, GREEDY)
    b.prefill(prompt[plan.reused :])
    book.admitted(plan)
    book.release(plan)
    return b


@pytest.mark.benchmark(group=GROUP)
def test_a_returning_conversation_from_host_memory_or_prefilled_again(
    benchmark, model_path: Path, full: bool
) -> None:
    """pytest-benchmark times the host tier's turn; the other's is timed by hand in the same
    round, just before it."""
    length, turn, rounds = (2000, 24, 5) if full else (200, 8, 2)
    model = lloyal.Model(model_path, use_mmap=False)
    contexts = {
        name: lloyal.Context(model, n_ctx=length + 256, n_seq_max=4, n_threads=THREADS)
        for name in ("off", "on")
    }
    caches = {name: _lloyal.PrefixCache(ctx) for name, ctx in contexts.items()}
    caches["on"].host_budget = 1024 * MIB
    books = {name: _lloyal.Admission(ctx, 2) for name, ctx in contexts.items()}
    times: dict[str, list[float]] = {"off": [], "on": [], "evict off": [], "evict on": []}
    prompt: list[int] = []
    rnd = iter(range(rounds))

    def setup() -> None:
        k = next(rnd)
        history = _history(contexts["on"], length, k)
        prompt[:] = history + contexts["on"].tokenize(f" And turn {k}, please?", add_special=False)[:turn]
        for name in ("off", "on"):
            times[f"evict {name}"].append(_evicted(contexts[name], caches[name], history))
        t0 = time.perf_counter()
        _ready(contexts["off"], books["off"], prompt).prune()
        times["off"].append(time.perf_counter() - t0)

    def on_turn() -> None:
        t0 = time.perf_counter()
        b = _ready(contexts["on"], books["on"], prompt)
        times["on"].append(time.perf_counter() - t0)
        b.prune()
        caches["on"].clear()

    benchmark.pedantic(on_turn, setup=setup, rounds=rounds, iterations=1)
    med = {k: statistics.median(v) for k, v in times.items()}
    stats = caches["on"].stats()
    print(
        f"\n{length}-token history + {turn}-token turn: prompt ready in {med['on'] * 1e3:.1f} ms from host "
        f"memory, {med['off'] * 1e3:.1f} ms prefilled again ({med['off'] / med['on']:.0f}x); eviction "
        f"{med['evict on'] * 1e3:.2f} ms with its copy, {med['evict off'] * 1e3:.2f} ms without"
    )
    assert stats["host_restored"] == len(times["on"])  # every timed turn came from host memory
    for ctx in contexts.values():
        ctx.close()
