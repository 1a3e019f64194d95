"""The engine (docs/engine.md): N independent callers, each with its own 32-256-token prompt
and its own branch, against the same work hand-batched through ``BranchStore``.

Modes: ``tasks`` (N asyncio tasks: ``aprefill``, then ``produce`` + ``acommit`` per token),
``threads`` (N threads: ``prefill``, ``produce`` + ``commit``), ``gen-tasks`` / ``gen-threads``
(each caller iterates ``Branch.generate(steps, prompt=...)``: sampling runs in the engine),
``batched`` (one caller: ``BranchStore.aprefill`` of all prompts, then ``produce_all`` +
``acommit`` per step). ``pytest benches`` runs each once at small sizes;
``python benches/bench_engine.py [STEPS N...]`` prints the median tok/s ratios of interleaved
rounds (``LLOYAL_BENCH_ROUNDS``, default 2) per N.

Generation requests (``Branch.generate`` run by the engine):
``python benches/bench_engine.py newcomer [STREAMS STEPS PROMPT]`` times a 1500-token prompt
arriving while 8 streams generate (the streams' p50/p99 inter-token latency with and without
it, the newcomer's time to first token); ``python benches/bench_engine.py overhead [N STEPS]``
gives the engine's per-tick overhead at N = 16 (tick time minus ``llama_decode`` and sampling
time, from ``EngineStats``). ``make bench`` runs both at full size.
"""

from __future__ import annotations

import asyncio
import os
import statistics
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
MODES = ["tasks", "threads", "gen-tasks", "gen-threads", "batched"]


def caller_prompts(ctx: lloyal.Context, n: int, lo: int = 32, hi: int = 256) -> list[list[int]]:
    """N distinct prompts of lo..hi tokens (deterministic)."""
    words = ["harbour", "ledger", "tide", "merchant", "lantern", "quay", "rope", "salt", "ship", "storm"]
    out = []
    for i in range(n):
        size = lo + (i * 97) % (hi - lo + 1)
        text = f"Caller {i}: " + " ".join(words[(i + j * 3) % len(words)] for j in range(2 * hi))
        out.append(ctx.tokenize(text)[:size])
    return out


def round_runner(ctx: lloyal.Context, prompts: list[list[int]], steps: int, mode: str) -> Callable[[], int]:
    """One round: N callers, each creating its own branch, prefilling its own prompt and making
    ``steps`` greedy tokens; returns the tokens made (prompt + generated).

    ``tasks``/``threads``: each caller runs produce + (a)commit itself; ``gen-tasks`` /
    ``gen-threads``: each iterates ``Branch.generate`` (sampling in the engine); ``batched``: one
    caller prefills all prompts in one ``BranchStore.prefill`` and steps them with
    ``produce_all`` + ``acommit``."""
    store = lloyal.BranchStore(ctx)
    made = sum(len(p) for p in prompts) + len(prompts) * steps

    def check(branches: list[lloyal.Branch]) -> None:
        assert [b.position for b in branches] == [len(p) + steps for p in prompts]

    def run() -> int:
        branches = [lloyal.Branch.create(ctx, 0, GREEDY) for _ in prompts]
        try:
            if mode in ("tasks", "gen-tasks"):

                async def drive(k: lloyal.Branch, prompt: list[int]) -> None:
                    if mode == "tasks":
                        await k.aprefill(prompt)
                        for _ in range(steps):
                            await k.acommit(k.produce().token)
                    else:
                        assert len([t async for t in k.generate(steps, prompt=prompt)]) == steps

                async def all_tasks() -> None:
                    await asyncio.gather(*(drive(k, p) for k, p in zip(branches, prompts, strict=True)))

                asyncio.run(all_tasks())
            elif mode in ("threads", "gen-threads"):

                def loop(k: lloyal.Branch, prompt: list[int]) -> None:
                    if mode == "threads":
                        k.prefill(prompt)
                        for _ in range(steps):
                            k.commit(k.produce().token)
                    else:
                        assert len(list(k.generate(steps, prompt=prompt))) == steps

                threads = [
                    threading.Thread(target=loop, args=(k, p)) for k, p in zip(branches, prompts, strict=True)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            else:

                async def batched() -> None:
                    await store.aprefill(list(zip(branches, prompts, strict=True)))
                    for _ in range(steps):
                        produced = store.produce_all(branches)
                        await store.acommit([(k, p.token) for k, p in zip(branches, produced, strict=True)])

                asyncio.run(batched())
            check(branches)
        finally:
            for b in branches:
                b.prune()
        return made

    return run


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("mode", MODES)
def test_engine_callers(benchmark: Any, model_path: Path, full: bool, mode: str, n: int) -> None:
    steps = 64 if full else 1
    with lloyal.Context(model_path, n_ctx=8192, n_seq_max=n + 1) as ctx:
        prompts = caller_prompts(ctx, n) if full else caller_prompts(ctx, n, 4, 8)
        made = benchmark.pedantic(round_runner(ctx, prompts, steps, mode), rounds=3 if full else 1)
        assert made == sum(len(p) for p in prompts) + n * steps


def long_prompt(ctx: lloyal.Context, n: int) -> list[int]:
    text = " ".join(f"Entry {i}: the harbour master of Aldermoor logged ship {i * 7}." for i in range(n))
    tokens = ctx.tokenize(text)[:n]
    assert len(tokens) == n
    return tokens


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def newcomer_round(ctx: lloyal.Context, streams: int, steps: int, newcomer: int) -> dict[str, float]:
    """``streams`` generation requests of ``steps`` tokens; if ``newcomer`` > 0, a prompt of that
    many tokens arrives once they run and generates one token. Inter-token gaps in ms."""
    prompt = ctx.tokenize("The history of the harbour town of Aldermoor begins")
    long = long_prompt(ctx, newcomer) if newcomer else []

    async def run() -> dict[str, float]:
        root = lloyal.Branch.create(ctx, 0, GREEDY)
        await root.aprefill(prompt)
        kids = [root.fork() for _ in range(streams)]
        gaps: list[float] = []
        made = [0]

        async def stream(k: lloyal.Branch) -> None:
            last = time.perf_counter()
            async for _ in k.generate(steps):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                made[0] += 1

        tasks = [asyncio.create_task(stream(k)) for k in kids]
        ttft = 0.0
        if newcomer:
            while made[0] < streams * max(1, steps // 4):
                await asyncio.sleep(0.0005)
            nb = lloyal.Branch.create(ctx, 0, GREEDY)
            t0 = time.perf_counter()
            await nb.aprefill(long)
            first = [t async for t in nb.generate(1)]
            ttft = time.perf_counter() - t0
            assert len(first) == 1 and nb.position == newcomer + 1
            nb.prune()
        await asyncio.gather(*tasks)
        assert made[0] == streams * steps and all(k.position == len(prompt) + steps for k in kids)
        root.prune_subtree()
        return {
            "p50_ms": 1e3 * statistics.median(gaps),
            "p99_ms": 1e3 * pct(gaps, 0.99),
            "ttft_ms": 1e3 * ttft,
        }

    return asyncio.run(run())


def newcomer_sizes(full: bool) -> tuple[int, int, int]:
    return (8, 64, 1500) if full else (2, 4, 40)


def _chunk() -> int | None:
    """``LLOYAL_BENCH_CHUNK``: unset or "auto" = the paced default, 0 = the batch, N = a cap."""
    raw = os.environ.get("LLOYAL_BENCH_CHUNK", "auto")
    return None if raw == "auto" else int(raw)


def _chunk_name(chunk: int | None) -> str:
    return "paced" if chunk is None else "batch" if chunk == 0 else str(chunk)


def test_newcomer_latency(benchmark: Any, model_path: Path, full: bool) -> None:
    streams, steps, newcomer = newcomer_sizes(full)
    n_batch = int(os.environ.get("LLOYAL_BENCH_NBATCH", "512"))
    with lloyal.Context(model_path, n_ctx=4096, n_batch=n_batch, n_seq_max=streams + 2) as ctx:
        ctx.engine_prefill_chunk = _chunk()
        base = newcomer_round(ctx, streams, steps, 0)
        got = benchmark.pedantic(lambda: newcomer_round(ctx, streams, steps, newcomer), rounds=1)
        assert got["ttft_ms"] > 0 and base["ttft_ms"] == 0
        if full:
            head = f"newcomer {newcomer} tokens, {streams} streams, n_batch {n_batch}"
            print(f"\n{head}: {fmt_newcomer(base, got)}")


def fmt_newcomer(base: dict[str, float], got: dict[str, float]) -> str:
    return (
        f"without p50 {base['p50_ms']:.1f} ms p99 {base['p99_ms']:.1f} ms; with p50 {got['p50_ms']:.1f} ms "
        f"p99 {got['p99_ms']:.1f} ms (p99/p50 alone {got['p99_ms'] / base['p50_ms']:.2f}x); "
        f"newcomer TTFT {got['ttft_ms']:.0f} ms"
    )


def overhead_round(ctx: lloyal.Context, n: int, steps: int) -> dict[str, float]:
    """``n`` generation requests of ``steps`` tokens in asyncio tasks; the engine's time split."""
    prompt = ctx.tokenize("The history of the harbour town of Aldermoor begins")

    async def run() -> None:
        root = lloyal.Branch.create(ctx, 0, GREEDY)
        await root.aprefill(prompt)
        kids = [root.fork() for _ in range(n)]

        async def one(k: lloyal.Branch) -> int:
            return len([t async for t in k.generate(steps)])

        made = await asyncio.gather(*(one(k) for k in kids))
        assert made == [steps] * n
        root.prune_subtree()

    before = ctx.engine_stats()
    asyncio.run(run())
    time.sleep(0.05)  # the last tick adds its time after waking its callers
    after = ctx.engine_stats()
    ticks = after.ticks - before.ticks
    tick = (after.tick_seconds - before.tick_seconds) / ticks
    decode = (after.decode_seconds - before.decode_seconds) / ticks
    sample = (after.sample_seconds - before.sample_seconds) / ticks
    return {
        "ticks": ticks,
        "rows_per_tick": (after.rows - before.rows) / ticks,
        "tick_ms": 1e3 * tick,
        "decode_ms": 1e3 * decode,
        "sample_ms": 1e3 * sample,
        "overhead_pct": 100 * (tick - decode - sample) / decode,
    }


def fmt_overhead(n: int, r: dict[str, float]) -> str:
    return (
        f"N={n}: {r['ticks']:.0f} ticks, {r['rows_per_tick']:.1f} rows/tick, tick {r['tick_ms']:.2f} ms = "
        f"decode {r['decode_ms']:.2f} + sampling {r['sample_ms']:.2f} + engine overhead "
        f"{r['tick_ms'] - r['decode_ms'] - r['sample_ms']:.3f} ms ({r['overhead_pct']:.2f}% of a decode step)"
    )


def test_tick_overhead(benchmark: Any, model_path: Path, full: bool) -> None:
    n, steps = (16, 64) if full else (2, 3)
    with lloyal.Context(model_path, n_ctx=4096, n_seq_max=n + 1) as ctx:
        r = benchmark.pedantic(lambda: overhead_round(ctx, n, steps), rounds=1)
        assert r["ticks"] >= steps and r["decode_ms"] > 0
        if full:
            print("\n" + fmt_overhead(n, r))


def newcomer_main(args: list[int]) -> None:
    streams, steps, newcomer = [*args, 0, 0, 0][:3] if args else newcomer_sizes(True)
    n_batch = int(os.environ.get("LLOYAL_BENCH_NBATCH", "512"))
    path = lloyal.default_model_path()
    with lloyal.Context(path, n_ctx=4096, n_batch=n_batch, n_seq_max=streams + 2) as ctx:
        ctx.engine_prefill_chunk = _chunk()
        base = newcomer_round(ctx, streams, steps, 0)
        got = newcomer_round(ctx, streams, steps, newcomer)
        head = (
            f"newcomer {newcomer} tokens, {streams} streams x {steps}, n_batch {n_batch}, "
            f"prefill chunk {_chunk_name(ctx.engine_prefill_chunk)}"
        )
        print(f"{head}: {fmt_newcomer(base, got)}")


def overhead_main(args: list[int]) -> None:
    n, steps = [*args, 0, 0][:2] if args else (16, 64)
    with lloyal.Context(lloyal.default_model_path(), n_ctx=4096, n_seq_max=n + 1) as ctx:
        overhead_round(ctx, n, 4)  # warm-up
        print(fmt_overhead(n, overhead_round(ctx, n, steps)))


def main() -> None:
    """Interleaved rounds (tasks, threads, batched) per N; prints tok/s and ratios."""
    if sys.argv[1:2] == ["newcomer"]:
        newcomer_main([int(a) for a in sys.argv[2:]])
        return
    if sys.argv[1:2] == ["overhead"]:
        overhead_main([int(a) for a in sys.argv[2:]])
        return
    args = [int(a) for a in sys.argv[1:]]
    steps, ns = (args[0], args[1:]) if args else (64, [])
    ns = ns or NS
    rounds = int(os.environ.get("LLOYAL_BENCH_ROUNDS", "2"))
    with lloyal.Context(lloyal.default_model_path(), n_ctx=8192, n_seq_max=max(ns) + 1) as ctx:
        for n in ns:
            prompts = caller_prompts(ctx, n)
            rates: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(rounds):
                for mode in MODES:
                    run = round_runner(ctx, prompts, steps, mode)
                    t = time.perf_counter()
                    made = run()
                    rates[mode].append(made / (time.perf_counter() - t))
            base = statistics.median(rates["batched"])
            ratios = "  ".join(f"{m} {statistics.median(rates[m]) / base:.2f}x" for m in MODES[:-1])
            print(f"N={n:2d}  batched {base:7.1f} tok/s (prompt + generated)  {ratios}", flush=True)


if __name__ == "__main__":
    main()
