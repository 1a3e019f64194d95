"""The engine (docs/engine.md): independent callers' commits and prefills share one
``llama_decode`` per step, each caller gets only its own result, and cancellation rolls back.

Coalescing is made deterministic with ``pause_engine()``: submit from N callers, wait until
the queue holds all N, ``resume_engine()``; the engine then runs exactly one tick.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    context_fixture,
    exact_model_fixture,
    greedy_completion,
    in_threads,
    prefilled,
    run_in_order,
    run_queued,
    wait_until,
)

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

model = exact_model_fixture()  # runs compared by ==: batch-invariant, on the CPU on a GPU run too


GREEDY = SamplingParams(temperature=0)
PROMPT = "The three most important inventions of the last century were"


ctx8 = context_fixture(n_ctx=1024, n_batch=64, n_seq_max=8)


def forks(ctx: lloyal.Context, n: int, prompt: str = PROMPT) -> tuple[Branch, list[Branch]]:
    root = prefilled(ctx, prompt)
    return root, [root.fork() for _ in range(n)]


def test_threads_committing_their_own_branch_share_one_decode(ctx8: lloyal.Context) -> None:
    root, kids = forks(ctx8, 6)
    tokens = [k.produce().token for k in kids]
    calls = [lambda k=k, t=t: k.commit(t) for k, t in zip(kids, tokens, strict=True)]
    before, after, errors = run_queued(ctx8, calls, 6)
    assert errors == []
    assert after.ticks - before.ticks == 1
    assert after.decode_calls - before.decode_calls == 1
    assert after.rows - before.rows == 6
    assert after.ops_completed - before.ops_completed == 6
    assert after.max_ops_per_tick == 6
    assert [k.position for k in kids] == [root.position + 1] * 6
    assert [k.last_token for k in kids] == tokens
    assert BranchStore(ctx8).kv_pressure.cells_used == root.position + 6


def test_asyncio_tasks_share_one_decode_and_never_block_the_loop(ctx8: lloyal.Context) -> None:
    root, kids = forks(ctx8, 5)

    async def main() -> int:
        ctx8.pause_engine()
        tasks = [asyncio.create_task(k.acommit(k.produce().token)) for k in kids]
        spins = 0
        while ctx8.engine_stats().queue_depth < 5:
            spins += 1
            await asyncio.sleep(0)
        ctx8.resume_engine()
        await asyncio.gather(*tasks)
        return spins

    before = ctx8.engine_stats()
    asyncio.run(main())
    after = ctx8.engine_stats()
    assert (after.ticks - before.ticks, after.decode_calls - before.decode_calls) == (1, 1)
    assert [k.position for k in kids] == [root.position + 1] * 5


def test_threads_and_asyncio_tasks_mix_in_one_tick(ctx8: lloyal.Context) -> None:
    root, kids = forks(ctx8, 6)
    sync_kids, async_kids = kids[:3], kids[3:]

    async def tasks() -> None:
        await asyncio.gather(*(k.acommit(k.produce().token) for k in async_kids))

    store = BranchStore(ctx8)
    calls: list[Callable[[], object]] = [lambda k=k: k.commit(k.produce().token) for k in sync_kids[:2]]
    calls.append(lambda: store.commit([(sync_kids[2], sync_kids[2].produce().token)]))
    calls.append(lambda: asyncio.run(tasks()))
    before, after, errors = run_queued(ctx8, calls, 6)
    assert errors == []
    assert (after.ticks - before.ticks, after.decode_calls - before.decode_calls) == (1, 1)
    assert [k.position for k in kids] == [root.position + 1] * 6


def test_coalesced_greedy_runs_equal_hand_batched_commits(model: lloyal.Model) -> None:
    """N tasks, each driving its own branch, produce exactly what one BranchStore.commit
    loop over the same branches produces: tokens, positions, logits, perplexities."""
    n, steps = 4, 8
    options = {"n_ctx": 1024, "n_seq_max": 8}
    with lloyal.Context(model, **options) as a, lloyal.Context(model, **options) as b:
        _, kids_a = forks(a, n)
        _, kids_b = forks(b, n)

        async def drive(k: Branch) -> list[int]:
            out = []
            for _ in range(steps):
                t = k.produce().token
                await k.acommit(t)
                out.append(t)
            return out

        async def main() -> list[list[int]]:
            return list(await asyncio.gather(*(drive(k) for k in kids_a)))

        got = asyncio.run(main())
        store = BranchStore(b)
        want: list[list[int]] = [[] for _ in range(n)]
        for _ in range(steps):
            produced = store.produce_all(kids_b)
            store.commit([(k, p.token) for k, p in zip(kids_b, produced, strict=True)])
            for w, p in zip(want, produced, strict=True):
                w.append(p.token)
        assert got == want
        for ka, kb in zip(kids_a, kids_b, strict=True):
            assert ka.position == kb.position
            assert np.array_equal(ka.logits, kb.logits)
            assert ka.perplexity == kb.perplexity
        assert a.engine_stats().max_ops_per_tick > 1  # the tasks did share ticks


def test_a_caller_reads_each_tick_counted_whole(ctx8: lloyal.Context) -> None:
    """The stats a caller reads once its call returned count that call's tick whole: its time
    (with its decode and sampling inside it) and its decode together. A tick's time added after
    waking the caller made `tick_seconds - decode_seconds` (the host work) read one whole tick
    short or long depending on who ran first: `bench_host_work.py`'s B = 1 figure swung between
    ~0.17 and ~0.6 ms a row from run to run."""
    b = prefilled(ctx8, "The history of the harbour town of Aldermoor begins")
    for _ in range(40):
        b.commit(b.produce().token)
        s = ctx8.engine_stats()
        assert s.tick_seconds >= s.decode_seconds + s.sample_seconds, (s.tick_seconds, s.decode_seconds)


def test_a_bad_operation_fails_only_its_caller(ctx8: lloyal.Context) -> None:
    root, kids = forks(ctx8, 5)
    good_a, good_b, dup, gone, keep = kids
    gone_token = gone.produce().token
    gone.prune()
    logits_dup = dup.logits
    pos = root.position
    store = BranchStore(ctx8)
    tokens = {k: k.produce().token for k in (good_a, good_b, dup)}
    ctx8.pause_engine()
    results: dict[str, BaseException | None] = {}

    def record(name: str, call: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            try:
                call()
                results[name] = None
            except Exception as e:
                results[name] = e

        return run

    threads, _ = in_threads(
        [
            record("a", lambda: good_a.commit(tokens[good_a])),
            record("dup", lambda: store.commit([(dup, tokens[dup]), (dup, tokens[dup])])),
            record("gone", lambda: gone.commit(gone_token)),
            record("b", lambda: store.commit([(good_b, tokens[good_b])])),
        ]
    )
    wait_until(lambda: ctx8.engine_stats().queue_depth == 4)
    before = ctx8.engine_stats()
    ctx8.resume_engine()
    for t in threads:
        t.join()
    after = ctx8.engine_stats()
    assert results["a"] is None and results["b"] is None
    assert isinstance(results["dup"], ValueError) and "appears twice" in str(results["dup"])
    assert isinstance(results["gone"], lloyal.BranchDisposedError)
    assert (after.decode_calls - before.decode_calls, after.rows - before.rows) == (1, 2)
    assert (after.ops_completed - before.ops_completed, after.ops_failed - before.ops_failed) == (2, 2)
    assert (good_a.position, good_b.position, dup.position, keep.position) == (pos + 1, pos + 1, pos, pos)
    assert np.array_equal(dup.logits, logits_dup)
    assert BranchStore(ctx8).kv_pressure.cells_used == pos + 2


def test_kv_full_fails_only_the_operation_that_does_not_fit(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256, n_batch=64, n_seq_max=4) as ctx:
        root, (a, b) = forks(ctx, 2)
        store = BranchStore(ctx)
        used = store.kv_pressure.cells_used
        free = ctx.n_ctx - used
        ctx.pause_engine()
        results: list[object] = []
        # Admission is FIFO: queue the commit first, so the prefill is the one that does not fit.
        threads, errors = in_threads([lambda: results.append(a.commit(a.produce().token))])
        wait_until(lambda: ctx.engine_stats().queue_depth == 1)
        more, errors2 = in_threads([lambda: b.prefill([1000] * free)])  # one cell more than the commit leaves
        threads += more
        wait_until(lambda: ctx.engine_stats().queue_depth == 2)
        ctx.resume_engine()
        for t in threads:
            t.join()
        errors += errors2
        assert results == [None]
        assert len(errors) == 1 and isinstance(errors[0], lloyal.KvCacheFullError)
        assert (a.position, b.position) == (root.position + 1, root.position)
        assert store.kv_pressure.cells_used == used + 1
        assert ctx.kv_seq_pos_max(b.seq_id) == root.position - 1  # nothing of b's prefill left
        b.prefill([1000] * (free - 1))  # exactly what is left fits
        assert store.kv_pressure.remaining == 0


def test_cancelling_a_queued_task_leaves_the_branch_unchanged(ctx8: lloyal.Context) -> None:
    root, (k,) = forks(ctx8, 1)
    pos, logits = k.position, k.logits

    async def main() -> None:
        ctx8.pause_engine()
        task = asyncio.create_task(k.acommit(k.produce().token))
        while ctx8.engine_stats().queue_depth < 1:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ctx8.engine_stats().queue_depth == 0
        ctx8.resume_engine()

    before = ctx8.engine_stats()
    asyncio.run(main())
    after = ctx8.engine_stats()
    assert after.ops_failed - before.ops_failed == 1
    assert after.ticks == before.ticks
    assert (k.position, k.last_token) == (pos, None)
    assert np.array_equal(k.logits, logits)
    k.prune()
    root.prune()
    assert BranchStore(ctx8).available == 8  # every lease back
    assert BranchStore(ctx8).kv_pressure.cells_used == 0


def test_cancelling_a_prefill_in_flight_rolls_it_back(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=2048, n_batch=8, n_seq_max=2) as ctx:
        b = Branch.create(ctx, 0, GREEDY)
        b.prefill(ctx.tokenize(PROMPT))
        pos = b.position
        long = [1000 + (i * 7) % 3000 for i in range(1200)]  # 150 ticks of 8 tokens

        async def main() -> None:
            task = asyncio.create_task(b.aprefill(long))
            while ctx.engine_stats().in_flight == 0 or ctx.kv_seq_pos_max(b.seq_id) < pos + 16:
                await asyncio.sleep(0.001)
            ctx.pause_engine()  # hold it mid-prefill, so the cancel surely lands before the last chunk
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the cancellation reached the task once the engine had rolled the prefill back
            # (a paused engine still answers cancellations between its ticks)
            assert ctx.engine_stats().in_flight == 0
            assert b.position == pos and ctx.kv_seq_pos_max(b.seq_id) == pos - 1
            ctx.resume_engine()

        asyncio.run(main())
        assert b.position == pos
        assert ctx.kv_seq_pos_max(b.seq_id) == pos - 1  # the chunks written so far are gone
        assert BranchStore(ctx).kv_pressure.cells_used == pos
        b.commit(b.produce().token)  # still usable
        assert b.position == pos + 1


def test_a_call_right_after_a_cancelled_prefill_sees_it_rolled_back(model: lloyal.Model) -> None:
    """The cancelled prefill's chunks are written ahead of the branch's position until the
    engine rolls them back: a call made at once (before another tick) waits for that, so a
    fork, a saved state and ``retain_only`` see the branch as it was, not its stale cells."""
    with lloyal.Context(model, n_ctx=2048, n_batch=8, n_seq_max=4) as ctx:
        b = Branch.create(ctx, 0, GREEDY)
        b.prefill(ctx.tokenize(PROMPT))
        pos = b.position
        want = b.produce().token
        long = [1000 + (i * 7) % 3000 for i in range(1200)]

        async def cancelled() -> None:
            task = asyncio.create_task(b.aprefill(long))
            while ctx.engine_stats().in_flight == 0 or ctx.kv_seq_pos_max(b.seq_id) < pos + 16:
                await asyncio.sleep(0.001)
            ctx.pause_engine()  # no tick runs from here on
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancelled())
        try:
            child = b.fork()
            assert (child.position, ctx.kv_seq_pos_max(child.seq_id)) == (pos, pos - 1)
            assert ctx.engine_stats().in_flight == 0, "rolled back before the fork, the engine paused"
            loaded = Branch.load_state(ctx, b.save_state())
            assert (loaded.position, ctx.kv_seq_pos_max(loaded.seq_id)) == (pos, pos - 1)
            assert child.produce().token == loaded.produce().token == want
        finally:
            ctx.resume_engine()
        for x in (child, loaded):
            x.prune()
        asyncio.run(cancelled())
        try:
            BranchStore(ctx).retain_only(b)
        finally:
            ctx.resume_engine()
        assert BranchStore(ctx).kv_pressure.cells_used == pos == ctx.kv_seq_pos_max(b.seq_id) + 1
        b.prune()
        assert BranchStore(ctx).kv_pressure.cells_used == 0


def test_decode_rows_run_every_tick_while_a_long_prefill_is_chunked(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=512, n_batch=8, n_seq_max=4) as ctx:
        root, (runner, reader) = forks(ctx, 2)
        pos = root.position
        long = [1000 + (i * 7) % 3000 for i in range(360)]  # >= 52 ticks beside a commit row
        ctx.pause_engine()
        threads, errors = in_threads([lambda: reader.prefill(long)])
        wait_until(lambda: ctx.engine_stats().queue_depth == 1)
        ctx.resume_engine()
        wait_until(lambda: ctx.engine_stats().in_flight == 1)
        for _ in range(5):
            runner.commit(runner.produce().token)
        # Five commits (at most two ticks each) finished while the prefill (>= 52 ticks of
        # <= 7 tokens beside a commit row) still runs: decode rows are never held back.
        assert ctx.engine_stats().in_flight == 1
        for t in threads:
            t.join()
        stats = ctx.engine_stats()
        assert errors == []
        assert stats.decode_calls == stats.ticks  # every tick fit one n_batch decode
        assert (runner.position, reader.position) == (pos + 5, pos + 360)
        assert BranchStore(ctx).kv_pressure.cells_used == pos + 365
        chunked = reader.logits
    with lloyal.Context(model, n_ctx=512, n_batch=8, n_seq_max=4) as alone:
        _, (ref,) = forks(alone, 1)
        ref.prefill(long)
        assert np.array_equal(ref.logits, chunked)  # chunk boundaries change nothing


def test_store_prefill_keeps_ceil_total_over_n_batch_decodes(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=4) as ctx:
        bs = [Branch.create(ctx, 0, GREEDY) for _ in range(3)]
        before = ctx.engine_stats()
        BranchStore(ctx).prefill([(b, [1000 + i] * 40) for i, b in enumerate(bs)])
        after = ctx.engine_stats()
        assert (after.decode_calls - before.decode_calls, after.rows - before.rows) == (2, 120)
        assert [b.position for b in bs] == [40, 40, 40]


def test_close_answers_queued_operations(ctx8: lloyal.Context) -> None:
    _, (k,) = forks(ctx8, 1)
    ctx8.pause_engine()
    threads, errors = in_threads([lambda: k.commit(k.produce().token)])
    wait_until(lambda: ctx8.engine_stats().queue_depth == 1)
    ctx8.close()
    for t in threads:
        t.join()
    assert len(errors) == 1 and isinstance(errors[0], lloyal.ContextClosedError)
    with pytest.raises(lloyal.ContextClosedError):
        k.commit(1000)


def test_engine_gather_is_validated(ctx8: lloyal.Context) -> None:
    assert ctx8.engine_gather == 0.002
    ctx8.engine_gather = 0.0
    assert ctx8.engine_stats().gather == 0.0
    with pytest.raises(ValueError, match="between 0 and 1"):
        ctx8.engine_gather = 2.0
    assert ctx8.engine_gather == 0.0


def test_token_iterators_in_threads_match_sequential_greedy(ctx8: lloyal.Context) -> None:
    _, kids = forks(ctx8, 3)
    refs = [k.fork() for k in kids]
    got: dict[int, list[int]] = {}

    def drive(i: int, k: Branch) -> None:
        got[i] = [t.token for t in k.generate(6)]

    threads, errors = in_threads([lambda i=i, k=k: drive(i, k) for i, k in enumerate(kids)])
    for t in threads:
        t.join()
    assert errors == []
    want = {i: [t.token for t in r.generate(6)] for i, r in enumerate(refs)}
    assert got == want


@pytest.mark.parametrize(("invariant", "gpu_layers"), [(False, None), (True, 0), (False, 99)])
def test_commit_rows_of_several_branches_decode_apart_from_prefill_rows(
    model: lloyal.Model, model_path: Path, invariant: bool, gpu_layers: int | None
) -> None:
    """On the fast kernels a tick that carries commit rows of several branches and prefill rows
    runs them in two ``llama_decode`` calls: ggml's flash attention takes 64 query rows at a
    time and skips a block of cells only when every row of the tile is masked from it, so a
    tile mixing rows of many sequences ran dense over the whole cache (docs/performance.md).
    Batch-invariant kernels attend row by row: one call. One commit row, or a tick under one
    tile, stays one call either way. A model asked onto a GPU is split the same way when the
    build has no GPU backend (it runs on the CPU), not when its layers are on a GPU."""
    if gpu_layers is not None:
        model = lloyal.Model(model_path, repack=False, n_gpu_layers=gpu_layers)
    asked_gpu = bool(gpu_layers)  # this module's own model is on the CPU on a GPU run too
    on_gpu = asked_gpu and not lloyal.system_info().lstrip().startswith("CPU")
    with lloyal.Context(model, n_ctx=1024, n_batch=512, n_seq_max=8, batch_invariant=invariant) as ctx:
        ctx.engine_prefill_chunk = 0  # each tick takes the whole batch (not paced)
        root, runners = forks(ctx, 3)
        pos = root.position
        reader, other = Branch.create(ctx, 0, GREEDY), Branch.create(ctx, 0, GREEDY)
        long = [1000 + (i * 7) % 3000 for i in range(200)]
        store = BranchStore(ctx)

        def one_tick(calls: list[Callable[[], object]]) -> tuple[int, int, int]:
            ctx.pause_engine()
            threads, errors = in_threads(calls)
            wait_until(lambda: ctx.engine_stats().queue_depth == len(calls))
            before = ctx.engine_stats()
            ctx.resume_engine()
            for t in threads:
                t.join()
            after = ctx.engine_stats()
            assert errors == []
            calls = after.decode_calls - before.decode_calls
            return after.ticks - before.ticks, calls, after.rows - before.rows

        token = runners[0].produce().token
        assert one_tick(
            [lambda: store.commit([(r, token) for r in runners]), lambda: reader.prefill(long)]
        ) == (1, 1 if invariant or on_gpu else 2, 203)
        assert one_tick([lambda: runners[0].commit(token), lambda: other.prefill(long)]) == (1, 1, 201)
        assert one_tick(
            [lambda: store.commit([(r, token) for r in runners]), lambda: other.prefill([5, 6, 7])]
        ) == (1, 1, 6)
        assert [r.position for r in runners] == [pos + 3, pos + 2, pos + 2]
        assert (reader.position, other.position) == (200, 203)
        assert store.kv_pressure.cells_used == pos + 7 + 200 + 203


def test_a_fork_right_after_its_prefill_does_not_wait_for_the_next_tick(model: lloyal.Model) -> None:
    """A caller whose prefill just finished usually forks it next, with a direct call that
    needs the context lock; the engine leaves it its gather window before the next tick of a
    long prefill still in flight (before, the fork waited for that whole tick)."""
    with lloyal.Context(model, n_ctx=1024, n_batch=64, n_seq_max=4) as ctx:
        ctx.engine_gather = 0.25  # room for a loaded machine; the default is 2 ms
        a, b = Branch.create(ctx, 0, GREEDY), Branch.create(ctx, 0, GREEDY)
        long = [1000 + (i * 7) % 3000 for i in range(400)]

        async def main() -> tuple[int, int]:
            ctx.pause_engine()
            short_done = asyncio.ensure_future(a.aprefill(ctx.tokenize(PROMPT)))
            long_done = asyncio.ensure_future(b.aprefill(long))
            await asyncio.sleep(0)
            wait_until(lambda: ctx.engine_stats().queue_depth == 2)
            start = ctx.engine_stats().ticks
            ctx.resume_engine()
            await short_done
            time.sleep(0.05)  # a busy event loop: other requests' work comes first
            child = a.fork()
            written = ctx.kv_seq_pos_max(b.seq_id) + 1  # the long prefill's progress at the fork
            await long_done
            assert child.position == a.position
            return written, ctx.engine_stats().ticks - start

        written, ticks = asyncio.run(main())
        # The first 64-row tick held the short prompt and the long one's first 64 - n tokens;
        # the fork came before the second.
        n = a.position
        assert (written, ticks) == (64 - n, (400 + n + 63) // 64)


def test_the_window_after_a_prefill_ends_when_its_caller_is_back(model: lloyal.Model) -> None:
    """The window the engine leaves a prefill's caller ends as soon as an operation on the
    prefilled branch arrives (the caller is back): a commit right after a prefill does not wait
    it out. With a 1 s window, a commit that waited it would take over 1 s; unheld it takes one
    decode (tens of milliseconds here)."""
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=2) as ctx:
        ctx.engine_gather = 1.0
        store = lloyal.BranchStore(ctx)
        root = Branch.create(ctx, 0, GREEDY)
        root.prefill(ctx.tokenize(PROMPT))
        t0 = time.perf_counter()
        store.commit([(root, root.sample())])
        held = time.perf_counter() - t0
        assert held < 0.5, f"the commit waited {held:.2f} s: the window did not end"
        # A fork's first commit without its parent's still waits the window out (the caller
        # may be forking more): the rule only ends it on the prefilled branch.
        root.prefill(ctx.tokenize(" and then", add_special=False))
        kid = root.fork()
        t0 = time.perf_counter()
        store.commit([(kid, kid.sample())])
        assert time.perf_counter() - t0 >= 0.9


def test_an_idle_engine_waits_for_a_burst_only_while_prompts_come_with_company(
    model: lloyal.Model,
) -> None:
    """An idle engine given a prompt waits a moment for the rest of a burst; after a wait that
    ended with one caller's prompt alone, the next prompt starts at once, until two callers'
    prompts come together again."""
    with lloyal.Context(model, n_ctx=1024, n_batch=64, n_seq_max=4) as ctx:
        tokens = ctx.tokenize(PROMPT)

        def lone_prefills(n: int) -> None:
            for _ in range(n):
                branch = Branch.create(ctx, 0, GREEDY)
                branch.prefill(tokens)
                branch.prune()

        lone_prefills(3)
        first = ctx.engine_stats()
        assert first.burst_waits == 1, "only the first prompt waited: nobody came"
        assert first.burst_wait_seconds > 0
        a, b = Branch.create(ctx, 0, GREEDY), Branch.create(ctx, 0, GREEDY)
        before, after, errors = run_queued(ctx, [lambda: a.prefill(tokens), lambda: b.prefill(tokens)], 2)
        assert not errors
        assert (after.burst_waits, after.decode_calls - before.decode_calls) == (2, 1), "company: a wait"
        lone_prefills(3)
        last = ctx.engine_stats()
        assert last.burst_waits == 3, "the wait after company, then none"
        assert (a.position, b.position) == (len(tokens), len(tokens))


def test_a_prompt_after_the_stepping_branches_are_pruned_fills_the_batch(model: lloyal.Model) -> None:
    """Right after a branch's commits, a prompt is paced as if that stream would come back
    (the next commit is usually milliseconds away); once the branch is pruned it cannot, and
    the next prefill runs as one ``llama_decode``."""
    with lloyal.Context(model, n_ctx=2048, n_batch=512, n_seq_max=2) as ctx:
        store = lloyal.BranchStore(ctx)
        prompt = [1000 + (i * 7) % 3000 for i in range(512)]
        b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
        b.prefill(prompt[:16])
        for step in range(8):
            store.commit([(b, 2000 + step)])
        b.prune()
        before = ctx.engine_stats().decode_calls
        lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)).prefill(prompt)
        assert ctx.engine_stats().decode_calls - before == 1


def test_a_prompt_after_a_generation_request_ended_fills_the_batch(model: lloyal.Model) -> None:
    """A branch whose generation request ended is not a stream that comes back in a moment,
    even while it lives (a server's prefix cache keeps it): the next prompt, right after the
    last token, runs as one ``llama_decode`` instead of paced chunks. A branch that commits by
    hand still counts while it lives (the test above)."""
    with lloyal.Context(model, n_ctx=2048, n_batch=512, n_seq_max=2) as ctx:
        prompt = [1000 + (i * 7) % 3000 for i in range(512)]
        b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
        b.prefill(prompt[:16])
        it = b.generate(8)
        assert len(list(it)) == 8 and it.finish_reason == "length"
        before = ctx.engine_stats().decode_calls
        lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)).prefill(prompt)
        assert ctx.engine_stats().decode_calls - before == 1
        assert not b.disposed and b.position == 16 + 8


def test_a_prompt_that_waited_before_the_streams_started_is_not_paced_behind_them(
    model: lloyal.Model,
) -> None:
    """``generate(waited=)``: a request that waited (in a server's queue) while a stream
    started is older than that stream, so its prompt fills the batch; without it the prompt
    is paced next to the stream, a few rows a tick."""
    with lloyal.Context(model, n_ctx=2048, n_batch=512, n_seq_max=3) as ctx:
        stream = Branch.create(ctx, 0, GREEDY)
        stream.prefill(ctx.tokenize(PROMPT))
        stop = threading.Event()

        def run_stream() -> None:
            it = stream.generate(1500)
            for _ in it:
                if stop.is_set():
                    it.close()
                    return

        t = threading.Thread(target=run_stream)
        t.start()
        try:
            wait_until(lambda: ctx.engine_stats().ticks > 20)  # the pacer measured the stream
            prompt = [1000 + (i * 7) % 3000 for i in range(200)]
            ticks: dict[float, list[int]] = {0.0: [], 5.0: []}
            for waited in (0.0, 5.0, 0.0):
                b = Branch.create(ctx, 0, GREEDY)
                before = ctx.engine_stats().ticks
                assert len(list(b.generate(1, prompt=prompt, waited=waited))) == 1
                ticks[waited].append(ctx.engine_stats().ticks - before)
                b.prune()
        finally:
            stop.set()
            t.join()
        # One prefill tick (and its commit) for the prompt that waited. Of the two that did not,
        # at least one is paced: the other may find the stream's thread late back (over
        # ACTIVE_GAP, 50 ms, on a loaded host), when nothing runs to be protected.
        assert ticks[5.0][0] <= 3 < 10 <= max(ticks[0.0]), ticks
        with pytest.raises(ValueError, match="waited must be"):
            stream.generate(1, waited=-1.0)
        stream.prune()


def test_a_verify_shares_its_ticks_with_other_callers(ctx8: lloyal.Context) -> None:
    """``Branch.verify`` is engine work: its drafts decode in one tick beside another thread's
    commit, its bonus in the next; each caller gets what it would have got alone."""
    root, (spec, other) = forks(ctx8, 2)
    want = greedy_completion(ctx8, ctx8.tokenize(PROMPT), 4)
    drafts = [want[0], want[1], want[2] + 1]  # the third is wrong: 2 accepted, bonus want[2]
    token = other.produce().token
    got: list[int] = []
    before, after, errors = run_queued(
        ctx8, [lambda: got.append(spec.verify(drafts)), lambda: other.commit(token)], 2
    )
    assert errors == [] and got == [2]
    assert after.ticks - before.ticks == 2 and after.decode_calls - before.decode_calls == 2
    assert after.rows - before.rows == len(drafts) + 1 + 1  # drafts + the commit, then the bonus
    assert after.max_ops_per_tick == 2 and after.ops_submitted - before.ops_submitted == 2
    assert (spec.position, spec.last_token) == (root.position + 3, want[2])
    assert ctx8.kv_seq_pos_max(spec.seq_id) == spec.position - 1  # the wrong draft's cell went
    assert (other.position, other.last_token) == (root.position + 1, token)
    with Branch.create(ctx8, 0, GREEDY) as alone:  # the same as a verify with nothing beside it
        alone.prefill(ctx8.tokenize(PROMPT))
        assert alone.verify(drafts) == 2 and alone.perplexity == spec.perplexity
        assert np.array_equal(alone.logits, spec.logits)


def test_a_verify_keeps_the_cell_of_its_bonus_from_later_operations(model: lloyal.Model) -> None:
    """The bonus commits a tick after the drafts: its cell is held for it, so a prefill queued
    behind the verify that would take the last free cell is refused, not the verify."""
    with lloyal.Context(model, n_ctx=256, n_batch=64, n_seq_max=4) as ctx:
        root, (spec, other) = forks(ctx, 2)
        drafts = greedy_completion(ctx, ctx.tokenize(PROMPT), 3)  # all three accepted, then a bonus: 4 cells
        free = BranchStore(ctx).kv_pressure.remaining
        got: list[int] = []
        errors, late = run_in_order(
            ctx, [lambda: got.append(spec.verify(drafts)), lambda: other.prefill([1000] * (free - 3))]
        )
        assert errors == [] and got == [3]
        assert len(late) == 1 and isinstance(late[0], lloyal.KvCacheFullError)
        assert (spec.position, other.position) == (root.position + 4, root.position)
        assert BranchStore(ctx).kv_pressure.remaining == free - 4


def test_a_fork_queued_behind_a_verify_waits_for_its_bonus(ctx8: lloyal.Context) -> None:
    """A fork queued behind a verify of its parent waits (the parent is busy until the bonus is
    committed): it copies the branch with the accepted drafts and the bonus."""
    root, (spec,) = forks(ctx8, 1)
    drafts = greedy_completion(ctx8, ctx8.tokenize(PROMPT), 3)
    made: list[Branch] = []
    errors, late = run_in_order(
        ctx8, [lambda: spec.verify(drafts), lambda: made.append(spec.fork(timeout=5.0))]
    )
    assert errors == [] and late == [] and len(made) == 1
    assert spec.position == root.position + 4  # three drafts and the bonus
    assert (made[0].position, made[0].last_token) == (spec.position, spec.last_token)
    assert np.array_equal(made[0].logits, spec.logits)
