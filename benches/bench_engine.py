"""The engine (docs/engine.md): N independent callers, each driving its own branch with
``commit``, against the same work hand-batched through ``BranchStore.commit``.

Modes: ``tasks`` (N asyncio tasks awaiting ``Branch.acommit``), ``threads`` (N threads calling
``Branch.commit``), ``batched`` (one ``await store.acommit`` over the N branches per step).
``pytest benches`` runs each once at small sizes; ``python benches/bench_engine.py [STEPS N...]``
prints the tok/s ratios of one interleaved run (tasks and threads over batched, per N).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import lloyal

GREEDY = lloyal.SamplingParams(temperature=0)
NS = [1, 4, 8, 16]
MODES = ["tasks", "threads", "batched"]


def round_runner(ctx: lloyal.Context, prompt: list[int], n: int, steps: int, mode: str) -> Callable[[], int]:
    """One round: prefill a root, fork N, ``steps`` greedy tokens per branch; returns tokens made."""
    store = lloyal.BranchStore(ctx)

    def run() -> int:
        with lloyal.Branch.create(ctx, 0, GREEDY) as root:
            root.prefill(prompt)
            kids = [root.fork() for _ in range(n)]
            if mode == "tasks":

                async def drive(k: lloyal.Branch) -> None:
                    for _ in range(steps):
                        await k.acommit(k.produce().token)

                async def all_tasks() -> None:
                    await asyncio.gather(*(drive(k) for k in kids))

                asyncio.run(all_tasks())
            elif mode == "threads":

                def loop(k: lloyal.Branch) -> None:
                    for _ in range(steps):
                        k.commit(k.produce().token)

                threads = [threading.Thread(target=loop, args=(k,)) for k in kids]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            else:

                async def batched() -> None:
                    for _ in range(steps):
                        produced = store.produce_all(kids)
                        await store.acommit([(k, p.token) for k, p in zip(kids, produced, strict=True)])

                asyncio.run(batched())
            assert all(k.position == len(prompt) + steps for k in kids)
            return n * steps

    return run


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("mode", MODES)
def test_engine_callers(benchmark: Any, model_path: Path, full: bool, mode: str, n: int) -> None:
    steps = 64 if full else 1
    with lloyal.Context(model_path, n_ctx=4096, n_seq_max=n + 1) as ctx:
        prompt = ctx.tokenize("The history of the harbour town of Aldermoor begins")
        made = benchmark.pedantic(round_runner(ctx, prompt, n, steps, mode), rounds=3 if full else 1)
        assert made == n * steps


def main() -> None:
    """Interleaved rounds (tasks, threads, batched) per N; prints tok/s and ratios."""
    args = [int(a) for a in sys.argv[1:]]
    steps, ns = (args[0], args[1:]) if args else (32, [])
    ns = ns or NS
    with lloyal.Context(lloyal.default_model_path(), n_ctx=4096, n_seq_max=max(ns) + 1) as ctx:
        prompt = ctx.tokenize("The history of the harbour town of Aldermoor begins")
        for n in ns:
            best: dict[str, float] = {}
            for _ in range(2):
                for mode in MODES:
                    run = round_runner(ctx, prompt, n, steps, mode)
                    t = time.perf_counter()
                    made = run()
                    rate = made / (time.perf_counter() - t)
                    best[mode] = max(best.get(mode, 0.0), rate)
            base = best["batched"]
            tasks, threads = best["tasks"] / base, best["threads"] / base
            print(f"N={n:2d}  batched {base:7.1f} tok/s  tasks {tasks:.2f}x  threads {threads:.2f}x")


if __name__ == "__main__":
    main()
