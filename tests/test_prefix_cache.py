"""The prefix cache in the core (``lloyal._lloyal.PrefixCache``): lookups, pins, and the engine
evicting entries when a branch, a prompt or a token needs room, with no call from Python."""

from __future__ import annotations

import asyncio

import pytest
from helpers import cached

import lloyal
from lloyal import _lloyal

GREEDY = lloyal.SamplingParams(temperature=0.0)


def test_lookup_forks_a_whole_entry_or_a_shared_run_and_pins_it(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=512, n_seq_max=4) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        a = list(range(100, 140))
        entry = cached(ctx, cache, a)
        hit = cache.lookup([*a, 7, 8])
        assert hit is not None and (hit[0].handle, hit[1], hit[2]) == (entry.handle, 40, 40)
        hit = cache.lookup([*a[:30], 9])  # diverges after 30: forked at 30
        assert hit is not None and hit[1:] == (30, 40)
        assert cache.lookup([*a[:10], 1]) is None  # 10 shared: below PREFIX_MIN_SHARED
        assert cache.lookup([5] * 40) is None
        assert cache.stats()["hit_tokens"] == 0 and len(cache) == 1
        # a second branch for the same tokens is released: pruned at once (a leaf, no pins)
        dup = lloyal.Branch.create(ctx, 0, GREEDY)
        dup.prefill(a)
        assert not cache.add(dup, a) and dup.disposed and len(cache) == 1
        with lloyal.Context(model, n_ctx=64) as other:
            stranger = lloyal.Branch.create(other, 0, GREEDY)
            with pytest.raises(ValueError, match="different context"):
                cache.add(stranger, [1])


def test_a_branch_that_needs_a_lease_evicts_the_least_recently_used_unpinned_leaf(
    model: lloyal.Model,
) -> None:
    with lloyal.Context(model, n_ctx=512, n_seq_max=3) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        store = lloyal.BranchStore(ctx)
        old = cached(ctx, cache, list(range(100, 120)))
        new = cached(ctx, cache, list(range(200, 220)))
        hit = cache.lookup(list(range(100, 125)))  # pins `old`
        assert hit is not None and hit[0].handle == old.handle
        touched = cache.lookup(list(range(200, 225)))  # `new` is the most recently used
        assert touched is not None and touched[0].handle == new.handle
        cache.unpin(new)
        third = lloyal.Branch.create(ctx, 0, GREEDY)
        assert store.available == 0
        fourth = lloyal.Branch.create(ctx, 0, GREEDY)  # `new` goes: `old`, older, is pinned
        assert new.disposed and not old.disposed and cache.stats()["evictions"] == 1 and len(cache) == 1
        with pytest.raises(lloyal.LeaseExhaustedError):
            lloyal.Branch.create(ctx, 0, GREEDY)  # nothing evictable: the pinned entry stays
        assert not old.disposed and store.available == 0
        cache.unpin(old)
        with pytest.raises(lloyal.LeaseExhaustedError):
            old.fork()  # a fork needs a lease, but never gets it by evicting the branch it forks
        assert not old.disposed and len(cache) == 1
        third.prune()
        child = old.fork()
        assert child.position == 20 and child.parent.handle == old.handle
        for b in (fourth, child):
            b.prune()
        cache.clear()
        assert old.disposed and store.available == 3 and store.kv_pressure.cells_used == 0


def test_a_generation_prompt_evicts_entries_inside_the_engine(model: lloyal.Model) -> None:
    """A prompt that needs the cells an entry holds: the engine evicts it when it admits the
    prompt (a parent whose fork lives is kept), and generation goes on."""
    with lloyal.Context(model, n_ctx=256, n_batch=64, n_seq_max=4) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        store = lloyal.BranchStore(ctx)
        parent = cached(ctx, cache, list(range(300, 400)))  # 100 cells
        kept = parent.fork()  # a live fork: `parent` is no leaf, not evictable
        spare = cached(ctx, cache, list(range(500, 600)))  # 100 more: 56 free
        b = lloyal.Branch.create(ctx, 0, GREEDY)
        out = list(b.generate(8, prompt=list(range(1000, 1080)), timeout=5.0))  # 80 + 8 cells
        assert len(out) == 8 and b.position == 88
        assert spare.disposed and not parent.disposed and cache.stats()["evictions"] == 1 and len(cache) == 1
        assert store.kv_pressure.cells_used == 100 + 88
        for x in (b, kept):
            x.prune()
        cache.clear()


def test_released_branches_go_when_their_last_fork_does(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256, n_seq_max=4) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, 0, GREEDY)
        root.prefill(list(range(100, 120)))
        child = root.fork()
        cache.pin(child)
        cache.release(root)
        cache.release(child)
        assert not root.disposed and not child.disposed and cache.stats()["released"] == 2  # child pinned
        cache.unpin(child)  # the engine is idle: swept at once, the child and then its parent
        assert root.disposed and child.disposed and cache.stats()["released"] == 0
        assert store.available == 4 and store.kv_pressure.cells_used == 0


def test_make_room_evicts_or_says_why_not(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256, n_seq_max=2) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        store = lloyal.BranchStore(ctx)
        entry = cached(ctx, cache, list(range(100, 300)))
        asyncio.run(cache.amake_room(leases=2, cells=100))
        assert entry.disposed and cache.stats()["evictions"] == 1 and store.available == 2
        entry = cached(ctx, cache, list(range(100, 150)))
        with pytest.raises(lloyal.KvCacheFullError):
            asyncio.run(cache.amake_room(cells=300))  # more than n_ctx: nothing is evicted for it
        with pytest.raises(lloyal.LeaseExhaustedError):
            asyncio.run(cache.amake_room(leases=3))
        assert not entry.disposed and len(cache) == 1
        cache.budget = 10  # over the budget: the least recently used entries go
        assert entry.disposed and cache.stats()["evictions"] == 2 and cache.budget == 10


def test_closing_the_context_forgets_the_entries(model: lloyal.Model) -> None:
    ctx = lloyal.Context(model, n_ctx=128, n_seq_max=2)
    cache = _lloyal.PrefixCache(ctx)
    b = cached(ctx, cache, list(range(100, 120)))
    ctx.close()
    assert b.disposed and len(cache) == 0 and cache.lookup(list(range(100, 130))) is None


def test_a_branch_the_engine_generates_on_is_never_evicted(model: lloyal.Model) -> None:
    """A cached branch over the budget that a generation request runs on stays while it runs
    (the budget is kept at the end of every tick), and goes when the request ends."""
    with lloyal.Context(model, n_ctx=256, n_seq_max=2) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        b = lloyal.Branch.create(ctx, 0, GREEDY)
        b.prefill(list(range(100, 110)))
        child = b.fork()
        cache.add(child, [*range(100, 110), 0])  # a fork: no cells of its own yet
        cache.budget = 0
        assert not child.disposed
        stops = {ctx.eog_token} | {t for t in range(300) if ctx.is_stop_token(t)}
        child.set_logit_bias({t: float("-inf") for t in stops})
        out = list(child.generate(6))  # 6 ticks, each ending over the budget
        assert len(out) == 6 and child.disposed and cache.stats()["evictions"] >= 1


def test_loading_a_saved_branch_evicts_for_its_lease_and_cells(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=64, n_seq_max=2) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        b = lloyal.Branch.create(ctx, 0, GREEDY)
        b.prefill(list(range(100, 130)))
        saved = b.save_state()
        entry = cached(ctx, cache, list(range(200, 230)))  # 60 of 64 cells, both leases held
        copy = lloyal.Branch.load_state(ctx, saved)
        assert entry.disposed and cache.stats()["evictions"] == 1
        assert copy.position == 30 and copy.produce().token == b.produce().token


def test_the_default_policy_keeps_the_prompts_the_recent_hits_reached(model: lloyal.Model) -> None:
    """Every kept cell slows every decode a little (llama.cpp attends up to the highest cell in
    use), so a cache that follows reuse keeps as many entries that nothing forks as its recent
    hits reached back: after a hit on the newest of five prompts (reach 1), whose fork is
    cached as a server caches a finished request, the four prompts used once go with their
    leases; the one hit stays under its fork."""
    with lloyal.Context(model, n_ctx=1024, n_seq_max=8) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        cache.follow_reuse()
        store = lloyal.BranchStore(ctx)
        olds = [cached(ctx, cache, list(range(1000 * i + 100, 1000 * i + 140))) for i in range(5)]
        assert len(cache) == 5, "no hit yet: no limit but the budget (n_ctx x reuse, reuse 1)"
        hit = cache.lookup([*range(4100, 4140), 7])
        assert hit is not None and hit[0].handle == olds[4].handle
        answer = olds[4].fork()
        answer.prefill([7, 8, 9])
        cache.unpin(olds[4])
        assert cache.add(answer, [*range(4100, 4140), 7, 8, 9])
        assert {b.handle for b, _ in cache.entries()} == {olds[4].handle, answer.handle}
        assert [b.disposed for b in olds] == [True, True, True, True, False]
        assert store.available == 8 - 2 and cache.stats()["evictions"] == 4


def test_a_conversations_turns_count_once_against_the_entry_limit(model: lloyal.Model) -> None:
    """Each turn of a chat forks the last one's entry, so the older turns are not entries a
    user comes back to on their own: after a hit at reach 1 (a limit of 1), the next turn's
    entry evicts the older prompt that nothing forks, and the conversation's four turns stay."""
    with lloyal.Context(model, n_ctx=1024, n_seq_max=8) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        cache.follow_reuse()
        other = cached(ctx, cache, list(range(5000, 5040)))
        history = list(range(100, 140))
        turns = [cached(ctx, cache, history)]
        for t in range(3):
            if t == 2:  # the chat's next turn: the newest of its entries, nothing newer
                hit = cache.lookup([*history, 7])
                assert hit is not None and hit[0].handle == turns[-1].handle and hit[1] == len(history)
                cache.unpin(turns[-1])
            nxt = turns[-1].fork()
            more = list(range(200 + 40 * t, 240 + 40 * t))
            nxt.prefill(more)
            history = [*history, *more]
            assert cache.add(nxt, history)
            turns.append(nxt)
        assert not any(b.disposed for b in turns) and other.disposed
        assert {b.handle for b, _ in cache.entries()} == {b.handle for b in turns}


def test_forking_a_released_branch_evicts_around_it_never_it(model: lloyal.Model) -> None:
    """A fork that needs a lease may evict entries and prune released branches, but not the
    branch it forks: with every lease held by a released chain ending in an entry, forking the
    chain's released root evicts the entry and prunes the middle, and the root stays (found by
    the prefix-cache state machine: the sweep pruned the parent the fork was making room for)."""
    with lloyal.Context(model, n_ctx=96, n_batch=32, n_seq_max=3) as ctx:
        cache = _lloyal.PrefixCache(ctx)
        root = lloyal.Branch.create(ctx, 0, GREEDY)
        middle = root.fork()
        leaf = middle.fork()
        cache.release(root)
        assert cache.add(leaf, [1000, 1097, 1194, 1291])
        cache.release(middle)
        child = root.fork()
        assert (root.disposed, middle.disposed, leaf.disposed) == (False, True, True)
        assert child.parent is not None and child.parent.handle == root.handle
        child.prune()  # the root's last fork: the released root goes with the next sweep
        cache.clear()
        assert root.disposed and lloyal.BranchStore(ctx).available == 3
