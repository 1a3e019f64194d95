"""asyncio forms (docs/api.md, "Threads and the GIL"): native work runs off the event loop, so a ticker task
keeps running while `acommit`, `aprefill` and `async for tok in branch` decode."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys

import pytest

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

GREEDY = SamplingParams(temperature=0)
LONG_TEXT = (
    "The lighthouse keeper had lived on the island for almost thirty years. Every evening he "
    "climbed the one hundred and twelve steps of the spiral staircase, trimmed the wick, "
    "polished the great brass lens and watched the beam sweep slowly across the dark water. "
    "Ships passed in the night, their crews never knowing his name, yet each of them trusted "
    "the steady light he kept."
)
# The event loop must get at least this many ticks in while native code runs. A blocking
# implementation gets none (the loop is stuck until the call returns).
MIN_TICKS = 3


@pytest.fixture
def ctx(make_context):
    return make_context(n_ctx=1024, n_seq_max=8)


class Ticker:
    """Increments a counter about every millisecond on the running loop."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0.001)

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)  # let it start
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def ticks_during(ticker: Ticker, awaitable):
    before = ticker.count
    result = await awaitable
    return result, ticker.count - before


def test_ticker_runs_during_aprefill_and_acommit(ctx):
    store = BranchStore(ctx)
    long_tokens = ctx.tokenize(LONG_TEXT)
    assert len(long_tokens) > 50

    async def main():
        async with Ticker() as ticker:
            root = Branch.create(ctx, 0, GREEDY)
            res, t_prefill = await ticks_during(ticker, root.aprefill(long_tokens))
            assert res is None
            assert root.position == len(long_tokens)

            kids = [root.fork() for _ in range(7)]
            pairs = [(k, t) for k, t in zip(kids, range(1000, 1007), strict=False)]
            t_commit = 0
            for _ in range(3):
                _, t = await ticks_during(ticker, store.acommit(pairs))
                t_commit += t
                pairs = [(k, k.produce().token) for k in kids]
            assert all(k.position == len(long_tokens) + 3 for k in kids)

            for _ in range(3):
                _, t = await ticks_during(ticker, root.acommit(root.produce().token))
                t_commit += t
            assert root.position == len(long_tokens) + 3
            return t_prefill, t_commit

    t_prefill, t_commit = asyncio.run(main())
    assert t_prefill >= MIN_TICKS, f"event loop blocked during aprefill ({t_prefill} ticks)"
    assert t_commit >= MIN_TICKS, f"event loop blocked during acommit ({t_commit} ticks)"


def test_ticker_runs_during_store_aprefill(ctx):
    store = BranchStore(ctx)
    long_tokens = ctx.tokenize(LONG_TEXT)

    async def main():
        async with Ticker() as ticker:
            a, b = Branch.create(ctx, 0, GREEDY), Branch.create(ctx, 0, GREEDY)
            _, ticks = await ticks_during(ticker, store.aprefill([(a, long_tokens), (b, long_tokens[:20])]))
            return a, b, ticks

    a, b, ticks = asyncio.run(main())
    assert ticks >= MIN_TICKS, f"event loop blocked during store.aprefill ({ticks} ticks)"
    assert a.position == len(long_tokens) and b.position == 20
    assert ctx.kv_seq_pos_max(a.seq_id) == len(long_tokens) - 1


def test_async_for_keeps_loop_running_and_matches_sync(ctx):
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize(LONG_TEXT))
    twin = root.fork()
    n = 8

    async def main():
        async with Ticker() as ticker:
            got = []
            before = ticker.count
            async for tok in root:
                got.append(tok)
                if len(got) == n:
                    break
            return got, ticker.count - before

    got, ticks = asyncio.run(main())
    assert len(got) == n
    assert all(isinstance(t, lloyal.Token) for t in got)
    assert ticks >= MIN_TICKS, f"event loop blocked during async for ({ticks} ticks)"
    assert root.position == twin.position + n
    expected = [t.token for t in twin.generate(max_tokens=n)]
    assert [t.token for t in got] == expected
    assert "".join(t.text for t in got) == ctx.detokenize(expected)


def test_async_for_over_generate_stops_at_cap_and_at_stop(ctx):
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize("Hello, my name is"))
    pos = root.position

    async def capped():
        return [t async for t in root.generate(max_tokens=3)]

    assert len(asyncio.run(capped())) == 3
    assert root.position == pos + 3

    root.set_logit_bias({ctx.eog_token: 1000.0})

    async def until_stop():
        return [t async for t in root]

    assert asyncio.run(until_stop()) == []
    assert root.position == pos + 3


def test_async_errors_propagate_and_change_nothing(ctx):
    store = BranchStore(ctx)
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize("Hello, my name is"))
    pos = root.position
    logits = root.logits

    async def bad_commit():
        await store.acommit([(root, ctx.n_vocab)])

    async def bad_prefill():
        await root.aprefill([1, -5])

    with pytest.raises(lloyal.InvalidTokenError):
        asyncio.run(bad_commit())
    with pytest.raises(lloyal.InvalidTokenError):
        asyncio.run(bad_prefill())
    assert root.position == pos
    assert (root.logits == logits).all()

    child = root.fork()
    child.prune()

    async def disposed():
        await child.acommit(5)

    with pytest.raises(lloyal.BranchDisposedError):
        asyncio.run(disposed())


def test_concurrent_acommits_on_different_branches_are_serialized_correctly(ctx):
    """Two coroutines committing on sibling branches at once: both finish, positions right,
    tokens equal a sequential run."""
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize("The capital of France is"))
    a, b, ref = root.fork(), root.fork(), root.fork()
    expected = []
    for _ in range(4):
        t = ref.produce().token
        ref.commit(t)
        expected.append(t)

    async def run(br):
        out = []
        for _ in range(4):
            t = br.produce().token
            await br.acommit(t)
            out.append(t)
        return out

    async def main():
        return await asyncio.gather(run(a), run(b))

    out_a, out_b = asyncio.run(main())
    assert a.position == b.position == root.position + 4
    assert out_a == out_b == expected


def test_tree_operations_have_awaitable_forms(ctx):
    """The original project's main loop awaits every step, fork and prune included."""
    store = BranchStore(ctx)

    async def main():
        root = Branch.create(ctx, 0, GREEDY)
        await root.aprefill(ctx.tokenize("The capital of France is"))
        pending = root.afork()
        assert asyncio.iscoroutine(pending)
        first = await pending
        a, b, c = [await root.afork() for _ in range(3)]
        assert root.children == [first, a, b, c] and a.parent == root
        await first.aprune()
        assert (await a.afork(clone_logits=False)).parent == a
        with pytest.raises(lloyal.TopologyError, match="live children"):
            await a.aprune()  # RESTRICT still applies
        for br in (a, b, c):
            await br.acommit(br.produce().token)
        await a.aprune_subtree()  # a and its child
        assert a.disposed and root.children == [b, c]
        assert store.available == ctx.n_seq_max - 3
        await b.aprune()
        await b.aprune()  # idempotent, like prune()
        await store.aretain_only(c)
        return root, c

    root, c = asyncio.run(main())
    assert root.disposed and c.parent is None and c.is_active
    assert store.available == ctx.n_seq_max - 1
    assert store.kv_pressure.cells_used == c.position == len(ctx.tokenize("The capital of France is")) + 1
    c.prune()


def test_create_fork_at_and_set_sampling_have_awaitable_forms_that_match_the_sync_ones(ctx):
    """``acreate``, ``afork(at=)`` and ``aset_sampling`` give what their sync forms give; a bad
    argument raises the same error before anything is queued, and changes nothing."""
    prompt = ctx.tokenize("The capital of France is")
    params = SamplingParams(temperature=0.9, top_k=20)
    store = BranchStore(ctx)

    def sync() -> tuple[list[int], int]:
        root = Branch.create(ctx, 0, GREEDY)
        root.prefill(prompt)
        part = root.fork(at=3)
        part.prefill(prompt[3:])
        part.set_sampling(params, seed=11, logit_bias={prompt[0]: -2.0})
        tokens = [part.produce().token]
        part.commit(tokens[0])
        position = part.position
        root.prune_subtree()
        return tokens, position

    async def awaited() -> tuple[list[int], int]:
        root = await Branch.acreate(ctx, 0, GREEDY)
        await root.aprefill(prompt)
        part = await root.afork(at=3)
        assert part.position == 3 and part.parent == root
        await part.aprefill(prompt[3:])
        with pytest.raises(lloyal.InvalidTokenError):
            await part.aset_sampling(params, logit_bias={ctx.n_vocab + 5: 1.0})
        with pytest.raises(ValueError, match="at must be in"):
            await root.afork(at=len(prompt) + 1)
        assert root.children == [part]
        await part.aset_sampling(params, seed=11, logit_bias={prompt[0]: -2.0})
        tokens = [part.produce().token]
        await part.acommit(tokens[0])
        position = part.position
        await root.aprune_subtree()
        return tokens, position

    free = store.available
    assert asyncio.run(awaited()) == sync()
    assert store.available == free


EXIT_RIGHT_AFTER_AWAIT = """
import asyncio, lloyal
ctx = lloyal.Context(lloyal.default_model_path(), n_ctx=512, n_seq_max=2)
branch = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
async def main() -> None:
    await branch.aprefill(ctx.tokenize("The lighthouse keeper"))
    async for tok in branch.generate(2):
        pass
asyncio.run(main())
print("end", branch.position)
"""


def test_exiting_right_after_an_await_is_a_clean_exit() -> None:
    """The engine thread answered the last await and was still inside
    ``loop.call_soon_threadsafe`` when the interpreter finalized: CPython ended it with
    ``pthread_exit`` through Rust frames and the process aborted (exit 134, every run here).
    ``import lloyal`` now quiesces those calls at exit."""
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", EXIT_RIGHT_AFTER_AWAIT], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split()[0] == "end"


EXIT_DURING_A_DECODE = """
import asyncio, sys, threading, time, lloyal
ctx = lloyal.Context(lloyal.default_model_path(), n_ctx=1024, n_threads=2)
prompt = ctx.tokenize("The quick brown fox jumps over the lazy dog. " * 30)[:300]
def prefills() -> None:
    while True:
        b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
        b.prefill(prompt)
        b.prune()
async def cancelled() -> None:
    b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
    try:
        await asyncio.wait_for(b.aprefill(prompt), 0.05)
    except asyncio.TimeoutError:
        pass
if sys.argv[1] == "thread":
    threading.Thread(target=prefills, daemon=True).start()
    time.sleep(0.5)
else:
    asyncio.run(cancelled())
print("end")
"""


@pytest.mark.parametrize("how", ["thread", "cancelled"])
def test_exiting_while_the_engine_decodes_is_a_clean_exit(how: str) -> None:
    """The interpreter exits while the engine thread is inside ``llama_decode``: a daemon thread
    looping prefills, or an ``aprefill`` cancelled by its timeout (cancelling settles the
    future; the engine finishes the batch it decodes). The process's teardown met the decode
    and segfaulted (3 of 12 runs of the two); ``atexit`` now shuts the engines down and waits
    for their threads."""
    for _ in range(4):
        proc = subprocess.run(
            [sys.executable, "-c", EXIT_DURING_A_DECODE, how], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert proc.stdout.split()[0] == "end"


def test_engine_start_queues_the_operation_before_it_is_awaited(ctx):
    """``aio.engine_start`` (the server's commit) is on the engine's queue when it returns, where
    a coroutine such as ``acommit`` queues nothing until it is first awaited; its argument errors
    raise at the call; cancelling its future cancels the operation and changes nothing."""
    from lloyal.aio import engine_start

    store = BranchStore(ctx)
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize("The capital of France is"))
    pos = root.position
    token = root.produce().token

    async def main() -> tuple[int, int]:
        s0 = ctx.engine_stats().ops_submitted
        lazy = store.acommit([(root, token)])
        lazy_queued = ctx.engine_stats().ops_submitted - s0
        lazy.close()  # never awaited: nothing ran
        fut = engine_start(store._submit_commit, [(root, token)])
        eager_queued = ctx.engine_stats().ops_submitted - s0
        await fut
        return lazy_queued, eager_queued

    assert asyncio.run(main()) == (0, 1)
    assert root.position == pos + 1

    async def bad() -> None:
        engine_start(store._submit_commit, [(root, ctx.n_vocab)])

    with pytest.raises(lloyal.InvalidTokenError):
        asyncio.run(bad())
    assert root.position == pos + 1

    async def cancelled() -> None:
        ctx.pause_engine()
        try:
            fut = engine_start(store._submit_commit, [(root, root.produce().token)])
            fut.cancel()
            await asyncio.sleep(0)  # the future's done callback withdraws the operation
        finally:
            ctx.resume_engine()
        while (st := ctx.engine_stats()).ops_completed + st.ops_failed < st.ops_submitted:
            await asyncio.sleep(0.01)

    failed = ctx.engine_stats().ops_failed
    asyncio.run(cancelled())
    assert root.position == pos + 1  # the cancelled commit never decoded
    assert ctx.engine_stats().ops_failed == failed + 1


def test_many_streams_on_one_loop_are_woken_through_one_loop_waker(ctx):
    """Every ``async for`` on a loop is woken through the loop's ``LoopWaker`` (a socket the
    loop watches; the engine thread never takes the GIL to wake it): 6 streams with read-ahead
    and readers that pause at random all finish, round after round (a lost wake-up hangs one),
    with the tokens of the same stream read synchronously."""
    from lloyal import aio

    root = Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize(LONG_TEXT))
    expected = root.fork()
    want = [t.token for t in expected.generate(max_tokens=24)]
    expected.prune()

    async def main() -> list[list[int]]:
        rng = random.Random(5)

        async def read(b: Branch) -> list[int]:
            out = []
            async for tok in b.generate(max_tokens=24, lookahead=4):
                out.append(tok.token)
                if rng.random() < 0.4:
                    await asyncio.sleep(rng.random() * 0.003)
            return out

        got = []
        for _ in range(3):
            forks = [root.fork() for _ in range(6)]
            got += await asyncio.wait_for(asyncio.gather(*(read(b) for b in forks)), 60)
            for b in forks:
                b.prune()
        waker = aio._wakers.get(asyncio.get_running_loop())
        assert isinstance(waker, lloyal._lloyal.LoopWaker)
        return got

    got = asyncio.run(main())
    assert got == [want] * 18
