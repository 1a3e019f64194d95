"""Waiting for a lease (docs/engine.md, "Backpressure"): ``Branch.create`` / ``fork`` /
``afork`` with a ``timeout`` queue in the engine, first come first served, until a prune frees
a sequence; giving up (timeout, cancellation) never leaks a lease."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from helpers import context_fixture, exact_model_fixture, produce_commit, wait_until

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

model = exact_model_fixture()  # runs compared by ==: batch-invariant, on the CPU on a GPU run too


GREEDY = SamplingParams(temperature=0)
PROMPT = "The three most important inventions of the last century were"


ctx3 = context_fixture(n_ctx=1024, n_batch=64, n_seq_max=3)


def test_no_timeout_fails_at_once_and_bad_timeouts_are_refused(ctx3: lloyal.Context) -> None:
    held = [Branch.create(ctx3, 0, GREEDY) for _ in range(3)]
    with pytest.raises(lloyal.LeaseExhaustedError, match="no free KV lease"):
        held[0].fork()
    with pytest.raises(lloyal.LeaseExhaustedError):
        Branch.create(ctx3, 0, GREEDY)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            held[0].fork(timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            Branch.create(ctx3, 0, GREEDY, timeout=bad)
    assert ctx3.engine_stats().ops_submitted == 0  # timeout=0 never involves the engine


def test_a_timeout_longer_than_the_clock_counts_is_no_limit(ctx3: lloyal.Context) -> None:
    """inf and 1e300 seconds wait as None does (they were a PanicException: no Duration holds
    them); a free lease is granted at once, and generate's timeout and waited take them too."""
    for huge in (float("inf"), 1e300):
        root = Branch.create(ctx3, 0, GREEDY, timeout=huge)
        child = root.fork(timeout=huge)
        child2 = asyncio.run(root.afork(timeout=huge))
        assert [t.token for t in child.generate(2, prompt=[2, 651], timeout=huge, waited=1e300)] == [
            t.token for t in child2.generate(2, prompt=[2, 651])
        ]
        root.prune_subtree()
    assert BranchStore(ctx3).available == 3


def test_a_waiting_fork_gets_the_next_free_lease(ctx3: lloyal.Context) -> None:
    root = Branch.create(ctx3, 0, GREEDY)
    root.prefill(ctx3.tokenize(PROMPT))
    other = root.fork()
    blocker = root.fork()
    store = BranchStore(ctx3)
    assert store.available == 0
    got: list[Branch] = []
    t = threading.Thread(target=lambda: got.append(root.fork(timeout=None)))
    t.start()
    wait_until(lambda: ctx3.engine_stats().lease_waiting == 1)
    assert not got
    cells = store.kv_pressure.cells_used
    blocker.prune()
    t.join(30)
    assert not t.is_alive() and len(got) == 1
    child = got[0]
    assert child.position == root.position and child.parent == root
    assert store.available == 0 and store.kv_pressure.cells_used == cells  # shares the prefix
    assert ctx3.engine_stats().lease_waiting == 0
    assert produce_commit(child, 4) == produce_commit(other, 4)


def test_waiters_are_served_first_come_first_served(ctx3: lloyal.Context) -> None:
    held = [Branch.create(ctx3, 0, GREEDY) for _ in range(3)]
    order: list[int] = []
    made: dict[int, Branch] = {}

    def waiter(i: int) -> None:
        b = Branch.create(ctx3, 10 * i, GREEDY, timeout=None)
        order.append(i)
        made[i] = b

    threads = []
    for i in range(3):
        threads.append(threading.Thread(target=waiter, args=(i,)))
        threads[-1].start()
        wait_until(lambda i=i: ctx3.engine_stats().lease_waiting == i + 1)
    for k, b in enumerate(held):
        b.prune()
        wait_until(lambda k=k: len(order) == k + 1)
    for t in threads:
        t.join(30)
    assert order == [0, 1, 2]
    assert [made[i].position for i in range(3)] == [0, 10, 20]
    assert BranchStore(ctx3).available == 0 and ctx3.engine_stats().lease_waiting == 0


def test_a_timeout_raises_after_it_and_leaks_nothing(ctx3: lloyal.Context) -> None:
    held = [Branch.create(ctx3, 0, GREEDY) for _ in range(3)]
    t0 = time.monotonic()
    with pytest.raises(lloyal.LeaseExhaustedError, match=r"within 0\.200 s"):
        held[0].fork(timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(lloyal.LeaseExhaustedError, match="within"):
        Branch.create(ctx3, 0, GREEDY, timeout=0.05)
    assert ctx3.engine_stats().lease_waiting == 0
    held[2].prune()
    assert BranchStore(ctx3).available == 1  # nothing was granted to the callers who left


def test_tasks_wait_for_leases_and_all_finish(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=1024, n_batch=64, n_seq_max=4) as ctx:
        root = Branch.create(ctx, 0, GREEDY)
        root.prefill(ctx.tokenize(PROMPT))
        want = produce_commit(root.fork(), 5)
        store = BranchStore(ctx)
        assert store.available == 2

        async def one() -> list[int]:
            child = await root.afork(timeout=None)
            try:
                return [t.token async for t in child.generate(5)]
            finally:
                await child.aprune()

        async def main() -> list[list[int]]:
            return await asyncio.gather(*(one() for _ in range(6)))

        got = asyncio.run(main())
        assert got == [want] * 6
        assert store.available == 2 and ctx.engine_stats().lease_waiting == 0


def test_a_cancelled_waiting_task_withdraws(ctx3: lloyal.Context) -> None:
    held = [Branch.create(ctx3, 0, GREEDY) for _ in range(3)]

    async def main() -> None:
        task = asyncio.create_task(held[0].afork(timeout=None))
        while ctx3.engine_stats().lease_waiting == 0:
            await asyncio.sleep(0.002)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(lloyal.LeaseExhaustedError, match="within"):
            await held[0].afork(timeout=0.05)

    asyncio.run(main())
    wait_until(lambda: ctx3.engine_stats().lease_waiting == 0)
    held[1].prune()
    time.sleep(0.05)  # the engine polls waiters every few ms: nothing may take the lease
    assert BranchStore(ctx3).available == 1


def test_a_lease_granted_as_its_caller_leaves_is_pruned(ctx3: lloyal.Context) -> None:
    """The grant and the cancellation race: pause the engine so the grant happens in the tick
    that also sees the cancellation, on either side of it; no lease may leak."""
    held = [Branch.create(ctx3, 0, GREEDY) for _ in range(3)]
    for attempt in range(5):

        async def main(delay: float) -> None:
            task = asyncio.create_task(held[0].afork(timeout=None))
            while ctx3.engine_stats().lease_waiting == 0:
                await asyncio.sleep(0.001)
            ctx3.pause_engine()
            held[2].prune()
            ctx3.resume_engine()
            await asyncio.sleep(delay)  # the grant may or may not have happened
            task.cancel()
            try:
                child = await task
            except asyncio.CancelledError:
                return
            child.prune()  # the task finished before the cancel landed: it owns the branch

        asyncio.run(main(0.001 * attempt))
        wait_until(lambda: ctx3.engine_stats().lease_waiting == 0)
        assert BranchStore(ctx3).available == 1
        held[2] = Branch.create(ctx3, 0, GREEDY)


def test_a_prompt_waits_for_room_for_itself_and_its_tokens(model: lloyal.Model) -> None:
    tokens: list[int]
    with lloyal.Context(model, n_ctx=256, n_batch=64, n_seq_max=4) as cold:
        tokens = cold.tokenize(PROMPT)
        ref = Branch.create(cold, 0, GREEDY)
        ref.prefill(tokens)
        want = produce_commit(ref, 6)
    with lloyal.Context(model, n_ctx=256, n_batch=64, n_seq_max=4) as ctx:
        store = BranchStore(ctx)
        # A running request reserves the room the new prompt needs.
        r = Branch.create(ctx, 0, GREEDY)
        r.prefill(tokens[:4])
        hog = r.generate(256 - 4 - len(tokens) - 3)
        next(hog)
        b = Branch.create(ctx, 0, GREEDY)
        got: list[int] = []
        t = threading.Thread(target=lambda: got.extend(tok.token for tok in b.generate(6, prompt=tokens)))
        t.start()
        wait_until(lambda: ctx.engine_stats().waiting == 1)
        time.sleep(0.05)
        assert b.position == 0 and not got  # waiting, nothing written
        hog.close()  # its reservation goes at the next tick
        t.join(30)
        assert got == want and b.position == len(tokens) + 6
        # With a timeout: fails after it, the branch unchanged.
        hog = r.generate(256 - r.position - b.position - len(tokens) - 3)
        next(hog)
        c = Branch.create(ctx, 0, GREEDY)
        cells = store.kv_pressure.cells_used
        t0 = time.monotonic()
        with pytest.raises(lloyal.KvCacheFullError, match="waited"):
            next(c.generate(6, prompt=tokens, timeout=0.1))
        assert time.monotonic() - t0 >= 0.1
        assert c.position == 0 and store.kv_pressure.cells_used == cells
        assert ctx.engine_stats().waiting == 0
        hog.close()
        # A prompt that could never fit fails at once.
        with pytest.raises(lloyal.KvCacheFullError, match="can never fit"):
            next(c.generate(256 - len(tokens) + 1, prompt=tokens))
