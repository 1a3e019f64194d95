"""Threads and asyncio against ONE context and ONE store (docs/api.md, "Threads and the GIL"): 8 threads
driving their own branches get the sequential tokens, 500 asyncio tasks sharing a store finish without a
deadlock, and ``close()`` from another thread waits for a running decode, then rejects calls."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from helpers import exact_model_fixture

import lloyal

model = exact_model_fixture()  # runs compared by ==: batch-invariant, on the CPU on a GPU run too


PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "My favourite colour is",
    "Rust is a",
    "Once upon a time there",
    "The quick brown fox",
    "In 1492, Columbus",
    "def fibonacci(n):",
]
GREEDY = lloyal.SamplingParams(temperature=0.0)


def drive(store: lloyal.BranchStore, branch: lloyal.Branch, prompt: list[int], n: int) -> list[int]:
    """Prefill and greedily commit ``n`` tokens through the shared store."""
    store.prefill([(branch, prompt)])
    out = []
    for _ in range(n):
        token = branch.produce().token
        store.commit([(branch, token)])
        out.append(token)
    return out


def test_eight_threads_on_one_store_match_the_sequential_run(model: lloyal.Model) -> None:
    n = 6
    with lloyal.Context(model, n_ctx=1024, n_seq_max=8) as ctx:
        store = lloyal.BranchStore(ctx)
        prompts = [ctx.tokenize(p) for p in PROMPTS]
        expected = []
        for p in prompts:
            with lloyal.Branch.create(ctx, 0, GREEDY) as b:
                expected.append(drive(store, b, p, n))
        assert len({tuple(e) for e in expected}) > 4  # the prompts lead to different tokens

        branches = [lloyal.Branch.create(ctx, 0, GREEDY) for _ in prompts]
        gate = threading.Barrier(len(branches))
        results: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def job(i: int) -> None:
            try:
                gate.wait()
                results[i] = drive(store, branches[i], prompts[i], n)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=job, args=(i,)) for i in range(len(branches))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a thread hung"
        assert not errors, errors
        assert [results[i] for i in range(len(prompts))] == expected
        for b, p in zip(branches, prompts, strict=True):
            assert b.position == len(p) + n == ctx.kv_seq_pos_max(b.seq_id) + 1
        assert store.kv_pressure.cells_used == sum(len(p) + n for p in prompts)
        assert store.available == 0
        for b in branches:
            b.prune()
        assert store.available == 8


def test_five_hundred_asyncio_tasks_share_one_store(model: lloyal.Model) -> None:
    """500 tasks each commit one greedy token to one of 4 branches through ``store.acommit``
    (a per-branch asyncio.Lock orders each branch's own steps); every task completes, and each
    branch ends with the tokens a plain sequential loop gives."""
    n_tasks, n_branches = 500, 4
    steps = n_tasks // n_branches
    with lloyal.Context(model, n_ctx=1024, n_seq_max=n_branches) as ctx:
        store = lloyal.BranchStore(ctx)
        prompts = [ctx.tokenize(p) for p in PROMPTS[:n_branches]]
        expected = []
        for p in prompts:
            with lloyal.Branch.create(ctx, 0, GREEDY) as b:
                expected.append(drive(store, b, p, steps))

        branches = [lloyal.Branch.create(ctx, 0, GREEDY) for _ in prompts]
        for b, p in zip(branches, prompts, strict=True):
            b.prefill(p)  # one branch per decode, as in the reference (batching changes numerics)
        got: list[list[int]] = [[] for _ in branches]

        async def main() -> int:
            locks = [asyncio.Lock() for _ in branches]
            ticks = 0
            stop = asyncio.Event()

            async def ticker() -> None:
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await asyncio.sleep(0.005)

            async def task(k: int) -> None:
                i = k % n_branches
                async with locks[i]:
                    token = branches[i].produce().token
                    await store.acommit([(branches[i], token)])
                    got[i].append(token)

            tick = asyncio.create_task(ticker())
            await asyncio.wait_for(asyncio.gather(*(task(k) for k in range(n_tasks))), timeout=300)
            stop.set()
            await tick
            return ticks

        ticks = asyncio.run(main())
        assert got == expected
        assert ticks > 100  # the loop kept running while decodes ran on worker threads
        assert all(b.position == len(p) + steps for b, p in zip(branches, prompts, strict=True))
        for b in branches:
            b.prune()
        assert store.available == n_branches


def test_close_from_another_thread_waits_for_the_running_decode(model: lloyal.Model) -> None:
    ctx = lloyal.Context(model, n_ctx=2048, n_batch=64, n_seq_max=2)
    branch = lloyal.Branch.create(ctx, 0, GREEDY)
    tokens = [1000 + (i * 7) % 3000 for i in range(768)]  # 12 chunks: a few seconds
    started = threading.Event()
    decode_end: list[float] = []
    errors: list[BaseException] = []

    def work() -> None:
        started.set()
        try:
            branch.prefill(tokens)
        except BaseException as e:  # reported below
            errors.append(e)
        decode_end.append(time.perf_counter())

    worker = threading.Thread(target=work)
    worker.start()
    assert started.wait(30)
    time.sleep(0.3)  # the prefill is now inside llama_decode
    ctx.close()
    closed_at = time.perf_counter()
    worker.join(120)
    assert not errors, errors  # the running call finished normally...
    # ...and close() returned only after it. Both threads re-take the GIL on return, so the
    # worker may stamp its end a moment after close() does; without the wait, close() would
    # return seconds before the remaining chunks end (and they would fail on a freed context).
    assert decode_end[0] <= closed_at + 0.25
    assert ctx.closed
    with pytest.raises(lloyal.ContextClosedError):
        ctx.tokenize("after close")
    with pytest.raises(lloyal.ContextClosedError):
        ctx.decode([1000], 0, seq_id=1)
    with pytest.raises((lloyal.ContextClosedError, lloyal.BranchDisposedError)):
        branch.commit(1000)
    with pytest.raises(lloyal.ContextClosedError):
        lloyal.Branch.create(ctx, 0, GREEDY)
