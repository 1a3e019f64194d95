"""Random programs over a context with a prefix cache (hypothesis' rule-based state machine):
entries added, released, pinned and looked up while branches are created, forked, prefilled,
generated and pruned, and the engine evicts whenever something needs room. After every step:
leases and cells add up, no pinned branch and no branch with a live fork was evicted, and the
cache holds only live branches."""

from __future__ import annotations

import contextlib
from collections import Counter

import hypothesis.strategies as st
from helpers import machine_report, machine_settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import lloyal
from lloyal import _lloyal

N_SEQ = 3
N_CTX = 96
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
        self.live: list[lloyal.Branch] = []
        self.pins: dict[int, int] = {}  # handle -> pins this program holds
        self.keys = 0

    def teardown(self) -> None:
        CHECKS["evictions"] += int(self.cache.stats()["evictions"])
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
        self.cache.add(b, self._tokens(4))
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
    def the_cache_holds_live_branches(self) -> None:
        live = {b.handle for b in self.live}
        assert all(b.handle in live for b, _ in self.cache.entries())
        assert self.cache.stats()["entries"] == len(self.cache.entries())


CachedBranches.TestCase.settings = machine_settings()
test_prefix_cache_state_machine = CachedBranches.TestCase
_report = machine_report("prefix cache state machine", CHECKS)
