"""The server's scheduler in-process: choices as engine generation requests with read-ahead,
and a choice that outgrows the KV cache ending with "length"."""

from __future__ import annotations

import asyncio

import pytest

import lloyal

pytest.importorskip("fastapi", reason="the server extra: pip install 'lloyal[server]'")

from lloyal.server.scheduler import LOOKAHEAD, Done, GenSpec, Scheduler, TokenEvent

GREEDY = lloyal.SamplingParams(temperature=0.0)


def run(sched: Scheduler, spec: GenSpec) -> tuple[list[TokenEvent], Done]:
    async def main() -> tuple[list[TokenEvent], Done]:
        evs: list[TokenEvent] = []
        async for ev in sched.generate(spec):
            if isinstance(ev, Done):
                return evs, ev
            evs.append(ev)
        raise AssertionError("no Done")

    return asyncio.run(main())


def test_a_choice_that_outgrows_the_cache_ends_with_length_and_its_text(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256, n_batch=64, n_seq_max=4) as ctx:
        sched = Scheduler(ctx, max_running=1)
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
        evs, done = run(sched, GenSpec(prompt=prompt, params=GREEDY, max_tokens=40))
        tokens = [e.token for e in evs if e.token >= 0]
        assert tokens == want  # every free cell was used, then the choice ended
        assert done.finish_reasons == ["length"] and done.completion_tokens == 16
        assert done.texts[0] == "".join(e.text for e in evs) == ctx.detokenize(want)
        # its branch went to the prefix cache whole (prompt + 16 tokens: every cell)
        assert lloyal.BranchStore(ctx).kv_pressure.remaining == 0 and len(sched.cache) == 1
        asyncio.run(sched.stop())
        assert lloyal.BranchStore(ctx).kv_pressure.cells_used == 0


def test_choices_run_as_generation_requests_and_evict_the_cache_for_headroom(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=512, n_batch=64, n_seq_max=8) as ctx:
        sched = Scheduler(ctx, max_running=2)
        before = ctx.engine_stats().ticks
        prompt = ctx.tokenize("The capital of France is")
        _, done = run(sched, GenSpec(prompt=prompt, params=GREEDY, max_tokens=12))
        assert done.completion_tokens == 12 and done.finish_reasons == ["length"]
        assert len(sched.cache) == 1  # one choice, no separate root: one cached branch, one lease
        assert sched.steps == ctx.engine_stats().ticks - before >= 12
        # fill the cache with a long entry, then a request whose choice needs headroom evicts it
        long = (ctx.tokenize("alpha beta gamma delta ") * 200)[: 512 - 12 - LOOKAHEAD]
        run(sched, GenSpec(prompt=long, params=GREEDY, max_tokens=4))
        assert len(sched.cache) == 2
        _, done = run(sched, GenSpec(prompt=ctx.tokenize("Hello"), params=GREEDY, max_tokens=8))
        assert done.completion_tokens == 8 and done.finish_reasons == ["length"]
        assert sched.cache.evictions >= 1
        asyncio.run(sched.stop())
