"""Generation requests run by the engine (docs/engine.md, "Generation requests"):
``Branch.generate`` samples and commits in Rust, applies stop strings, stop tokens,
``max_tokens`` and logprobs, coalesces concurrent generators into one decode per tick, and
frees a closed or abandoned request at the next tick."""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import pytest
from helpers import context_fixture, exact_model_fixture, prefilled, run_queued, wait_until

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

model = exact_model_fixture()  # runs compared by ==: batch-invariant, on the CPU on a GPU run too


GREEDY = SamplingParams(temperature=0)
PROMPT = "The three most important inventions of the last century were"


ctx9 = context_fixture(n_ctx=1024, n_batch=64, n_seq_max=10)


@pytest.fixture
def root(ctx9: lloyal.Context) -> Branch:
    return prefilled(ctx9, PROMPT)


def hand_loop(branch: Branch, n: int) -> list[int]:
    """Greedy reference: produce/commit by hand, stopping before a stop token."""
    out: list[int] = []
    for _ in range(n):
        p = branch.produce()
        if p.is_stop:
            break
        branch.commit(p.token)
        out.append(p.token)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def test_greedy_generation_equals_a_hand_loop(ctx9: lloyal.Context, root: Branch) -> None:
    twin = root.fork()
    pos = root.position
    cells = BranchStore(ctx9).kv_pressure.cells_used
    it = root.generate(12)
    assert it.finish_reason is None and it.perplexity is None
    toks = list(it)
    assert [t.token for t in toks] == hand_loop(twin, 12)
    assert it.finish_reason == "length"
    assert it.perplexity == root.perplexity == twin.perplexity  # given with the end: no context call
    assert it.perplexity is not None and 1.0 < it.perplexity < 1e4
    assert root.position == pos + 12
    assert ctx9.kv_seq_pos_max(root.seq_id) == pos + 11
    assert BranchStore(ctx9).kv_pressure.cells_used == cells + 12 + 12  # root + twin
    assert "".join(t.text for t in toks) == ctx9.detokenize([t.token for t in toks])
    assert all(t.logprob is None and t.top_logprobs is None for t in toks)
    assert ctx9.engine_stats().generating == 0


def test_the_last_token_uncommitted_saves_its_decode_and_comes_next(
    ctx9: lloyal.Context, root: Branch
) -> None:
    """``commit_last=False``: the same tokens, the one that reaches ``max_tokens`` never
    decoded (one decode call and one cell fewer); the branch ends before it, and generating
    on yields it first."""
    ref = hand_loop(root.fork(), 8)
    pos = root.position
    twin = root.fork()
    calls = ctx9.engine_stats().decode_calls
    assert [t.token for t in twin.generate(6)] == ref[:6]
    assert ctx9.engine_stats().decode_calls - calls == 6 and twin.position == pos + 6
    calls = ctx9.engine_stats().decode_calls
    it = root.generate(6, commit_last=False, logprobs=True)
    toks = list(it)
    assert [t.token for t in toks] == ref[:6] and it.finish_reason == "length"
    assert ctx9.engine_stats().decode_calls - calls == 5
    assert root.position == pos + 5 and ctx9.kv_seq_pos_max(root.seq_id) == pos + 4
    assert toks[-1].logprob is not None and toks[-1].logprob <= 0.0
    assert [t.token for t in root.generate(3)] == ref[5:8]
    assert root.position == pos + 8


def test_the_first_token_after_a_prompt_comes_before_its_decode(ctx9: lloyal.Context, root: Branch) -> None:
    """``commit_last=False`` with a prompt: the first token is yielded as the prompt is written,
    before the decode that commits it, which runs when the consumer asks for the next one (a
    consumer that stops there leaves the branch before it). The tokens are a hand loop's, and
    ``committed`` counts the yielded tokens the branch holds."""
    extra = ctx9.tokenize(" Number four is", add_special=False)
    ref_branch = root.fork()
    ref_branch.prefill(extra)
    ref = hand_loop(ref_branch, 4)
    b = root.fork()
    pos = b.position
    calls = ctx9.engine_stats().decode_calls
    it = b.generate(4, prompt=extra, commit_last=False)
    first = next(it)
    assert first.token == ref[0]
    time.sleep(0.05)  # nothing is decoded until the next ask
    assert ctx9.engine_stats().decode_calls - calls == 1  # the prompt's
    assert b.position == pos + len(extra) and it.committed is None
    rest = list(it)
    assert [t.token for t in [first, *rest]] == ref and it.finish_reason == "length"
    assert ctx9.engine_stats().decode_calls - calls == 1 + 3  # the 4th never decoded
    assert it.committed == 3 and b.position == pos + len(extra) + 3
    assert it.perplexity == b.perplexity

    stopped = root.fork()  # stops at the first token: its branch never holds it
    it = stopped.generate(4, prompt=extra, commit_last=False)
    assert next(it).token == ref[0]
    it.close()
    wait_until(lambda: ctx9.engine_stats().generating == 0)
    assert stopped.position == pos + len(extra)
    assert [t.token for t in stopped.generate(2)] == ref[:2]  # and generates it next
    one = root.fork()  # max_tokens=1: yielded with the prompt's tick, never decoded
    calls = ctx9.engine_stats().decode_calls
    it = one.generate(1, prompt=extra, commit_last=False)
    assert [t.token for t in it] == ref[:1] and it.finish_reason == "length" and it.committed == 0
    assert ctx9.engine_stats().decode_calls - calls == 1 and one.position == pos + len(extra)
    none = root.fork()  # max_tokens=0: the prompt only, nothing yielded
    it = none.generate(0, prompt=extra, commit_last=False)
    assert list(it) == [] and it.finish_reason == "length" and none.position == pos + len(extra)


def test_stop_string_across_token_boundaries_is_not_yielded(ctx9: lloyal.Context, root: Branch) -> None:
    ref_branch = root.fork()
    ref = hand_loop(ref_branch, 16)
    pieces = [ctx9.token_to_text(t) for t in ref]
    # a stop string made of the last 2 characters of piece 4 and the first 2 of piece 5
    k = next(i for i in range(3, 12) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    full = "".join(pieces)
    cut = full.index(stop)
    pos = root.position
    it = root.generate(16, stop=[stop, "never-appears-zz"])
    toks = list(it)
    text = "".join(t.text for t in toks)
    assert text == full[:cut]
    assert stop not in text
    # every token up to the one completing the stop string is committed and yielded
    n = next(i + 1 for i in range(len(ref)) if len("".join(pieces[: i + 1])) >= cut + len(stop))
    assert [t.token for t in toks] == ref[:n]
    assert it.finish_reason == "stop"
    assert root.position == pos + n


def test_stop_tokens_and_max_tokens(ctx9: lloyal.Context, root: Branch) -> None:
    ref = hand_loop(root.fork(), 8)
    pos = root.position
    k = next(i for i in range(2, 8) if ref[i] not in ref[:i])
    it = root.generate(8, stop_tokens=[ref[k]])
    assert [t.token for t in it] == ref[:k]
    assert it.finish_reason == "stop"
    assert root.position == pos + k  # the stop token is not committed
    it = root.generate(0)
    assert list(it) == [] and it.finish_reason == "length"
    it = root.generate(2)
    assert [t.token for t in it] == ref[k : k + 2] and it.finish_reason == "length"
    it.close()  # closing after the end changes nothing
    assert it.finish_reason == "length" and list(it) == []
    assert root.position == pos + k + 2


def test_eog_ends_with_finish_reason_eog(ctx9: lloyal.Context, root: Branch) -> None:
    pos = root.position
    it = root.generate(5)
    first = next(it)
    root.steer({ctx9.eog_token: 1000.0})  # sampling inputs change between tokens
    assert list(it) == []
    assert it.finish_reason == "eog"
    assert root.position == pos + 1 and root.last_token == first.token


def test_logprobs_equal_log_softmax_of_branch_logits(ctx9: lloyal.Context, root: Branch) -> None:
    twin = root.fork()
    toks = list(root.generate(6, logprobs=True, top_logprobs=3))
    # The normaliser is the snapshot's log-sum-exp (f32 exponentials, relative error < 1e-6),
    # computed as the row was copied out of the decode.
    for t in toks:
        want = log_softmax(twin.logits)
        assert t.logprob is not None and t.top_logprobs is not None
        assert t.logprob == pytest.approx(want[t.token], abs=1e-6)
        best = np.argsort(-want, kind="stable")[:3]
        assert [p[0] for p in t.top_logprobs] == [int(i) for i in best]
        assert [p[1] for p in t.top_logprobs] == pytest.approx([want[i] for i in best], abs=1e-6)
        assert t.top_logprobs[0][0] == t.token  # greedy
        twin.commit(t.token)
    only = list(root.generate(2, top_logprobs=2))
    assert all(t.logprob is None and t.top_logprobs is not None and len(t.top_logprobs) == 2 for t in only)


def test_invalid_arguments_raise_specific_errors(ctx9: lloyal.Context, root: Branch) -> None:
    with pytest.raises(lloyal.InvalidTokenError):
        root.generate(3, stop_tokens=[ctx9.n_vocab])
    with pytest.raises(ValueError, match="top_logprobs"):
        next(root.generate(3, top_logprobs=21))
    with pytest.raises(ValueError, match="stop string is empty"):
        next(root.generate(3, stop=[""]))
    a = root.generate(3)
    next(a)
    with pytest.raises(ValueError, match="already generating"):
        next(root.generate(3))
    a.close()


def test_eight_generators_in_threads_share_one_decode_per_tick(ctx9: lloyal.Context, root: Branch) -> None:
    kids = [root.fork() for _ in range(8)]
    twin = root.fork()
    want = hand_loop(twin, 6)
    twin.prune()
    ctx9.engine_gather = 0.05  # a loaded machine: give every thread time to ask again
    results: dict[int, list[int]] = {}

    def run(i: int, b: Branch) -> None:
        results[i] = [t.token for t in b.generate(6)]

    calls = [functools.partial(run, i, b) for i, b in enumerate(kids)]
    before, after, errors = run_queued(ctx9, calls, 8)
    assert errors == []
    assert results == {i: want for i in range(8)}
    assert after.rows - before.rows == 48
    assert after.decode_calls - before.decode_calls == after.ticks - before.ticks  # one decode per tick
    assert after.max_ops_per_tick == 8
    assert after.ticks - before.ticks < 48  # coalesced: far fewer ticks than tokens
    # A request's end reaches its iterator through the token stream, a moment before the
    # engine counts the operation answered: wait for the count rather than race it.
    wait_until(lambda: ctx9.engine_stats().ops_completed - before.ops_completed == 8)
    assert ctx9.engine_stats().generating == 0


def test_eight_asyncio_tasks_share_one_decode_per_tick(ctx9: lloyal.Context, root: Branch) -> None:
    kids = [root.fork() for _ in range(8)]
    twin = root.fork()
    want = hand_loop(twin, 6)
    twin.prune()

    async def one(b: Branch) -> list[int]:
        return [t.token async for t in b.generate(6)]

    async def main() -> list[list[int]]:
        ctx9.pause_engine()
        tasks = [asyncio.create_task(one(b)) for b in kids]
        while ctx9.engine_stats().queue_depth < 8:
            await asyncio.sleep(0.001)
        ctx9.resume_engine()
        return await asyncio.gather(*tasks)

    before = ctx9.engine_stats()
    got = asyncio.run(main())
    after = ctx9.engine_stats()
    assert got == [want] * 8
    assert after.rows - before.rows == 48
    assert after.max_ops_per_tick == 8
    assert after.decode_calls - before.decode_calls == after.ticks - before.ticks
    # one asyncio loop asks for all 8 next tokens before the engine's next tick: lockstep
    assert after.ticks - before.ticks == 6


def test_break_frees_the_request_at_the_next_tick(ctx9: lloyal.Context, root: Branch) -> None:
    pos = root.position
    cells = BranchStore(ctx9).kv_pressure.cells_used
    got = []
    for tok in root.generate(50):
        got.append(tok.token)
        if len(got) == 3:
            break
    gc.collect()
    wait_until(lambda: ctx9.engine_stats().generating == 0)
    assert root.position == pos + 3  # one token per next(): nothing ran ahead
    assert BranchStore(ctx9).kv_pressure.cells_used == cells + 3
    assert ctx9.kv_seq_pos_max(root.seq_id) == pos + 2
    assert BranchStore(ctx9).available == 10 - 1
    it = root.generate(2)
    assert len(list(it)) == 2 and it.finish_reason == "length"
    # close() is idempotent and ends iteration; the finish reason stays None
    it = root.generate(5)
    next(it)
    it.close()
    it.close()
    assert list(it) == [] and it.finish_reason is None and it.perplexity is None
    wait_until(lambda: ctx9.engine_stats().generating == 0)
    assert root.position == pos + 6


def test_cancelling_the_asyncio_task_frees_the_request(ctx9: lloyal.Context, root: Branch) -> None:
    pos = root.position
    seen: list[int] = []

    async def consume() -> None:
        async for t in root:
            seen.append(t.token)
            if len(seen) == 2:
                await asyncio.sleep(3600)

    async def main() -> None:
        task = asyncio.create_task(consume())
        while len(seen) < 2:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    gc.collect()
    wait_until(lambda: ctx9.engine_stats().generating == 0)
    assert root.position == pos + 2


def test_cancelling_a_task_waiting_for_a_token_frees_the_request(ctx9: lloyal.Context, root: Branch) -> None:
    pos = root.position

    async def main() -> None:
        it = root.generate(20)
        ctx9.pause_engine()
        task = asyncio.create_task(it.__anext__())
        while ctx9.engine_stats().queue_depth < 1:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ctx9.resume_engine()
        wait_until(lambda: ctx9.engine_stats().ops_failed >= 1 and ctx9.engine_stats().queue_depth == 0)
        assert [t async for t in it] == []

    asyncio.run(main())
    assert root.position == pos
    assert ctx9.engine_stats().generating == 0


def test_grammar_constrained_generation(ctx9: lloyal.Context) -> None:
    yes_no = 'root ::= "yes" | "no"'
    with Branch.create(ctx9, 0, GREEDY, grammar=yes_no) as b:
        b.prefill(ctx9.tokenize("Is the sky blue? Answer:"))
        twin = b.fork()
        it = b.generate(10)
        out = [t.token for t in it]
        assert ctx9.detokenize(out) in ("yes", "no")
        assert out == hand_loop(twin, 10)
        assert it.finish_reason == "eog"  # the completed grammar allows only EOG
        assert b.produce().is_stop


# --------------------------------------------------------------------------- backpressure


small = context_fixture(n_ctx=256, n_batch=64, n_seq_max=4)


def next_in_thread(it: lloyal.TokenIterator, out: list[object]) -> threading.Thread:
    def run() -> None:
        try:
            out.extend(it)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_request_without_room_waits_fifo_until_room_frees(small: lloyal.Context) -> None:
    root = Branch.create(small, 0, GREEDY)
    root.prefill(small.tokenize(PROMPT))
    a, b, c = root.fork(), root.fork(), root.fork()
    n_ctx = BranchStore(small).kv_pressure.n_ctx
    free = n_ctx - BranchStore(small).kv_pressure.cells_used
    ita = a.generate(free - 20)  # reserves all but 20 cells
    next(ita)
    got_b: list[object] = []
    got_c: list[object] = []
    tb = next_in_thread(b.generate(30), got_b)  # 30 > 20: waits
    wait_until(lambda: small.engine_stats().waiting == 1)
    tc = next_in_thread(c.generate(5), got_c)  # 5 would fit, but may not overtake b
    wait_until(lambda: small.engine_stats().waiting == 2)
    time.sleep(0.05)
    assert (b.position, c.position, got_b, got_c) == (root.position, root.position, [], [])
    assert small.engine_stats().generating == 1
    ita.close()  # a's unused reservation is released at the next tick
    tb.join()
    tc.join()
    assert all(isinstance(t, lloyal.Token) for t in got_b + got_c), (got_b, got_c)
    assert (len(got_b), len(got_c)) == (30, 5)
    assert (b.position, c.position, a.position) == (root.position + 30, root.position + 5, root.position + 1)
    assert small.engine_stats().waiting == 0


def test_a_waiting_request_times_out_and_one_that_never_fits_fails_at_once(small: lloyal.Context) -> None:
    root = Branch.create(small, 0, GREEDY)
    root.prefill(small.tokenize(PROMPT))
    a, b = root.fork(), root.fork()
    p = BranchStore(small).kv_pressure
    ita = a.generate(p.remaining - 10)
    next(ita)
    t0 = time.monotonic()
    with pytest.raises(lloyal.KvCacheFullError, match="waited"):
        next(b.generate(20, timeout=0.05))
    assert time.monotonic() - t0 >= 0.05
    assert b.position == root.position
    assert small.engine_stats().waiting == 0
    with pytest.raises(lloyal.KvCacheFullError, match="can never fit"):
        next(b.generate(p.n_ctx - root.position + 1))
    with pytest.raises(ValueError, match="timeout"):
        b.generate(3, timeout=-1.0)
    # the running request was not disturbed
    assert len(list(ita)) == p.remaining - 11 and ita.finish_reason in ("length", "eog")


def test_running_requests_that_outgrow_the_cache_fail_youngest_first(small: lloyal.Context) -> None:
    root = Branch.create(small, 0, GREEDY)
    n_ctx = BranchStore(small).kv_pressure.n_ctx
    filler = (small.tokenize(PROMPT, add_special=False) * n_ctx)[: n_ctx - 1]
    root.prefill(filler)
    assert BranchStore(small).kv_pressure.remaining == 1
    old, young = root.fork(), root.fork()
    got_old: list[object] = []
    got_young: list[object] = []
    small.pause_engine()
    it_old = old.generate()  # unbounded: takes one cell per step
    t_old = threading.Thread(target=lambda: got_old.append(next(it_old)))
    t_old.start()
    wait_until(lambda: small.engine_stats().queue_depth == 1)
    t_young = next_in_thread(young.generate(), got_young)
    wait_until(lambda: small.engine_stats().queue_depth == 2)
    small.resume_engine()
    t_old.join()
    t_young.join()
    assert isinstance(got_old[0], lloyal.Token)
    assert len(got_young) == 1 and isinstance(got_young[0], lloyal.KvCacheFullError)
    assert (old.position, young.position) == (n_ctx, n_ctx - 1)
    with pytest.raises(lloyal.KvCacheFullError):
        next(it_old)  # now the cache is full for the old one too
    assert old.position == n_ctx


# --------------------------------------------------------------------------- faults stay local


def test_a_packed_decode_llama_cpp_rejects_is_isolated_to_its_culprit(model: lloyal.Model) -> None:
    """Flat-path cells (``ctx.decode`` on an unleased sequence) fill llama.cpp's cache behind
    the branches' accounting (room checks told not to count them, as they do by default), so a
    30-token prefill passes validation but the packed batch it
    shares with a commit and a generation step has no slot: llama.cpp rejects the whole batch.
    The engine retries each operation alone: the commit and the generation step proceed with
    the results they would have had alone, the prefill fails and changes nothing."""
    with lloyal.Context(model, n_ctx=256, n_batch=64, n_seq_max=5) as small:
        isolate(small)


def isolate(small: lloyal.Context) -> None:
    small._count_flat_cells = False  # else the room check refuses the prefill first
    root = prefilled(small, PROMPT)
    a, g, bad = root.fork(), root.fork(), root.fork()
    n_ctx = BranchStore(small).kv_pressure.n_ctx
    filler = small.tokenize(" hello world", add_special=False) * n_ctx
    flat = n_ctx - root.position - 10  # leaves 10 free cells in llama.cpp's cache
    small.decode(filler[:flat], 0, 4)
    assert BranchStore(small).kv_pressure.remaining == n_ctx - root.position  # not counted
    token = a.produce().token
    want = hand_loop(root, 1)  # root: the reference for the generation step
    logits_a = root.logits.copy()  # root committed `want` alone: a commits the same token
    assert want == [token]
    results: dict[str, object] = {}

    def run(name: str, call: Callable[[], object]) -> None:
        try:
            results[name] = call()
        except BaseException as e:
            results[name] = e

    def first_token() -> object:
        it = g.generate(3)
        results["gen_iter"] = it  # kept open: dropping it would cancel (and count) the request
        return next(it)

    calls = [
        functools.partial(run, "commit", lambda: a.commit(token)),
        functools.partial(run, "gen", first_token),
        functools.partial(run, "prefill", lambda: bad.prefill(filler[:30])),
    ]
    before, after, _ = run_queued(small, calls, 3)
    assert isinstance(results["prefill"], lloyal.KvCacheFullError), results
    assert results["commit"] is None
    assert isinstance(results["gen"], lloyal.Token) and results["gen"].token == token
    # one packed decode rejected, then each operation alone
    assert after.decode_calls - before.decode_calls == 4
    assert after.ops_failed - before.ops_failed == 1
    assert (a.position, g.position, bad.position) == (root.position,) * 2 + (root.position - 1,)
    assert small.kv_seq_pos_max(bad.seq_id) == root.position - 2  # the prefill's rows were removed
    np.testing.assert_array_equal(a.logits, logits_a)
    np.testing.assert_array_equal(g.logits, logits_a)


# --------------------------------------------------------------------------- determinism

TARGET = "Write one sentence about the sea:"


async def generate_from(ctx: lloyal.Context, prompt: str, n: int) -> list[tuple[int, float | None]]:
    b = Branch.create(ctx, 0, GREEDY)
    await b.aprefill(ctx.tokenize(prompt))
    return [(t.token, t.logprob) async for t in b.generate(n, logprobs=True)]


def test_greedy_generation_is_the_same_alone_crowded_and_chunked(model: lloyal.Model) -> None:
    n = 12
    with lloyal.Context(model, n_ctx=2048, n_batch=64, n_seq_max=2) as c:
        alone = asyncio.run(generate_from(c, TARGET, n))
    with lloyal.Context(model, n_ctx=2048, n_batch=5, n_seq_max=2) as c:
        chunked = asyncio.run(generate_from(c, TARGET, n))  # prefill over 2 ticks of 5 tokens
    assert chunked == alone

    async def crowded(c: lloyal.Context) -> list[tuple[int, float | None]]:
        others = [
            asyncio.create_task(generate_from(c, f"Story {i}: " + "once upon a time " * (i % 4), 40))
            for i in range(15)
        ]
        while c.engine_stats().generating < 8:  # the target's prefill shares ticks with streams
            await asyncio.sleep(0.001)
        target = await generate_from(c, TARGET, n)
        await asyncio.gather(*others)
        return target

    with lloyal.Context(model, n_ctx=2048, n_batch=16, n_seq_max=16) as c:
        before = c.engine_stats()
        got = asyncio.run(crowded(c))
        after = c.engine_stats()
    assert got == alone  # token ids and logprobs, bit for bit
    assert after.max_ops_per_tick >= 8
    assert after.rows - before.rows > after.decode_calls - before.decode_calls  # really batched


def test_engine_prefill_chunk_caps_the_prompt_tokens_of_a_tick(ctx9: lloyal.Context) -> None:
    assert ctx9.engine_prefill_chunk is None  # paced (the next test)
    tokens = (ctx9.tokenize(PROMPT, add_special=False) * 8)[:40]
    ref = Branch.create(ctx9, 0, GREEDY)
    ref.prefill(tokens)
    ctx9.engine_prefill_chunk = 8
    b = Branch.create(ctx9, 0, GREEDY)
    before = ctx9.engine_stats()
    b.prefill(tokens)
    after = ctx9.engine_stats()
    assert (after.ticks - before.ticks, after.decode_calls - before.decode_calls) == (5, 5)
    assert after.rows - before.rows == 40
    np.testing.assert_array_equal(b.logits, ref.logits)  # chunking changes nothing
    with pytest.raises(ValueError, match="engine_prefill_chunk"):
        ctx9.engine_prefill_chunk = -1
    assert ctx9.engine_prefill_chunk == 8
    ctx9.engine_prefill_chunk = None
    assert ctx9.engine_prefill_chunk is None


def test_a_prompt_is_paced_next_to_running_streams(ctx9: lloyal.Context, root: Branch) -> None:
    """By default a prompt fills the batch when nothing runs, and is cut into small chunks
    (a tick at most ~1.5x a decode-only tick) while streams run; the result is the same."""
    tokens = (ctx9.tokenize(PROMPT, add_special=False) * 40)[:256]
    alone = Branch.create(ctx9, 0, GREEDY)
    before = ctx9.engine_stats()
    alone.prefill(tokens)
    after = ctx9.engine_stats()
    assert after.ticks - before.ticks == 256 // 64 and after.prefill_cap == 0  # n_batch=64: 4 full ticks
    streams = [root.fork() for _ in range(4)]
    got: list[list[int]] = [[] for _ in streams]
    stop = threading.Event()

    def consume(i: int) -> None:
        it = streams[i].generate(120)
        try:
            for tok in it:
                got[i].append(tok.token)
                if stop.is_set():
                    break
        finally:
            it.close()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: all(len(g) >= 2 for g in got))
    b = Branch.create(ctx9, 0, GREEDY)
    before = ctx9.engine_stats()
    b.prefill(tokens)
    after = ctx9.engine_stats()
    caps = after.prefill_cap
    stop.set()
    for t in threads:
        t.join()
    assert 0 < caps < 64  # capped next to 4 decode rows
    assert after.ticks - before.ticks > 256 // 64  # so the prompt took more, smaller ticks
    np.testing.assert_array_equal(b.logits, alone.logits)  # paced chunks change nothing
    assert all(len(g) >= 3 for g in got)


def _ticks_of_a_burst(model: lloyal.Model, chunk: int | None) -> tuple[int, int]:
    """Two short prompts generating 12 tokens each and one ~1900-token prompt generating 1,
    all queued before the engine runs (a burst), with n_batch 512: the ticks until all three
    end, and the number of 512-row ticks the prompts fill. The short requests read ahead 12
    tokens, so whether they step in a tick is the engine's choice alone, never their readers'.
    ``chunk``: ``engine_prefill_chunk``."""
    ctx = lloyal.Context(model, n_ctx=4096, n_batch=512, n_seq_max=4)
    try:
        ctx.engine_prefill_chunk = chunk
        short = ctx.tokenize(PROMPT)
        long = (ctx.tokenize(PROMPT, add_special=False) * 200)[:1900]
        a, b, c = (Branch.create(ctx, 0, GREEDY) for _ in range(3))
        ctx.pause_engine()
        before = ctx.engine_stats()
        its = [
            a.generate(12, prompt=short, lookahead=12),
            b.generate(12, prompt=short, lookahead=12),
            c.generate(1, prompt=long),
        ]
        got: list[list[lloyal.Token]] = [[], [], []]
        threads = [threading.Thread(target=lambda i=i: got[i].extend(its[i])) for i in range(3)]
        for t in threads:
            t.start()
        # Each request is submitted by its iterator's first next(): all three wait in the queue.
        wait_until(lambda: ctx.engine_stats().ops_submitted - before.ops_submitted == 3)
        ctx.resume_engine()
        for t in threads:
            t.join()
        assert [len(g) for g in got] == [12, 12, 1]
        prompt_rows = 2 * len(short) + len(long)
        return ctx.engine_stats().ticks - before.ticks, -(-prompt_rows // 512)
    finally:
        ctx.close()


def test_requests_of_a_burst_step_once_per_2048_prompt_rows(model: lloyal.Model) -> None:
    """While a burst's prompts fill the batch, the requests whose prompts are already written
    step once per 2048 prompt rows, not next to every 512-row chunk (each step there is a
    separate decode of their rows): the long prompt's chunks run without them, and their 12
    steps begin in the tick after its last chunk. With a fixed ``engine_prefill_chunk`` they
    step in every tick from the second on, next to the chunks."""
    held, chunks = _ticks_of_a_burst(model, None)
    every_tick, _ = _ticks_of_a_burst(model, 512)
    assert chunks == 4
    assert held == chunks + 12
    assert every_tick == 1 + 12


def test_a_request_with_a_prompt_prefills_it_through_the_engine(ctx9: lloyal.Context) -> None:
    tokens = ctx9.tokenize(PROMPT)
    ref = Branch.create(ctx9, 0, GREEDY)
    ref.prefill(tokens)
    want = hand_loop(ref, 6)
    ctx9.engine_prefill_chunk = 4
    b = Branch.create(ctx9, 0, GREEDY)
    before = ctx9.engine_stats()
    it = b.generate(6, prompt=tokens)
    assert [t.token for t in it] == want
    time.sleep(0.05)
    after = ctx9.engine_stats()
    chunks = -(-len(tokens) // 4)
    assert after.decode_calls - before.decode_calls == chunks + 6
    assert after.rows - before.rows == len(tokens) + 6
    assert it.finish_reason == "length" and b.position == len(tokens) + 6
    c = Branch.create(ctx9, 0, GREEDY)
    it = c.generate(0, prompt=tokens)
    assert list(it) == [] and it.finish_reason == "length"
    assert c.position == len(tokens)  # the prompt is written even for max_tokens=0
    d = Branch.create(ctx9, 0, GREEDY)
    with pytest.raises(lloyal.InvalidTokenError):
        d.generate(3, prompt=[ctx9.n_vocab])
    with pytest.raises(lloyal.KvCacheFullError, match="can never fit"):
        next(d.generate(1020, prompt=tokens))
    with pytest.raises(lloyal.LloyalError, match="no logits available"):
        next(d.generate(3))  # no prompt and nothing prefilled: nothing to sample from
    assert d.position == 0


# --------------------------------------------------------------------------- lookahead, reservation


def test_lookahead_runs_ahead_of_the_reader_by_at_most_k_tokens(ctx9: lloyal.Context, root: Branch) -> None:
    ref, ahead = root.fork(), root.fork()
    want = hand_loop(ref, 12)
    start = ahead.position
    it = ahead.generate(12, lookahead=4)
    first = next(it)
    assert first.token == want[0]
    # The engine fills the read-ahead without being asked: 4 unread tokens past the one read.
    wait_until(lambda: ahead.position == start + 5)
    time.sleep(0.05)
    assert ahead.position == start + 5, "it stops at k unread tokens"
    assert next(it).token == want[1]
    wait_until(lambda: ahead.position == start + 6)  # the read made room: one more
    assert [t.token for t in it] == want[2:]
    assert it.finish_reason == "length" and ahead.position == start + 12
    again = root.fork()
    it = again.generate(12, lookahead=3)
    next(it)
    it.close()  # the reader stops after 1 token: the branch is at most 2 further on
    wait_until(lambda: ctx9.engine_stats().generating == 0)
    assert start + 1 <= again.position <= start + 3
    with pytest.raises(ValueError, match="lookahead"):
        again.generate(4, lookahead=0)


def test_a_generating_branch_refuses_commits_and_prefills_by_hand(ctx9: lloyal.Context, root: Branch) -> None:
    """A commit or prefill on a branch whose ``generate()`` stream is open raises, and the stream
    goes on: the engine dropped the stream's request for its next token in the tick the commit
    held the branch, and the stream waited for good."""
    ref, b = root.fork(), root.fork()
    want = hand_loop(ref, 12)

    async def main() -> tuple[list[int], list[str]]:
        out: list[int] = []
        refused: list[str] = []

        async def stream() -> None:
            async for t in b.generate(12):
                out.append(t.token)

        task = asyncio.ensure_future(stream())
        while not out:
            await asyncio.sleep(0.005)
        for call in (lambda: b.acommit(100), lambda: b.aprefill([101, 102])):
            with pytest.raises(ValueError, match="is generating") as e:
                await call()
            refused.append(str(e.value))
        await asyncio.wait_for(task, 60)
        return out, refused

    out, refused = asyncio.run(main())
    assert out == want and len(refused) == 2
    # in threads: a reader iterating, a second thread committing
    c = root.fork()
    it = c.generate(12)
    first = next(it)
    with pytest.raises(ValueError, match="close that iterator"):
        c.commit(100)
    assert [first.token, *(t.token for t in it)] == want


def test_close_ends_a_stream_that_reads_ahead(model: lloyal.Model) -> None:
    """``close()`` waits for the operations it was given, but a generation request reading
    ahead (``lookahead`` > 1) never let the engine run dry: close took until the cache filled
    (22 s, ~500 tokens). The request now ends with ``ContextClosedError``."""
    ctx = lloyal.Context(model, n_ctx=2048, n_threads=2)
    b = prefilled(ctx, PROMPT)
    got: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for tok in b.generate(lookahead=4):
                got.append(tok.token)
                time.sleep(0.01)  # a slow reader: the engine keeps 4 tokens ahead of it
        except lloyal.LloyalError as e:
            errors.append(e)

    th = threading.Thread(target=reader)
    th.start()
    wait_until(lambda: len(got) >= 3)
    t0 = time.monotonic()
    ctx.close()
    closed_in = time.monotonic() - t0
    th.join(30)
    assert not th.is_alive() and len(errors) == 1 and isinstance(errors[0], lloyal.ContextClosedError)
    assert len(got) < 200, "the stream ended at close, long before the cache was full"
    assert closed_in < 10


def test_a_second_task_awaiting_the_same_iterator_raises(ctx9: lloyal.Context, root: Branch) -> None:
    """Two tasks awaiting one iterator's next token: the second raises ``RuntimeError`` (as an
    async generator's second ``anext()`` does) and the first gets its token; one of them used
    to wait for good."""
    b = root.fork()
    want = hand_loop(root.fork(), 3)

    async def main() -> tuple[list[object], list[object]]:
        it = b.generate(3)
        t1 = asyncio.ensure_future(it.__anext__())
        t2 = asyncio.ensure_future(it.__anext__())
        _, pending = await asyncio.wait([t1, t2], timeout=30)
        rest = [t.token async for t in it]
        return [t.exception() or t.result().token for t in (t1, t2)], [len(pending), *rest]

    (first, second), (pending, *rest) = asyncio.run(main())
    assert first == want[0] and isinstance(second, RuntimeError) and "already awaited" in str(second)
    assert pending == 0 and rest == want[1:]


def test_a_stream_whose_event_loop_closed_mid_read_is_freed(ctx9: lloyal.Context, root: Branch) -> None:
    """An event loop closed while a task reads a stream: the engine held the future the task
    awaited, so the task, its coroutine and the iterator in it (a cycle through Rust that
    Python's collector cannot see), and the branch stayed "already generating" for good. The
    engine holds the future weakly now: the task is collected, the request freed."""
    b = root.fork()
    loop = asyncio.new_event_loop()

    async def stream() -> None:
        async for _ in b.generate(500):
            pass

    task = loop.create_task(stream())
    loop.run_until_complete(asyncio.sleep(0.1))
    loop.close()
    gone = weakref.ref(task)
    del task, loop
    gc.collect()
    assert gone() is None
    wait_until(lambda: ctx9.engine_stats().generating == 0)
    assert len(list(b.generate(3))) == 3  # not "already generating"


def test_async_lookahead_equals_demand_driven(ctx9: lloyal.Context, root: Branch) -> None:
    a, b = root.fork(), root.fork()

    async def main() -> tuple[list[int], list[int]]:
        x = [t.token async for t in a.generate(10)]
        y = [t.token async for t in b.generate(10, lookahead=8)]
        return x, y

    x, y = asyncio.run(main())
    assert x == y and len(x) == 10


def test_without_reservation_a_request_takes_a_cell_per_token_until_the_cache_is_full(
    small: lloyal.Context,
) -> None:
    root = Branch.create(small, 0, GREEDY)
    n_ctx = BranchStore(small).kv_pressure.n_ctx
    filler = (small.tokenize(PROMPT, add_special=False) * n_ctx)[: n_ctx - 3]
    root.prefill(filler)
    b = root.fork()
    with pytest.raises(lloyal.KvCacheFullError, match="can never fit"):
        next(b.generate(10))  # reserving 10 cells: never
    got: list[int] = []
    it = b.generate(10, reserve=False, stop_tokens=[], lookahead=2)
    with pytest.raises(lloyal.KvCacheFullError):
        for t in it:
            got.append(t.token)
    assert len(got) == 3 and b.position == n_ctx  # every free cell was used, then it failed
    assert it.perplexity == b.perplexity and it.perplexity is not None and it.perplexity > 1.0
    assert BranchStore(small).kv_pressure.remaining == 0
    assert small.engine_stats().generating == 0


def hand_min_tokens(
    ctx: lloyal.Context, branch: Branch, n: int, min_tokens: int, stop_tokens: list[int]
) -> list[int]:
    """Greedy reference for ``generate(n, min_tokens=..., stop_tokens=...)``: the end-of-generation
    tokens and ``stop_tokens`` steered to ``-inf`` for the first ``min_tokens`` draws."""
    ends = [t for t in range(ctx.n_vocab) if ctx.is_stop_token(t)] + stop_tokens
    out: list[int] = []
    for i in range(n):
        if i < min_tokens:
            branch.steer(dict.fromkeys(ends, float("-inf")))
        else:
            branch.clear_steer()
        p = branch.produce()
        if p.is_stop or p.token in stop_tokens:
            break
        branch.commit(p.token)
        out.append(p.token)
    branch.clear_steer()
    return out


def test_min_tokens_bans_the_end_until_then_and_leaves_no_ban_behind(
    ctx9: lloyal.Context, root: Branch
) -> None:
    favour = ctx9.tokenize("\n\n", add_special=False)[0]  # made likely, then a stop token
    root.set_logit_bias({favour: 30.0})
    want = hand_min_tokens(ctx9, root.fork(), 8, 3, [favour])
    assert len(want) == 3, "the favoured stop token comes as soon as the ban lifts"
    pos = root.position
    it = root.generate(8, min_tokens=3, stop_tokens=[favour])
    assert [t.token for t in it] == want and it.finish_reason == "stop"
    assert root.position == pos + 3
    assert root.produce().token == favour, "the ban ended with its request"
    # a request that ends by length while the ban holds leaves none behind either
    it = root.generate(2, min_tokens=5, stop_tokens=[favour])
    assert len(list(it)) == 2 and it.finish_reason == "length"
    assert root.produce().token == favour
    # the model's own end-of-generation token is held back the same way
    root.set_logit_bias({ctx9.eog_token: 1000.0})
    eog = hand_min_tokens(ctx9, root.fork(), 6, 2, [])
    it = root.generate(6, min_tokens=2)
    assert [t.token for t in it] == eog and len(eog) == 2 and it.finish_reason == "eog"


def test_stop_strings_are_looked_for_from_min_tokens_and_included_when_asked(
    ctx9: lloyal.Context, root: Branch
) -> None:
    ref = hand_loop(root.fork(), 8)
    pieces = [ctx9.token_to_text(t) for t in ref]
    full = "".join(pieces)
    # a stop string that is one token's whole text, found nowhere else
    k, stop = next((i, p) for i, p in enumerate(pieces) if len(p.strip()) > 2 and full.count(p) == 1)
    it = root.fork().generate(8, stop=[stop])
    assert "".join(t.text for t in it) == full[: full.index(stop)] and it.finish_reason == "stop"
    it = root.fork().generate(8, stop=[stop], min_tokens=k + 2)  # token k comes before min_tokens
    assert [t.token for t in it] == ref and it.finish_reason == "length"
    # a stop string begun before min_tokens and ended by its last token counts (as vLLM's)
    m = next(m for m in range(3, 9) if pieces[m - 2] and pieces[m - 1])
    across = pieces[m - 2][-1] + pieces[m - 1][0]
    before = len("".join(pieces[: m - 1]))
    at = full.index(across, before + 1 - len(across))
    it = root.fork().generate(8, stop=[across], min_tokens=m)
    toks = list(it)
    assert [t.token for t in toks] == ref[:m] and it.finish_reason == "stop"
    assert "".join(t.text for t in toks) == full[:at]
    # include_stop_str: the text runs to the end of the stop string, then stops
    later = pieces[3][-2:] + pieces[4][:1]
    cut = full.index(later)
    it = root.fork().generate(8, stop=[later], include_stop_str=True)
    toks = list(it)
    assert "".join(t.text for t in toks) == full[: cut + len(later)] and it.finish_reason == "stop"
    it = root.fork().generate(8, stop=[later])
    assert "".join(t.text for t in it) == full[:cut]
