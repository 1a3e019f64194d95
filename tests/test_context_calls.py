"""Context calls that are not decode-bearing engine work (create, fork, prune, sampler changes,
the flat path, reads) run at a point of the engine's loop, never inside a tick: at once when no
tick runs, else queued and run by the engine before its next tick, with a short gap after it
for the caller's next calls (``lloyal_core::engine::apply``).

The contexts are on ``exact_model`` (the CPU on a GPU run too): the tests need a tick long enough
to act during it (~1.5 s for 1,024 tokens on 2 cores)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
from helpers import GREEDY, wait_until

import lloyal

LONG = [1000 + (i * 7) % 3000 for i in range(1024)]  # one tick of ~1.5 s on 2 cores
SHORT = LONG[:384]  # one tick of ~0.5 s
PAUSE = 0.0002  # a caller's work between two calls: well inside the engine's 1 ms gap


def tick_running(ctx: lloyal.Context, submitted: int) -> Callable[[], bool]:
    """True once the engine took the ``submitted``-th operation into a tick."""

    def taken() -> bool:
        st = ctx.engine_stats()
        return st.ops_submitted == submitted and st.queue_depth == 0

    return taken


def queued(ctx: lloyal.Context, submitted: int) -> Callable[[], bool]:
    """True once ``submitted`` operations reached the engine."""
    return lambda: ctx.engine_stats().ops_submitted == submitted


def long_prefill(branch: lloyal.Branch, tokens: list[int] = LONG) -> threading.Thread:
    """A thread prefilling ``tokens`` on ``branch`` (one engine tick), started."""
    t = threading.Thread(target=branch.prefill, args=(tokens,))
    t.start()
    return t


def test_a_call_waiting_for_a_tick_is_interrupted_before_the_tick_ends(
    make_exact_context: Callable[..., lloyal.Context],
) -> None:
    ctx = make_exact_context(n_ctx=2048, n_batch=1024, n_seq_max=4)
    ctx.engine_prefill_chunk = 0  # the whole prompt in one tick
    root = lloyal.Branch.create(ctx, 0, GREEDY)
    root.prefill([2, 105, 2364])
    other = lloyal.Branch.create(ctx, 0, GREEDY)
    store = lloyal.BranchStore(ctx)
    free, submitted = store.available, ctx.engine_stats().ops_submitted
    writer = long_prefill(other)
    try:
        wait_until(tick_running(ctx, submitted + 1))
        timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            root.fork()  # waits for the tick: queued, then withdrawn by Ctrl-C
        ticks = ctx.engine_stats().ticks
    finally:
        writer.join()
    assert ticks == 1, "the fork waited for the tick instead of being interrupted"  # the prefix's tick
    assert store.available == free, "the interrupted fork took a lease"
    assert root.position == 3 and other.position == len(LONG)
    assert root.fork().position == 3  # nothing left behind


def test_a_call_made_during_a_tick_runs_before_the_next_tick_and_its_next_calls_too(
    make_exact_context: Callable[..., lloyal.Context],
) -> None:
    """The queued fork is run by the engine when the tick ends; the caller's next calls (the
    sampler, bias and grammar of a new request) take their turn in the gap the engine leaves
    (1 ms after the last call) before the tick of the prefill queued meanwhile, even with some
    work between them (:data:`PAUSE`). The gap is a latency bound, and a thread that wakes late
    (scheduling, the GIL) misses it: up to three tries, one must make it. Without the gap the
    engine's next tick starts while the caller pauses."""
    ctx = make_exact_context(n_ctx=4096, n_batch=1024, n_seq_max=4)
    ctx.engine_prefill_chunk = 0
    ctx.engine_gather = 0.0  # no gather window before the next tick: the gap is the engine's
    root = lloyal.Branch.create(ctx, 0, GREEDY)
    root.prefill([2, 105, 2364])
    grammar = lloyal.Grammar.from_gbnf(ctx, 'root ::= "a"+')  # compiled ahead: no gap for it
    params = lloyal.SamplingParams(temperature=0.7, top_k=20)
    tries: list[tuple[int, int]] = []
    while len(tries) < 3 and (1, 0) not in tries:
        other, third = (lloyal.Branch.create(ctx, 0, GREEDY) for _ in range(2))
        submitted, ticks = ctx.engine_stats().ops_submitted, ctx.engine_stats().ticks
        writer = long_prefill(other, SHORT)
        wait_until(tick_running(ctx, submitted + 1))
        second = long_prefill(third, SHORT)  # queued behind the tick in progress
        wait_until(queued(ctx, submitted + 2))
        gc.disable()  # a collection between the two calls would outlast the gap
        try:
            child = root.fork()
            after_fork = ctx.engine_stats().ticks
            time.sleep(PAUSE)
            child.set_sampling(params, seed=1, logit_bias={7: -5.0})
            time.sleep(PAUSE)
            child.set_grammar(grammar)
            after_setup = ctx.engine_stats().ticks
        finally:
            gc.enable()
            writer.join()
            second.join()
        tries.append((after_fork - ticks, after_setup - after_fork))
        assert other.position == third.position == len(SHORT)
        assert set(child.produce().text) == {"a"}  # the setup was applied
        for b in (child, other, third):
            b.prune()
    assert all(fork == 1 for fork, _ in tries), f"the fork waited for more than the tick in progress: {tries}"
    assert (1, 0) in tries, f"the next calls waited for another tick every time: {tries}"


def test_calls_queued_for_a_tick_are_answered_when_the_context_closes(
    make_exact_context: Callable[..., lloyal.Context],
) -> None:
    ctx = make_exact_context(n_ctx=2048, n_batch=1024, n_seq_max=4)
    ctx.engine_prefill_chunk = 0
    root = lloyal.Branch.create(ctx, 0, GREEDY)
    root.prefill([2, 105, 2364])
    other = lloyal.Branch.create(ctx, 0, GREEDY)
    submitted = ctx.engine_stats().ops_submitted
    writer = long_prefill(other)
    wait_until(tick_running(ctx, submitted + 1))
    results: list[object] = []

    def fork() -> None:
        try:
            results.append(root.fork())
        except lloyal.ContextClosedError as e:
            results.append(e)

    forker = threading.Thread(target=fork)
    forker.start()
    time.sleep(0.1)  # the fork is queued behind the tick
    ctx.close()  # waits for the tick and for the queued fork
    writer.join()
    forker.join(timeout=30)
    assert not forker.is_alive()
    assert len(results) == 1 and isinstance(results[0], lloyal.Branch), results


def test_awaited_calls_queued_behind_a_tick_keep_the_loop_running_and_cancel_cleanly(
    make_exact_context: Callable[..., lloyal.Context],
) -> None:
    """``aprune`` / ``afork`` / ``aretain_only`` made during a tick wait in the engine's queue,
    not in a worker thread: the event loop keeps running, and a cancelled one never runs."""
    ctx = make_exact_context(n_ctx=2048, n_batch=1024, n_seq_max=4)
    ctx.engine_prefill_chunk = 0
    root = lloyal.Branch.create(ctx, 0, GREEDY)
    root.prefill([2, 105, 2364])
    kept, dropped = root.fork(), root.fork()
    store = lloyal.BranchStore(ctx)
    free, submitted = store.available, ctx.engine_stats().ops_submitted

    async def main() -> tuple[int, int]:
        writer = asyncio.create_task(root.aprefill(LONG))  # one tick
        await asyncio.to_thread(wait_until, tick_running(ctx, submitted + 1))
        pruned = asyncio.create_task(dropped.aprune())
        withdrawn = [asyncio.create_task(kept.aprune()), asyncio.create_task(root.afork())]
        turns = 0
        while not pruned.done():
            await asyncio.sleep(0.01)
            turns += 1
            if turns == 5:
                for t in withdrawn:
                    t.cancel()
        ticks = ctx.engine_stats().ticks
        await writer
        await asyncio.gather(*withdrawn, return_exceptions=True)
        return turns, ticks

    turns, ticks = asyncio.run(main())
    assert turns > 10, "the event loop was blocked while the calls waited for the tick"
    assert ticks == 2, "the prune did not wait for the tick in progress"  # the prefix's, the prefill's
    assert kept.position == 3, "the cancelled aprune ran"
    assert store.available == free + 1, "the cancelled afork took a lease, or aprune freed none"
    assert root.position == 3 + len(LONG)
