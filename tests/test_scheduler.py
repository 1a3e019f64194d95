"""The server's scheduler in-process: choices as engine generation requests with read-ahead,
and a choice that outgrows the KV cache ending with "length"."""

from __future__ import annotations

import asyncio

import pytest
from helpers import greedy_completion, until_done, wait_until

import lloyal

pytest.importorskip("fastapi", reason="the server extra: pip install 'lloyal[server]'")

from lloyal import _lloyal
from lloyal.scheduling.prefix_cache import GHOSTS, PrefixCache
from lloyal.scheduling.scheduler import Done, GenSpec, Scheduler, TokenEvent

GREEDY = lloyal.SamplingParams(temperature=0.0)

# 40 words, no two of which begin with the same token
WORDS = (  # noqa: SIM905 (40 words read better as text)
    "apple river stone cloud tiger violin garden candle mirror rocket pencil forest "
    "button castle dragon window summer anchor basket circle dinner engine falcon "
    "ginger harbor island jacket kettle ladder magnet needle orange parrot puzzle "
    "rabbit saddle tunnel wallet yellow zipper"
).split()


def record_admissions(sched: Scheduler, prompts: list[list[int]]) -> list[int]:
    """The indices in ``prompts`` of the requests ``sched`` admits, in the order it admits them."""
    admitted: list[int] = []
    attempt = sched._attempt

    async def recorded(spec: GenSpec) -> object:
        found = await attempt(spec)
        if isinstance(found, _lloyal.AdmissionPlan):
            admitted.append(prompts.index(spec.prompt))
        return found

    sched._room._attempt = recorded  # type: ignore[assignment]
    return admitted


def run_arriving_in_order(sched: Scheduler, specs: list[GenSpec]) -> list[tuple[list[int], Done]]:
    """Send ``specs`` to ``sched`` one after another, each queued before the next is sent; each
    request's tokens and ``Done``. The scheduler is stopped at the end."""

    async def one(spec: GenSpec) -> tuple[list[int], Done]:
        evs, done = await until_done(sched, spec)
        return [e.token for e in evs], done

    async def main() -> list[tuple[list[int], Done]]:
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(one(spec)))
            await asyncio.sleep(0)
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            await sched.stop()

    return asyncio.run(main())


def run(sched: Scheduler, spec: GenSpec) -> tuple[list[TokenEvent], Done]:
    return asyncio.run(until_done(sched, spec))


@pytest.mark.parametrize("held", [False, True], ids=["no-stop", "text-held-for-a-stop"])
def test_a_choice_that_outgrows_the_cache_ends_with_length_and_its_text(
    model: lloyal.Model, held: bool
) -> None:
    """With ``held``, a stop string begins with the text's last characters: the engine holds
    them back, and the scheduler releases them when the cache ends the choice."""
    with lloyal.Context(model, n_ctx=256, n_batch=64, n_seq_max=4) as ctx:
        sched = Scheduler(ctx, max_running=1, cache_cells=256)
        prompt = (ctx.tokenize("One two three four five six seven eight nine ten.") * 40)[:240]
        ref = lloyal.Branch.create(ctx, 0, GREEDY)
        ref.prefill(prompt)
        want: list[int] = []
        while ref.position < 256:
            p = ref.produce()
            if p.is_stop:
                break
            ref.commit(p.token)
            want.append(p.token)
        ref.prune()
        assert len(want) == 16, "the greedy reference fills the cache"
        tail = ctx.detokenize(want).rstrip()[-3:]
        stop = [tail + "\u0007"] if held else []
        evs, done = run(sched, GenSpec(prompt=prompt, params=GREEDY, max_tokens=40, stop=stop))
        tokens = [e.token for e in evs if e.token >= 0]
        assert tokens == want  # every free cell was used, then the choice ended
        released = [e.text for e in evs if e.token < 0]
        assert released == ([ctx.detokenize(want)[ctx.detokenize(want).rindex(tail) :]] if held else [])
        assert done.finish_reasons == ["length"] and done.completion_tokens == 16
        assert done.texts[0] == "".join(e.text for e in evs) == ctx.detokenize(want)
        # its branch went to the prefix cache whole (prompt + 16 tokens: every cell)
        assert lloyal.BranchStore(ctx).kv_pressure.remaining == 0 and len(sched.cache) == 1
        asyncio.run(sched.stop())
        assert lloyal.BranchStore(ctx).kv_pressure.cells_used == 0


def test_a_best_of_request_whose_prompt_fails_leaves_no_branch(model: lloyal.Model) -> None:
    """best_of > 1 writes the prompt on a root before forking the choices: a prompt the root
    cannot take (a token outside the vocabulary) fails the request with its error, and the
    root is pruned (no lease, no cell kept); the scheduler serves the next request."""
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=6) as ctx:
        sched = Scheduler(ctx, cache_cells=64)  # room for the root (cache_cells=0 evicts it at once)
        prompt = ctx.tokenize("The harbour town was quiet that night.")
        bad = GenSpec(prompt=[*prompt, ctx.n_vocab + 5], params=GREEDY, max_tokens=4, n=2, best_of=2)
        with pytest.raises(lloyal.InvalidTokenError):
            run(sched, bad)
        assert sched.store.available == ctx.n_seq_max and sched.store.kv_pressure.cells_used == 0
        _, done = run(sched, GenSpec(prompt=prompt, params=GREEDY, max_tokens=4, n=2, best_of=2))
        assert done.completion_tokens == 8
        asyncio.run(sched.stop())
        assert sched.store.available == ctx.n_seq_max and sched.store.kv_pressure.cells_used == 0


def test_a_best_of_request_whose_choices_cannot_be_set_up_leaves_no_branch(model: lloyal.Model) -> None:
    """The choices of a best_of request are forked together, then set up together: a bias
    naming a token outside the vocabulary fails the request with its error after the forks,
    and every fork is pruned (the root, its prompt written, goes to the prefix cache)."""
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=6) as ctx:
        sched = Scheduler(ctx, cache_cells=64)  # room for the root (cache_cells=0 evicts it at once)
        prompt = ctx.tokenize("The harbour town was quiet that night.")
        bad = GenSpec(
            prompt=prompt, params=GREEDY, max_tokens=4, n=3, best_of=3, logit_bias={ctx.n_vocab + 5: 1.0}
        )
        with pytest.raises(lloyal.InvalidTokenError):
            run(sched, bad)
        # only the root is left, kept by the prefix cache (its prompt was written)
        assert [e.tokens for e in sched.cache.entries()] == [tuple(prompt)]
        assert sched.store.available == ctx.n_seq_max - 1
        assert sched.store.kv_pressure.cells_used == len(prompt)
        _, done = run(sched, GenSpec(prompt=prompt, params=GREEDY, max_tokens=4, n=3, best_of=3))
        assert done.completion_tokens == 12
        asyncio.run(sched.stop())
        assert sched.store.available == ctx.n_seq_max and sched.store.kv_pressure.cells_used == 0


def test_choices_run_as_generation_requests_and_the_cache_keeps_its_budget(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=8) as ctx:
        sched = Scheduler(ctx, max_running=2, cache_cells=38)
        before = ctx.engine_stats().ticks
        a = ctx.tokenize("The capital of France is a city that")
        _, done = run(sched, GenSpec(prompt=a, params=GREEDY, max_tokens=12))
        assert done.completion_tokens == 12 and done.finish_reasons == ["length"]
        assert len(sched.cache) == 1  # one choice, no separate root: one cached branch, one lease
        assert sched.cache.cells == len(a) + 11  # the last token is yielded, not decoded
        assert sched.steps == ctx.engine_stats().ticks - before >= 12
        # B shares nothing (fewer than MIN_SHARED tokens): A, least recently used, makes way
        b = ctx.tokenize("Quantum computers use qubits, which can be in superpositions of zero and one")
        _, done = run(sched, GenSpec(prompt=b, params=GREEDY, max_tokens=4))
        assert [e.tokens[: len(b)] for e in sched.cache.entries()] == [tuple(b)]
        assert sched.cache.stats()["evictions"] == 1 and sched.cache.cells == len(b) + 3
        # C forks B's prompt (0 new cells for it): only C's own cells count, both stay
        c = b + ctx.tokenize(" and")
        _, done = run(sched, GenSpec(prompt=c, params=GREEDY, max_tokens=4))
        assert done.cached_tokens == len(b) and sched.cache.stats()["evictions"] == 1
        assert len(sched.cache) == 2 and sched.cache.cells == len(b) + 3 + (len(c) - len(b)) + 3
        asyncio.run(sched.stop())


def test_a_running_choice_evicts_the_cache_for_its_read_ahead(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=8) as ctx:
        sched = Scheduler(ctx, max_running=4, cache_cells=512)
        long = (ctx.tokenize("alpha beta gamma delta ") * 200)[:505]
        run(sched, GenSpec(prompt=long, params=GREEDY, max_tokens=4))  # 3 of its 4 tokens decode
        assert len(sched.cache) == 1 and lloyal.BranchStore(ctx).kv_pressure.remaining == 4
        hello = ctx.tokenize("Hello")
        _, done = run(sched, GenSpec(prompt=hello, params=GREEDY, max_tokens=8))
        # its prompt fit next to the entry, but not its read-ahead: the entry went
        assert done.completion_tokens == 8 and done.finish_reasons == ["length"]
        assert sched.cache.stats()["evictions"] == 1
        assert [e.tokens[: len(hello)] for e in sched.cache.entries()] == [tuple(hello)]
        asyncio.run(sched.stop())


def test_the_cache_budget_follows_reuse_and_a_trimmed_entry_that_is_missed_counts(
    model: lloyal.Model,
) -> None:
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=4) as ctx:
        sched = Scheduler(ctx, max_running=1)
        cache = sched.cache
        assert cache.stats()["reuse"] == 1.0 and sched.cache_budget() == 512  # keeps all until prompts miss
        for i in range(30):  # prompts that share nothing
            cache.record(0, [i + 1] * 40)
        assert cache.stats()["reuse"] < 0.05 and sched.cache_budget() < 26
        # the core keeps the budget it follows: an entry over it goes, with no trim() from Python
        big = lloyal.Branch.create(ctx, 0, GREEDY)
        big.prefill(list(range(100, 140)))
        cache.add(big, list(range(100, 140)))
        assert big.disposed and len(cache) == 0 and cache.stats()["evictions"] == 1
        # an entry trimmed away is remembered: a prompt it would have served counts as reuse
        tokens = ctx.tokenize("A conversation that goes on for a while, turn after turn, with more")
        b = lloyal.Branch.create(ctx, 0, GREEDY)
        b.prefill(tokens)
        cache.add(b, tokens)
        assert cache.cells == len(tokens)
        cache.trim(0)  # the engine is idle: the entry goes at once
        assert len(cache) == 0 and cache.cells == 0 and b.disposed and cache.stats()["evictions"] == 2
        low = cache.stats()["reuse"]
        turn2 = tokens + ctx.tokenize(" and then more")
        cache.record(0, turn2)
        assert cache.stats()["reuse"] == pytest.approx(low + 0.1 * (len(tokens) / len(turn2) - low))
        cache.record(0, [7] * 40)  # a miss no ghost covers
        assert cache.stats()["reuse"] < 0.9 * (low + 0.1)
        # at most GHOSTS keys are remembered
        ghosts = PrefixCache(ctx)
        for i in range(GHOSTS + 5):
            x = lloyal.Branch.create(ctx, 0, GREEDY)
            x.prefill([i + 1])
            ghosts.add(x, [i + 1] * 20)
            assert x.disposed  # its one cell is over the budget of 0
        before = ghosts.stats()["reuse"]
        ghosts.record(0, [1] * 20 + [9])  # the first key was forgotten
        assert ghosts.stats()["reuse"] < before


def test_a_request_that_shares_nothing_makes_room_under_the_entry_limit_before_its_prompt(
    model: lloyal.Model,
) -> None:
    """A cache that follows reuse keeps as many entries nothing forks as its recent hits
    reached back. A request that shares nothing with them will add one more when it ends, so
    the least recently used go at its admission, before its prompt: the prompt's attention then
    spans only its own cells (llama.cpp's spans every cell up to the highest one in use; at
    concurrency 1 the last request's ~1,100 cells cost a 1,000-token prompt ~35 ms)."""
    with lloyal.Context(model, n_ctx=1024, n_batch=64, n_seq_max=8) as ctx:
        sched = Scheduler(ctx, max_running=1)
        store = lloyal.BranchStore(ctx)
        system = ctx.tokenize("You answer questions about the old harbour town and its boats. " * 4)
        for q in (" Who built the pier?", " When do the ferries run?"):  # the second hits the first
            prompt = system + ctx.tokenize(q, add_special=False)
            run(sched, GenSpec(prompt=prompt, params=GREEDY, max_tokens=4))
        assert len(sched.cache) == 2 and sched.cache.stats()["hit_tokens"] >= len(system)
        other = ctx.tokenize("A different task entirely: list three prime numbers.")

        async def first_token() -> tuple[int, int]:
            seen: tuple[int, int] | None = None
            async for ev in sched.generate(GenSpec(prompt=other, params=GREEDY, max_tokens=4)):
                if seen is None and isinstance(ev, TokenEvent):
                    seen = (len(sched.cache), store.kv_pressure.cells_used)
            assert seen is not None
            return seen

        entries, cells = asyncio.run(first_token())
        assert entries == 0  # both went before the prompt (else they stay until it ends)
        assert len(other) <= cells <= len(other) + 1
        assert len(sched.cache) == 1 and sched.cache.stats()["evictions"] == 2


async def together(sched: Scheduler, prompts: list[list[int]], n: int) -> list[tuple[list[int], Done]]:
    """Greedy requests for ``prompts``, all sent at once: each one's tokens and Done."""

    async def one(p: list[int]) -> tuple[list[int], Done]:
        evs, done = await until_done(sched, GenSpec(prompt=p, params=GREEDY, max_tokens=n))
        return [e.token for e in evs], done

    return await asyncio.gather(*(one(p) for p in prompts))


def test_a_finished_choice_is_cached_without_its_uncommitted_last_token(exact_model: lloyal.Model) -> None:
    """A choice that reaches ``max_tokens`` does not decode its last token: the cache entry
    holds the prompt and the tokens before it, and the next turn (prompt + answer + more)
    forks it there and prefills the rest, answering as a cold run does."""
    with lloyal.Context(exact_model, n_ctx=1024, n_batch=64, n_seq_max=6, batch_invariant=True) as ctx:
        sched = Scheduler(ctx, max_running=2)
        prompt = ctx.tokenize("The three most important inventions of the last century were")
        answer = greedy_completion(ctx, prompt, 6)
        turn = prompt + answer + ctx.tokenize(" Name one more.", add_special=False)
        want = greedy_completion(ctx, turn, 4)
        calls = ctx.engine_stats().decode_calls
        first, done = run(sched, GenSpec(prompt=prompt, params=GREEDY, max_tokens=6))
        assert [e.token for e in first] == answer and done.finish_reasons == ["length"]
        assert ctx.engine_stats().decode_calls - calls == 1 + 5  # the prompt, five of six tokens
        second, done = run(sched, GenSpec(prompt=turn, params=GREEDY, max_tokens=4))
        assert done.cached_tokens == len(prompt) + 5
        assert [e.token for e in second] == want


def test_requests_arriving_together_with_a_new_prefix_prefill_it_once(exact_model: lloyal.Model) -> None:
    """A burst of prompts sharing a prefix nobody has sent yet: the first writes it, the others
    wait for its first token and fork it there (each prefills only its own tail)."""
    with lloyal.Context(exact_model, n_ctx=2048, n_batch=64, n_seq_max=8, batch_invariant=True) as ctx:
        system = ctx.tokenize("You are a careful assistant who answers in one short sentence. " * 8)
        prompts = [
            system + ctx.tokenize(q, add_special=False) for q in (" Why is the sky blue?", " Name a fruit.")
        ]
        prompts.append(list(prompts[0]))  # the same prompt again: forks all but its last token
        want = [greedy_completion(ctx, p, 6) for p in prompts]
        common = next(i for i, (x, y) in enumerate(zip(*prompts[:2], strict=False)) if x != y)
        sched = Scheduler(ctx, max_running=4)
        rows0 = ctx.engine_stats().rows
        got = asyncio.run(together(sched, prompts, 6))
        assert [t for t, _ in got] == want
        assert [d.cached_tokens for _, d in got] == [0, common, len(prompts[0]) - 1]
        # the prefix was written once: each prompt row is decoded once, plus the generated tokens
        # but each one's last (yielded, never decoded)
        prompt_rows = len(prompts[0]) + (len(prompts[1]) - common) + 1
        assert ctx.engine_stats().rows - rows0 == prompt_rows + sum(len(w) - 1 for w in want)
        # the first request's branch is the cached parent of the second's; the third's sequence
        # (the first's again) is pruned once it finished (by the engine, just after): two
        # entries, two leases, none leaked
        wait_until(lambda: sched.store.available == ctx.n_seq_max - 2, 5.0)
        assert len(sched.cache) == 2 and sched.store.available == ctx.n_seq_max - 2
        asyncio.run(sched.stop())
        assert sched.store.kv_pressure.cells_used == 0 and sched.store.available == ctx.n_seq_max


def test_a_request_whose_prefix_source_is_cancelled_goes_on(exact_model: lloyal.Model) -> None:
    """The request a burst waits for is cancelled: before its prompt is written (the waiter
    prefills it itself), and after the waiter forked it (its branch stays under the fork until
    that goes, then is pruned)."""
    with lloyal.Context(exact_model, n_ctx=2048, n_batch=64, n_seq_max=8, batch_invariant=True) as ctx:
        system = ctx.tokenize("A long shared instruction about colours, shapes and numbers. " * 40)
        a, b = (
            system + ctx.tokenize(" First?", add_special=False),
            system + ctx.tokenize(" Second?", add_special=False),
        )
        want = greedy_completion(ctx, b, 4)
        common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        sched = Scheduler(ctx, max_running=4)

        async def main(cancel_early: bool) -> tuple[list[int], Done]:
            async def drain_a() -> None:
                async for _ in sched.generate(GenSpec(prompt=a, params=GREEDY, max_tokens=50)):
                    pass

            async def run_b() -> tuple[list[int], Done]:
                toks: list[int] = []
                async for ev in sched.generate(GenSpec(prompt=b, params=GREEDY, max_tokens=4)):
                    if isinstance(ev, Done):
                        return toks, ev
                    toks.append(ev.token)
                    task_a.cancel()  # b forked a's prompt and is running
                raise AssertionError("no Done")

            rows0 = ctx.engine_stats().rows
            task_a = asyncio.create_task(drain_a())
            while not sched._requests:  # a is admitted: its prompt is in flight
                await asyncio.sleep(0.001)
            task_b = asyncio.create_task(run_b())
            if cancel_early:
                while sched.waiting == 0:  # b waits for a's prompt
                    await asyncio.sleep(0.001)
                assert ctx.engine_stats().rows - rows0 < len(a), "a's prompt is still being written"
                task_a.cancel()
            await asyncio.gather(task_a, return_exceptions=True)
            return await task_b

        async def both() -> None:
            toks, done = await main(True)
            assert toks == want and done.cached_tokens == 0  # it wrote the prefix itself
            assert len(sched.cache) == 1 and sched.store.available == ctx.n_seq_max - 1
            sched.cache.trim(0)
            assert sched.store.kv_pressure.cells_used == 0
            sched.cache.follow_reuse()  # the server's budget again (trim(0) fixed one)

            toks, done = await main(False)
            assert toks == want and done.cached_tokens == common
            # a was cancelled under b's fork: its branch stays (b's entry shares its cells) ...
            assert len(sched.cache) == 1 and sched.store.available == ctx.n_seq_max - 2
            sched.cache.trim(0)  # ... and goes with the entry that needed it
            assert sched.store.available == ctx.n_seq_max and sched.store.kv_pressure.cells_used == 0
            await sched.stop()

        asyncio.run(both())


def test_a_burst_whose_questions_begin_alike_forks_the_first_prompt_written(
    exact_model: lloyal.Model,
) -> None:
    """Two waiting prompts that share a few more tokens with each other than with the prompt
    being written: neither waits for the other's tail, both fork the first at once."""
    with lloyal.Context(exact_model, n_ctx=2048, n_batch=64, n_seq_max=8, batch_invariant=True) as ctx:
        system = ctx.tokenize("You are a careful assistant who answers in one short sentence. " * 8)
        asks = (
            " Question 1: what is item one?",
            " Question 2: what is item two?",
            " Question 2: what is item six?",
        )
        prompts = [system + ctx.tokenize(q, add_special=False) for q in asks]
        want = [greedy_completion(ctx, p, 4) for p in prompts]
        common = next(i for i, (x, y) in enumerate(zip(*prompts[:2], strict=False)) if x != y)
        assert next(i for i, (x, y) in enumerate(zip(*prompts[1:], strict=False)) if x != y) > common + 2
        sched = Scheduler(ctx, max_running=4)
        got = asyncio.run(together(sched, prompts, 4))
        assert [t for t, _ in got] == want
        assert [d.cached_tokens for _, d in got] == [0, common, common]
        asyncio.run(sched.stop())


def test_a_request_short_of_room_while_another_is_admitted_goes_on_once_it_is(model: lloyal.Model) -> None:
    """Admission reserves a request's leases until its branches exist, so a request planned
    meanwhile may find no room; the reservation's end wakes it (not the end of a request):
    three best_of requests sharing a new prefix all fork the first prompt written, which is
    prefilled once."""
    # One decode thread: the timing under which the second request's fork is made before the
    # third plans (it failed so, every time, without the wake-up).
    with lloyal.Context(model, n_ctx=2048, n_seq_max=16, n_threads=1) as ctx:
        sched = Scheduler(ctx, max_running=12, cache_cells=0, reserve=True)
        system = ctx.tokenize("A long shared instruction about colours, shapes and numbers. " * 20)
        asks = (" Name a colour.", " Name a shape.", " Name a number.")
        prompts = [system + ctx.tokenize(q, add_special=False) for q in asks]
        common = next(i for i, (x, y) in enumerate(zip(*prompts[:2], strict=False)) if x != y)
        rows0 = ctx.engine_stats().rows

        async def one(p: list[int]) -> Done:
            spec = GenSpec(prompt=p, params=GREEDY, max_tokens=12, best_of=3, stop_tokens=[])
            return (await until_done(sched, spec))[1]

        async def main() -> list[Done]:
            try:
                return list(await asyncio.gather(*(one(p) for p in prompts)))
            finally:
                await sched.stop()

        dones = asyncio.run(main())
        assert [d.cached_tokens for d in dones] == [0, common, common]
        generated = sum(sum(d.lengths) for d in dones)
        tails = sum(len(p) - common for p in prompts[1:])
        assert ctx.engine_stats().rows - rows0 == len(prompts[0]) + tails + generated


def test_requests_queued_behind_busy_slots_start_in_order_at_a_few_attempts_each(
    exact_model: lloyal.Model,
) -> None:
    """Forty requests sharing a prompt prefix queue behind four slots: they start in arrival
    order, at a few admission attempts each rather than one per waiting request at every
    wake-up (each attempt plans, and may await the engine to learn the cache cannot make room:
    with 250 requests queued that took as long as the decodes); every request gets its greedy
    tokens and nothing stays held."""
    # batch-invariant on any run: the greedy tokens are compared with ones decoded alone
    with lloyal.Context(exact_model, n_ctx=1024, n_batch=128, n_seq_max=4) as ctx:
        sched = Scheduler(ctx)
        system = ctx.tokenize("Answer in one word, the shortest you know, and nothing else:")
        prompts = [[*system, *ctx.tokenize(f" {w} means", add_special=False)] for w in WORDS]
        # no two share a token past the instruction: none waits for another's prompt
        assert len({p[len(system)] for p in prompts}) == len(prompts) == 40
        want = {i: greedy_completion(ctx, prompts[i], 2) for i in (0, 17, 39)}
        admitted = record_admissions(sched, prompts)
        tries0 = sched._room.tries
        specs = [GenSpec(prompt=p, params=GREEDY, max_tokens=2, stop_tokens=[]) for p in prompts]
        ran = run_arriving_in_order(sched, specs)
        assert [d.completion_tokens for _, d in ran] == [2] * 40
        assert all(ran[i][0] == w for i, w in want.items())
        # ~5 a request here (its arrival, then about one a wake-up: a prompt written, an
        # admission's end, a request's end); waking every waiting request made 45-56
        assert sched._room.tries - tries0 <= 8 * 40, sched._room.tries - tries0
        assert admitted == list(range(40))
        assert sched.book.running == 0 and sched.book.reserved == (0, 0, 0) and len(sched._room) == 0


def test_a_best_of_request_waiting_for_slots_is_not_overtaken_by_smaller_ones(model: lloyal.Model) -> None:
    """Four requests fill four slots and end one after another; a best_of=2 request waits, and
    six single-choice ones behind it. The slots that free up are kept for it: it starts before
    any of them (before, each freed slot went to the next small request that fit)."""
    with lloyal.Context(model, n_ctx=1024, n_seq_max=14) as ctx:
        sched = Scheduler(ctx, max_running=4)
        prompts = [ctx.tokenize(f"The word {w} means") for w in WORDS[:11]]
        admitted = record_admissions(sched, prompts)
        # 0-3 run, ending after 3, 6, 9 and 12 tokens; 4 is the best_of request; 5-10 are small
        specs = [
            GenSpec(prompt=prompts[i], params=GREEDY, max_tokens=3 * (i + 1), stop_tokens=[])
            for i in range(4)
        ]
        specs.append(GenSpec(prompt=prompts[4], params=GREEDY, max_tokens=2, best_of=2, stop_tokens=[]))
        specs += [
            GenSpec(prompt=prompts[i], params=GREEDY, max_tokens=2, stop_tokens=[]) for i in range(5, 11)
        ]

        ran = run_arriving_in_order(sched, specs)
        assert admitted == list(range(11))
        assert [len(d.lengths) for _, d in ran] == [1] * 4 + [2] + [1] * 6
        assert sched.book.running == 0 and sched.book.reserved == (0, 0, 0)


def test_a_request_cancelled_while_it_awaits_room_leaves_no_pin(model: lloyal.Model) -> None:
    """Admission awaits room with the cached entry it will fork pinned: a client that goes away
    meanwhile takes the pin with it, so the entry can be evicted again."""
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=4) as ctx:
        sched = Scheduler(ctx, cache_cells=512)
        prompt = ctx.tokenize(
            "The lighthouse keeper counted the ships that passed in the night, one by one, until dawn"
        )
        assert len(prompt) > 16  # past MIN_SHARED: the next request forks the entry
        run(sched, GenSpec(prompt=prompt, params=GREEDY, max_tokens=4))
        [entry] = sched.cache.entries()
        waiting = asyncio.Event()

        async def never(*, leases: int = 0, cells: int = 0) -> bool:
            waiting.set()
            await asyncio.Event().wait()  # room never comes
            return True

        async def main() -> None:
            sched.cache.make_room = never  # type: ignore[method-assign]
            more = ctx.tokenize(" and", add_special=False)
            spec = GenSpec(prompt=[*prompt, *more], params=GREEDY, max_tokens=4)
            task = asyncio.create_task(anext(aiter(sched.generate(spec))))
            await waiting.wait()  # admitted as far as the room: the entry is pinned
            sched.cache.trim(0)
            assert not entry.branch.disposed  # pinned: the budget cannot evict it
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(5):  # the admission attempt under way is cancelled with it
                await asyncio.sleep(0)
            sched.cache.trim(0)  # unpinned: the budget evicts it
            assert entry.branch.disposed and sched.cache.stats()["evictions"] == 1

        asyncio.run(main())


def test_a_drain_waits_for_a_request_still_making_its_branches(model: lloyal.Model) -> None:
    """A request granted room and making its branches (neither queued nor running yet) is one
    a drain waits for: it finishes within the grace, and the drain cancels nothing."""
    with lloyal.Context(model, n_ctx=512, n_seq_max=4) as ctx:
        sched = Scheduler(ctx)
        making, go = asyncio.Event(), asyncio.Event()
        admit_one = sched._admit_one

        async def held(req: object, plan: _lloyal.AdmissionPlan, base: lloyal.Branch | None) -> None:
            making.set()
            await go.wait()
            await admit_one(req, plan, base)  # type: ignore[arg-type]

        sched._admit_one = held  # type: ignore[method-assign]
        spec = GenSpec(prompt=ctx.tokenize("The word apple means"), params=GREEDY, max_tokens=3)

        async def main() -> tuple[Done, int]:
            request = asyncio.create_task(until_done(sched, spec))
            await making.wait()
            assert sched.waiting == 0 and not sched._requests  # granted, not listed
            drain = asyncio.create_task(sched.drain(30.0))
            await asyncio.sleep(0.2)  # the drain looks every 50 ms
            assert not drain.done()
            go.set()
            try:
                return (await request)[1], await drain
            finally:
                await sched.stop()

        done, cancelled = asyncio.run(main())
        assert done.completion_tokens == 3 and done.finish_reasons == ["length"]
        assert cancelled == 0 and sched.book.running == 0 and sched.book.reserved == (0, 0, 0)


def test_best_of_ranks_choices_by_the_perplexity_of_what_each_generated(exact_model: lloyal.Model) -> None:
    """``best_of`` keeps the ``n`` choices of lowest perplexity (read from each generation
    request's end, no context call): each equals the perplexity of its tokens scored alone
    (batch-invariant kernels: on a GPU run too, the model stays on the CPU)."""
    with lloyal.Context(exact_model, n_ctx=512, n_seq_max=8) as ctx:
        sched = Scheduler(ctx, max_running=4, cache_cells=0)
        prompt = ctx.tokenize("A list of fruits: apples, pears,")
        params = lloyal.SamplingParams(temperature=1.2, top_k=40)
        spec = GenSpec(prompt=prompt, params=params, max_tokens=6, n=2, best_of=4, seed=11, stop_tokens=[])
        evs, done = run(sched, spec)
        assert (
            len(done.perplexities) == 4
            and done.choices == sorted(range(4), key=lambda i: done.perplexities[i])[:2]
        )
        root = lloyal.Branch.create(ctx, 0, GREEDY)
        root.prefill(prompt)
        for i in range(4):
            tokens = [e.token for e in evs if e.index == i and e.token >= 0]
            alone = root.fork()
            for t in tokens:
                alone.commit(t)
            assert done.perplexities[i] == pytest.approx(alone.perplexity, rel=1e-3), i
            alone.prune()
        assert len(set(done.perplexities)) > 1, "the choices differ"
        root.prune()
        asyncio.run(sched.stop())


def test_a_random_burst_with_cancellations_leaves_no_slot_reservation_pin_or_lease(
    model: lloyal.Model,
) -> None:
    """Requests of three prompt families (some sharing prompts in flight), one or two choices,
    several cancelled at random points (waiting, streaming), two failing while admitted: once
    they are all done,
    admission holds nothing (no running choice, no reservation), and a cache budget of 0 evicts
    every entry (no pin was left behind), so every lease and cell is free again."""
    import random

    rng = random.Random(5)
    with lloyal.Context(model, n_ctx=2048, n_batch=64, n_seq_max=8) as ctx:
        sched = Scheduler(ctx, max_running=3, cache_cells=1024)
        families = [
            ctx.tokenize(f"Family {k}: a shared opening about rivers and hills. " * 6) for k in range(3)
        ]

        async def one(i: int) -> str:
            prompt = families[i % 3] + ctx.tokenize(f" Question {i}?", add_special=False)
            spec = GenSpec(
                prompt=prompt, params=GREEDY, max_tokens=rng.randint(1, 6), best_of=rng.choice([1, 2])
            )
            spec.n = spec.best_of
            if i in (4, 9):  # fails while admitted: its choices' sampling cannot be set up
                spec.logit_bias = {ctx.n_vocab + 5: 1.0}
            cancel_after = rng.choice([None, None, 0, 1, 3])  # events read before cancelling
            seen = 0
            try:
                async for ev in sched.generate(spec):
                    if isinstance(ev, Done):
                        return "done"
                    seen += 1
                    if cancel_after is not None and seen > cancel_after:
                        return "cancelled"
            except lloyal.InvalidTokenError:
                return "refused"
            raise AssertionError("no Done")

        async def main() -> list[str]:
            tasks = [asyncio.create_task(one(i)) for i in range(16)]
            await asyncio.sleep(0.05)
            for t in rng.sample(tasks, 3):  # cancelled wherever they are (most are still waiting)
                t.cancel()
            # a leaked slot would keep later requests waiting: fail instead of hanging
            out = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
            for _ in range(200):  # choices of cancelled requests finish at the engine's next ticks
                if not sched._requests and sched.waiting == 0:
                    break
                await asyncio.sleep(0.01)
            return ["killed" if isinstance(r, asyncio.CancelledError) else str(r) for r in out]

        outcomes = asyncio.run(main())
        assert {"done", "cancelled", "killed", "refused"} <= set(outcomes), outcomes
        assert (sched.running, sched.book.reserved, sched.waiting) == (0, (0, 0, 0), 0)
        assert len(sched.cache) >= 1
        wait_until(lambda: ctx.engine_stats().generating == 0)  # cancelled choices: dropped
        sched.cache.trim(0)  # every entry unpinned: all evicted, their forks' released parents too
        wait_until(lambda: len(sched.cache) == 0 and sched.cache.stats()["released"] == 0, 5.0)
        assert sched.store.available == ctx.n_seq_max and sched.store.kv_pressure.cells_used == 0
        asyncio.run(sched.stop())
