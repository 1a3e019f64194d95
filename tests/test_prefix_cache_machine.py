"""Random programs over a context with a prefix cache (hypothesis' rule-based state machine):
entries added, released, pinned and looked up while branches are created, forked, prefilled,
generated and pruned, and the engine evicts whenever something needs room, copying what it
evicts to the host tier (when it has a budget), whose copies are written back by admission
plans. After every step: leases and cells add up, no pinned branch and no branch with a live
fork was evicted, the cache holds only live branches, and the host tier stays in its budget."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import hypothesis.strategies as st
from helpers import machine_report, machine_settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import lloyal
from lloyal import _lloyal

N_SEQ = 3
N_CTX = 96
MIB = 1 << 20
GREEDY = lloyal.SamplingParams(temperature=0.0)
CHECKS: Counter[str] = Counter()


class CachedBranches(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctx = lloyal.Context(
            lloyal.Model(lloyal.default_model_path(), n_gpu_layers=0),
            n_ctx=N_CTX,
            n_batch=32,
            n_seq_max=N_SEQ,
        )
        self.store = lloyal.BranchStore(self.ctx)
        self.cache = _lloyal.PrefixCache(self.ctx)
        self.cache.host_budget = 64 * MIB
        self.book = _lloyal.Admission(self.ctx, N_SEQ)
        self.added: dict[int, list[int]] = {}  # handle -> the tokens it was last added with
        self.gone_keys: list[list[int]] = []  # those of branches gone since (maybe copied)
        self.live: list[lloyal.Branch] = []
        self.pins: dict[int, int] = {}  # handle -> pins this program holds
        self.keys = 0

    def teardown(self) -> None:
        stats = self.cache.stats()
        CHECKS["evictions"] += int(stats["evictions"])
        CHECKS["copies kept"] += int(stats["host_kept"])
        CHECKS["copies written back"] += int(stats["host_restored"])
        self.ctx.close()

    def _pick(self, i: int) -> lloyal.Branch:
        return self.live[i % len(self.live)]

    def _snap(self) -> tuple[list[lloyal.Branch], dict[int, int]]:
        """The live branches and each one's parent, before an operation."""
        parents = {b.handle: p.handle for b in self.live if (p := b.parent) is not None}
        return list(self.live), parents

    def _settle(self, snap: tuple[list[lloyal.Branch], dict[int, int]]) -> None:
        """Forget the branches the engine pruned; none of them was pinned or had a live fork."""
        before, parents = snap
        self.live = [b for b in before if not b.disposed]
        gone = {b.handle for b in before if b.disposed}
        self.gone_keys += [self.added.pop(h) for h in gone if h in self.added]
        assert not any(self.pins.get(h) for h in gone), "a pinned branch was pruned"
        assert not any(parents.get(b.handle) in gone for b in self.live), "a parent of a live fork went"

    def _tokens(self, n: int) -> list[int]:
        self.keys += 1
        return [(1000 + 97 * self.keys + 13 * i) % 200_000 for i in range(n)]

    @rule(n=st.integers(0, 40))
    def create(self, n: int) -> None:
        snap = self._snap()
        try:
            b = lloyal.Branch.create(self.ctx, 0, GREEDY)
        except lloyal.LeaseExhaustedError:
            self._settle(snap)
            assert self.store.available == 0
            return
        self._settle(snap)
        self.live.append(b)
        if n:
            snap = self._snap()
            try:
                b.prefill(self._tokens(n))
            except lloyal.KvCacheFullError:
                assert b.position == 0
            self._settle(snap)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def fork(self, i: int) -> None:
        parent = self._pick(i)
        snap = self._snap()
        try:
            child = parent.fork()
        except lloyal.LeaseExhaustedError:
            self._settle(snap)
            return
        self._settle(snap)
        assert not parent.disposed
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), n=st.integers(1, 12))
    def generate(self, i: int, n: int) -> None:
        b = self._pick(i)
        if b.position == 0 or b.children:
            return
        snap = self._snap()
        with contextlib.suppress(lloyal.KvCacheFullError):  # the cache was full: fewer tokens
            list(b.generate(n, reserve=False))  # never evicted while it generates (no BranchDisposedError)
        self._settle(snap)  # once done, a cached branch over the budget may go

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def add(self, i: int) -> None:
        b = self._pick(i)
        snap = self._snap()
        tokens = self._tokens(4)
        self.cache.add(b, tokens)
        self.added[b.handle] = tokens
        self._settle(snap)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def release(self, i: int) -> None:
        snap = self._snap()
        self.cache.release(self._pick(i))
        self._settle(snap)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def pin(self, i: int) -> None:
        b = self._pick(i)
        self.cache.pin(b)
        self.pins[b.handle] = self.pins.get(b.handle, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(i=st.integers(0, 99))
    def unpin(self, i: int) -> None:
        held = [b for b in self.live if self.pins.get(b.handle)]
        if not held:
            return
        b = held[i % len(held)]
        snap = self._snap()
        self.pins[b.handle] -= 1
        self.cache.unpin(b)
        self._settle(snap)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def prune(self, i: int) -> None:
        b = self._pick(i)
        if b.children:
            return
        snap = self._snap()
        b.prune()
        self.pins.pop(b.handle, None)
        self._settle(snap)

    @precondition(lambda self: self.gone_keys)
    @rule(i=st.integers(0, 99))
    def restore(self, i: int) -> None:
        """A request for a gone entry's tokens: written back from the host tier when a copy of
        it is kept (its plan's room found, evicting if need be), else a plan that forks nothing."""
        snap = self._snap()
        keys = self.gone_keys[i % len(self.gone_keys) :] + self.gone_keys[: i % len(self.gone_keys)]
        for tokens in keys:  # the first with a copy kept (a plan that does not restore puts nothing out)
            plan = self.book.plan(tokens, 1)
            assert plan is not None, "a slot is free: nothing else is admitted"
            if plan.restores:
                break
            self.book.release(plan)
        else:
            self._settle(snap)
            return
        try:
            asyncio.run(self.cache.amake_room(leases=plan.leases, cells=plan.cells))
        except (lloyal.LeaseExhaustedError, lloyal.KvCacheFullError):
            self.book.release(plan)  # the copy goes back to the host tier
            self._settle(snap)
            return
        self.book.reserve(plan)
        b = asyncio.run(self.book.arestore(plan))
        assert b.position >= 1  # a copy holds cells
        assert any(e.handle == b.handle for e, _ in self.cache.entries()), "an entry again"
        child = b.fork()  # as the request forks it (the plan's second lease), before admitted
        self.book.admitted(plan)
        self.book.release(plan)
        self._settle(snap)
        assert not b.disposed, "it has a live fork"
        self.added[b.handle] = tokens
        self.live += [b, child]

    @rule(on=st.booleans())
    def host_budget(self, on: bool) -> None:
        self.cache.host_budget = 64 * MIB if on else 0

    @rule(budget=st.sampled_from([None, 0, 20, 80]))
    def set_budget(self, budget: int | None) -> None:
        snap = self._snap()
        self.cache.budget = budget
        self._settle(snap)

    @invariant()
    def leases_and_cells_add_up(self) -> None:
        CHECKS["invariant checks (one per step)"] += 1
        assert self.store.available + len(self.live) == N_SEQ
        assert self.store.kv_pressure.cells_used == sum(b.position - b.fork_head for b in self.live)

    @invariant()
    def the_host_tier_stays_in_its_budget(self) -> None:
        stats = self.cache.stats()
        assert stats["host_bytes"] <= self.cache.host_budget
        assert (stats["host_entries"] == 0) == (stats["host_bytes"] == 0)

    @invariant()
    def the_cache_holds_live_branches(self) -> None:
        live = {b.handle for b in self.live}
        assert all(b.handle in live for b, _ in self.cache.entries())
        assert self.cache.stats()["entries"] == len(self.cache.entries())


CachedBranches.TestCase.settings = machine_settings()
test_prefix_cache_state_machine = CachedBranches.TestCase
_report = machine_report("prefix cache state machine", CHECKS)
