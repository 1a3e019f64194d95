"""The server's scheduler when requests leave early or fail at once, and when it stops: every
slot, lease and cell comes back, and no request is left waiting for a wake that never comes."""

from __future__ import annotations

import asyncio

import pytest

import lloyal

pytest.importorskip("fastapi", reason="the server extra: pip install 'lloyal[server]'")

from lloyal.scheduling.scheduler import Done, GenSpec, PromptScores, Scheduler, ShuttingDown

GREEDY = lloyal.SamplingParams(temperature=0.0)


def clean(sched: Scheduler, ctx: lloyal.Context) -> dict[str, object]:
    """What a scheduler with nothing running holds: requests, slots, reservations, leases, cells."""
    store = lloyal.BranchStore(ctx)
    return {
        "requests": len(sched._requests),
        "running": sched.book.running,
        "reserved": sched.book.reserved,
        "free leases": store.available,
        "cells": store.kv_pressure.cells_used,
    }


IDLE = {"requests": 0, "running": 0, "reserved": (0, 0, 0), "cells": 0}


async def emptied(sched: Scheduler, ctx: lloyal.Context) -> dict[str, object]:
    """``clean`` once the engine has let go of what ended, the prefix cache trimmed to nothing."""
    await asyncio.sleep(0.2)
    sched.cache.trim(0)
    await asyncio.sleep(0.2)
    return clean(sched, ctx)


def test_a_best_of_request_cancelled_as_its_forks_are_made_keeps_no_fork(model: lloyal.Model) -> None:
    """Cancelled at each step of the loop after its root and forks took their leases (the forks
    made, their awaiting task not yet resumed, among them): every fork is released with the
    request, and each trial starts with every lease free."""
    with lloyal.Context(model, n_ctx=1024, n_batch=64, n_seq_max=8) as ctx:
        sched = Scheduler(ctx, cache_cells=0)
        store = lloyal.BranchStore(ctx)
        base = ctx.tokenize("A list of fruits: apples, pears,")

        async def main() -> list[int]:
            free = []
            for steps in range(6):
                prompt = base + ctx.tokenize(f" trial {steps}", add_special=False)
                spec = GenSpec(prompt=prompt, params=GREEDY, max_tokens=4, n=3, best_of=3)

                async def consume(spec: GenSpec = spec) -> None:
                    async for _ in sched.generate(spec):
                        pass

                task = asyncio.create_task(consume())
                while store.available > ctx.n_seq_max - 4:  # the root and 3 forks hold leases
                    await asyncio.sleep(0)
                for _ in range(steps):
                    await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                free.append((await emptied(sched, ctx))["free leases"])  # type: ignore[arg-type]
            await sched.stop()
            return free

        assert asyncio.run(main()) == [8] * 6


def test_a_request_short_of_room_when_a_cancelled_one_ends_starts_once_the_engine_lets_go(
    model: lloyal.Model,
) -> None:
    """One slot (a server's ``--parallel 1``): W waits for A's slot, and finds A's cells still
    held when A's client leaves (the engine drops a cancelled request at its next tick), with
    nothing else running whose end would wake the queue. The queue tries again by itself: W
    runs to its end."""
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=5) as ctx:
        sched = Scheduler(ctx, max_running=1)
        pa = ctx.tokenize("Story. " + "The harbour was quiet and the ships slept. " * 20)
        pw = ctx.tokenize("Essay. " + "Rivers run to the sea under the grey hills. " * 28)
        assert len(pa) + 60 + len(pw) > 512, "W does not fit next to A's cells"

        async def main() -> Done:
            started = asyncio.Event()

            async def run_a() -> None:
                count = 0
                async for _ in sched.generate(
                    GenSpec(prompt=pa, params=GREEDY, max_tokens=250, stop_tokens=[])
                ):
                    count += 1
                    if count == 60:
                        started.set()

            async def run_w() -> Done:
                async for ev in sched.generate(
                    GenSpec(prompt=pw, params=GREEDY, max_tokens=8, stop_tokens=[])
                ):
                    if isinstance(ev, Done):
                        return ev
                raise AssertionError("no Done")

            a = asyncio.create_task(run_a())
            await started.wait()
            w = asyncio.create_task(run_w())
            while sched.waiting == 0:
                await asyncio.sleep(0.001)
            a.cancel()
            await asyncio.gather(a, return_exceptions=True)
            try:
                return await asyncio.wait_for(w, 30)
            finally:
                await sched.stop()

        done = asyncio.run(main())
        assert done.completion_tokens == 8 and done.prompt_tokens == len(pw)


@pytest.mark.parametrize("best_of", [1, 2])
def test_a_request_its_generation_refuses_fails_with_the_error_and_frees_its_slot(
    model: lloyal.Model, best_of: int
) -> None:
    """A token outside the vocabulary in the prompt: the request fails with
    ``InvalidTokenError`` (with best_of 1 the prompt goes to the choice's generation, which
    refuses it as it is made), nothing stays held, and the next request runs."""
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=4) as ctx:
        sched = Scheduler(ctx, cache_cells=0)
        prompt = ctx.tokenize("The harbour town was quiet that night.")

        async def main() -> tuple[dict[str, object], int]:
            loop = asyncio.get_running_loop()
            bad = GenSpec(
                prompt=[*prompt, ctx.n_vocab + 5], params=GREEDY, max_tokens=4, n=best_of, best_of=best_of
            )
            with pytest.raises(lloyal.InvalidTokenError, match="out of range"):
                async for _ in sched.generate(bad, deadline=loop.time() + 20):
                    pass
            after = await emptied(sched, ctx)
            good = GenSpec(prompt=prompt, params=GREEDY, max_tokens=2)
            events = [ev async for ev in sched.generate(good, deadline=loop.time() + 20)]
            await sched.stop()
            last = events[-1]
            assert isinstance(last, Done)
            return after, last.completion_tokens

        after, made = asyncio.run(main())
        assert after == {**IDLE, "free leases": 4} and made == 2


@pytest.mark.parametrize("best_of", [1, 2])
def test_a_request_closed_at_its_prompt_scores_frees_its_choices(model: lloyal.Model, best_of: int) -> None:
    """``prompt_logprobs``: the first event is the prompt's scores, sent before the choices'
    tasks first run; a consumer that closes the request there (a client gone) leaves nothing
    behind."""
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=4) as ctx:
        sched = Scheduler(ctx, cache_cells=0)
        prompt = ctx.tokenize("The harbour town was quiet that night.")
        spec = GenSpec(
            prompt=prompt, params=GREEDY, max_tokens=8, n=best_of, best_of=best_of, prompt_logprobs=1
        )

        async def main() -> dict[str, object]:
            events = sched.generate(spec)
            first = await events.__anext__()
            assert isinstance(first, PromptScores) and len(first.tokens) == len(prompt)
            await events.aclose()
            after = await emptied(sched, ctx)
            await sched.stop()
            return after

        assert asyncio.run(main()) == {**IDLE, "free leases": 4}


def test_stop_fails_the_queued_requests_too(model: lloyal.Model) -> None:
    """``stop()`` ends the running request and the one queued behind it with ``ShuttingDown``:
    the queued one is not admitted afterwards (it would run on a context being closed)."""
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=4) as ctx:
        sched = Scheduler(ctx, max_running=1)

        async def outcome(prompt: str, max_tokens: int, first: asyncio.Event | None = None) -> str:
            spec = GenSpec(prompt=ctx.tokenize(prompt), params=GREEDY, max_tokens=max_tokens, stop_tokens=[])
            try:
                async for ev in sched.generate(spec):
                    if first is not None:
                        first.set()
                    if isinstance(ev, Done):
                        return "done"
            except ShuttingDown:
                return "shut down"
            return "no Done"

        async def main() -> tuple[list[str], dict[str, object]]:
            running = asyncio.Event()
            a = asyncio.create_task(outcome("Once upon a time", 200, running))
            await running.wait()
            w = asyncio.create_task(outcome("The capital of France is", 4))
            while sched.waiting == 0:
                await asyncio.sleep(0.001)
            await sched.stop()
            ends = list(await asyncio.wait_for(asyncio.gather(a, w), 20))
            return ends, await emptied(sched, ctx)

        ends, after = asyncio.run(main())
        assert ends == ["shut down", "shut down"]
        assert after == {**IDLE, "free leases": 4}


def test_python_3_10s_timeout_gives_up_at_the_deadline_and_passes_a_cancellation_on() -> None:
    """``_within`` (``_admit_by``'s form on Python 3.10, where ``asyncio.timeout_at`` is missing),
    run here on any version: work past the deadline raises ``TimeoutError``; work done in time
    returns; a caller cancelled meanwhile is cancelled (not timed out), the work with it, in the
    caller's own task (``asyncio.wait_for`` ran the work in a task of its own, which on 3.10 could
    return its result to a caller already cancelled)."""
    from lloyal.scheduling.scheduler import _within

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        seen = []
        try:
            await _within(asyncio.sleep(10), loop.time() + 0.05)
        except asyncio.TimeoutError:
            seen.append("timed out")
        await _within(asyncio.sleep(0.01), loop.time() + 5)
        seen.append("in time")
        tasks: list[asyncio.Task[object] | None] = []

        async def work() -> None:
            tasks.append(asyncio.current_task())
            await asyncio.sleep(10)

        caller = asyncio.create_task(_within(work(), loop.time() + 5))
        await asyncio.sleep(0.01)
        caller.cancel()
        try:
            await caller
        except asyncio.CancelledError:
            seen.append("cancelled")
        seen.append("in the caller's task" if tasks == [caller] else "in another task")
        return seen

    assert asyncio.run(main()) == ["timed out", "in time", "cancelled", "in the caller's task"]
