"""The prefix cache's host-memory tier (``PrefixCache.host_budget``, the scheduler's
``host_cache_bytes``, the server's ``--cache-ram``): an entry evicted for room is copied to host
memory first, and a request that reuses more of the copy than of any live entry has it written
back instead of prefilling those tokens again."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from helpers import cached, greedy_completion, serving, until_done

import lloyal
from lloyal import _lloyal

pytest.importorskip("fastapi", reason="the server extra: pip install 'lloyal[server]'")
httpx = pytest.importorskip("httpx")

from lloyal.scheduling.scheduler import Done, GenSpec, Scheduler  # noqa: E402

GREEDY = lloyal.SamplingParams(temperature=0.0)
MIB = 1 << 20


def run(sched: Scheduler, prompt: list[int], max_tokens: int) -> tuple[list[int], Done]:
    evs, done = asyncio.run(until_done(sched, GenSpec(prompt=prompt, params=GREEDY, max_tokens=max_tokens)))
    return [e.token for e in evs], done


def test_a_returning_conversation_is_written_back_from_host_memory(exact_model: lloyal.Model) -> None:
    """A's entry is evicted for B; A's next turn reuses all of it from the copy (no prefill of
    those tokens: one decode for the new ones) and answers as a cold run does; without a host
    budget the same turn prefills everything again."""
    for host in (64 * MIB, 0):
        with lloyal.Context(exact_model, n_ctx=1024, n_batch=64, n_seq_max=6, batch_invariant=True) as ctx:
            sched = Scheduler(ctx, max_running=2, cache_cells=30, host_cache_bytes=host)
            a = ctx.tokenize("The three most important inventions of the last century were")
            answer = greedy_completion(ctx, a, 6)
            turn = a + answer + ctx.tokenize(" Name one more.", add_special=False)
            want = greedy_completion(ctx, turn, 4)
            b = ctx.tokenize("Quantum computers use qubits, which can be in superpositions of zero and one")
            assert run(sched, a, 6)[0] == answer
            run(sched, b, 4)
            stats = sched.cache.stats()
            assert stats["evictions"] == 1 and [e.tokens[: len(b)] for e in sched.cache.entries()] == [
                tuple(b)
            ]
            assert (stats["host_kept"], stats["host_entries"]) == ((1, 1) if host else (0, 0))
            assert 0 < stats["host_bytes"] <= host if host else stats["host_bytes"] == 0
            calls = ctx.engine_stats().decode_calls
            tokens, done = run(sched, turn, 4)
            assert tokens == want
            kept = len(a) + 5  # the entry held the prompt and five of six tokens (the last not decoded)
            stats = sched.cache.stats()
            if host:
                assert done.cached_tokens == kept
                assert ctx.engine_stats().decode_calls - calls == 1 + 3  # the new tokens at once, 3 more
                assert (stats["host_restored"], stats["host_restored_tokens"]) == (1, kept)
            else:
                assert done.cached_tokens == 0 and stats["host_restored"] == 0
            asyncio.run(sched.stop())
            assert (
                lloyal.BranchStore(ctx).kv_pressure.cells_used == 0 and lloyal.BranchStore(ctx).available == 6
            )


def test_a_copy_written_back_holds_the_cells_and_logits_the_entry_had(exact_model: lloyal.Model) -> None:
    """Through the admission book: a plan that restores names no base and counts the copy's
    lease and cells; released unwritten, the copy goes back; written back, the branch holds the
    entry's tokens with its logits (its next token is the one the entry gave, and a fork that
    prefills more answers as a cold branch does); it is an entry again, and taken once."""
    with lloyal.Context(exact_model, n_ctx=512, n_seq_max=6, batch_invariant=True) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        cache.host_budget = 64 * MIB
        tokens = ctx.tokenize("A long time ago in a galaxy far, far away, there lived a small robot who")
        assert len(tokens) >= 16
        entry = cached(ctx, cache, tokens)
        next_token = entry.produce().token
        more = ctx.tokenize(" loved", add_special=False)
        want = greedy_completion(ctx, tokens + more, 3)
        asyncio.run(cache.amake_room(cells=500))  # only evicting the entry makes this room
        assert entry.disposed and cache.stats()["host_entries"] == 1 and len(cache) == 0
        book = _lloyal.Admission(ctx, 2)
        plan = book.plan(tokens + more, 1)
        assert plan is not None and plan.restores and plan.base is None and plan.at is None
        assert (plan.reused, plan.exact, plan.leases, plan.cells) == (
            len(tokens),
            False,
            2,
            len(tokens) + len(more) + 1,
        )
        assert cache.stats()["host_entries"] == 0, "taken for the plan"
        assert book.release(plan) and cache.stats()["host_entries"] == 1, "put back, never written"
        plan = book.plan(tokens, 1)
        assert plan is not None and plan.restores and plan.exact
        book.reserve(plan)
        restored = asyncio.run(book.arestore(plan))
        with pytest.raises(ValueError, match="writes back no cached copy"):
            asyncio.run(book.arestore(plan))
        assert restored.position == len(tokens) and restored.produce().token == next_token
        assert [(b.handle, t) for b, t in cache.entries()] == [(restored.handle, tokens)]
        child = restored.fork()
        child.prefill(more)
        out = []
        for _ in range(3):
            out.append(child.produce().token)
            child.commit(out[-1])
        assert out == want
        stats = cache.stats()
        assert (stats["host_restored"], stats["host_restored_tokens"], stats["host_entries"]) == (
            1,
            len(tokens),
            0,
        )
        book.admitted(plan)
        child.prune()
        asyncio.run(cache.amake_room(cells=500))  # evicted again: copied again
        assert restored.disposed and cache.stats()["host_entries"] == 1
        cache.clear()
        assert cache.stats()["host_entries"] == cache.stats()["host_bytes"] == 0, "clear drops the copies"


def test_a_copy_that_cannot_be_written_back_is_kept(exact_model: lloyal.Model) -> None:
    """No lease (or no room) for the copy as it is written back: the specific error, nothing
    taken, and the copy is not lost with it: the plan holds it again, its release puts it back
    in host memory, and a later plan restores it (it was gone, uncounted)."""
    with lloyal.Context(exact_model, n_ctx=512, n_seq_max=3, batch_invariant=True) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        cache.host_budget = 64 * MIB
        tokens = ctx.tokenize("A long time ago in a galaxy far, far away, there lived a small robot who")
        cached(ctx, cache, tokens)
        asyncio.run(cache.amake_room(cells=500))
        store = lloyal.BranchStore(ctx)
        book = _lloyal.Admission(ctx, 2)
        plan = book.plan(tokens, 1)
        assert plan is not None and plan.restores
        book.reserve(plan)
        hogs = [lloyal.Branch.create(ctx, 0, GREEDY) for _ in range(3)]  # every lease taken
        with pytest.raises(lloyal.LeaseExhaustedError):
            asyncio.run(book.arestore(plan))
        assert (store.available, store.kv_pressure.cells_used) == (0, 0)
        assert book.release(plan) and cache.stats()["host_entries"] == 1, "put back, never written"
        for hog in hogs:
            hog.prune()
        plan = book.plan(tokens, 1)
        assert plan is not None and plan.restores and plan.reused == len(tokens)
        book.reserve(plan)
        restored = asyncio.run(book.arestore(plan))
        assert restored.position == len(tokens) and cache.stats()["host_restored"] == 1
        book.admitted(plan)


@pytest.mark.gemma
@pytest.mark.gemma
def test_a_copy_longer_than_the_sliding_window_is_forked_only_where_it_is_exact(
    exact_model: lloyal.Model,
) -> None:
    """A copy holds its sliding-window cells from its last window on (llama.cpp saves no more):
    a prompt that diverges before its end is not served from it (a fork there gave logits ~10
    apart from a cold run's), one that goes on from its whole is; the restored entry is then
    not forked short of its end either, and its cells are all counted."""
    with lloyal.Context(exact_model, n_ctx=2048, n_seq_max=6, batch_invariant=True) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        cache.host_budget = 64 * MIB
        tokens = ctx.tokenize("Once upon a time there was a little fox who lived in the forest. " * 60)[:700]
        cached(ctx, cache, tokens)
        asyncio.run(cache.amake_room(cells=2000))
        assert cache.stats()["host_entries"] == 1
        book = _lloyal.Admission(ctx, 2)
        early = book.plan([*tokens[:300], 651], 1)
        assert early is not None and early.restores is False  # it would fork the copy at 300
        book.release(early)
        plan = book.plan([*tokens, 651], 1)
        assert plan is not None and plan.restores and plan.reused == 700
        book.reserve(plan)
        restored = asyncio.run(book.arestore(plan))
        assert lloyal.BranchStore(ctx).kv_pressure.cells_used == 700
        with pytest.raises(ValueError, match="continues exactly only at 699"):
            restored.fork(at=300)
        assert cache.lookup([*tokens[:400], 651, 652]) is None  # no fork of it at 400
        found = cache.lookup([*tokens, 651, 652])
        assert found is not None and found[1:] == (700, 700)
        cache.unpin(found[0])
        book.release(plan)


def test_copies_stay_within_the_host_budget(exact_model: lloyal.Model) -> None:
    """A copy larger than the budget is not kept; least recently used copies make way."""
    with lloyal.Context(exact_model, n_ctx=512, n_seq_max=6) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        prompts = [list(range(1000 * i + 100, 1000 * i + 140)) for i in range(3)]
        cache.host_budget = 1000  # far below one copy (the logits alone are 1 MiB)
        cached(ctx, cache, prompts[0])
        asyncio.run(cache.amake_room(cells=500))
        assert cache.stats()["host_kept"] == 0 and cache.stats()["evictions"] == 1
        cache.host_budget = 64 * MIB
        cached(ctx, cache, prompts[0])
        asyncio.run(cache.amake_room(cells=500))
        one = cache.stats()["host_bytes"]
        assert one > 1 * MIB
        cache.host_budget = 2 * one + one // 2  # room for two copies
        for p in prompts[1:]:
            cached(ctx, cache, p)
            asyncio.run(cache.amake_room(cells=500))
        stats = cache.stats()
        assert (stats["host_kept"], stats["host_entries"], stats["host_dropped"]) == (3, 2, 1)
        book = _lloyal.Admission(ctx, 2)
        plan = book.plan(prompts[0] + [5], 1)
        assert plan is not None and not plan.restores, "the oldest copy went"
        book.release(plan)
        plan = book.plan(prompts[2] + [5], 1)
        assert plan is not None and plan.restores
        book.release(plan)
        cache.host_budget = 0
        assert cache.stats()["host_entries"] == 0, "a budget of 0 drops every copy"


def test_the_server_keeps_evicted_prompts_in_host_memory_as_llama_server_does(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--cache-ram`` (MiB, llama-server's flag and default): a conversation evicted for another
    comes back from host memory (``cached_tokens``, the metric); 0 keeps no copies."""
    openai = pytest.importorskip("openai")
    from lloyal import cli
    from lloyal.server import ServerConfig, create_app

    seen: list[ServerConfig] = []
    monkeypatch.setattr("lloyal.server.serve", lambda cfg, **kw: seen.append(cfg))
    assert cli.main(["--model", str(model_path), "serve"]) == 0
    assert cli.main(["--model", str(model_path), "serve", "--cache-ram", "0"]) == 0
    assert (seen[0].cache_ram, seen[1].cache_ram) == (8192, 0)
    assert cli.main(["--model", str(model_path), "serve", "--cache-ram", "-2"]) != 0
    assert "--cache-ram must be >= -1" in capsys.readouterr().err and len(seen) == 2
    cfg = ServerConfig(model=model_path, n_ctx=512, parallel=2, n_threads=2, cache_cells=40, cache_ram=64)
    app = create_app(cfg)
    with serving(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as c:
        assert app.state.lloyal["s"].scheduler.cache.host_budget == 64 * MIB
        chat = [{"role": "user", "content": "Write one sentence about the history of the printing press."}]
        first = c.chat.completions.create(model=cfg.name, messages=chat, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        other = [{"role": "user", "content": "Name three rivers in South America and one fact about each."}]
        c.chat.completions.create(model=cfg.name, messages=other, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        assert app.state.lloyal["s"].scheduler.cache.stats()["host_entries"] >= 1, "the first was evicted"
        turn = [*chat, {"role": "assistant", "content": first.choices[0].message.content}]
        turn.append({"role": "user", "content": "And one more?"})
        again = c.chat.completions.create(model=cfg.name, messages=turn, max_tokens=4, temperature=0)  # type: ignore[arg-type]
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached is not None and cached >= first.usage.prompt_tokens  # type: ignore[union-attr]
        metrics = httpx.get(url + "/metrics").text
        restored = re.search(r"^lloyal_prefix_cache_host_restored_tokens_total (\S+)$", metrics, re.M)
        assert restored is not None and float(restored.group(1)) == cached
