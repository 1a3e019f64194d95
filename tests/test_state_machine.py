"""Random operation sequences on branches (hypothesis stateful testing) on the real model.

Every step is a create, fork, prefill, produce, commit (single or batched), prune,
prune_subtree, retain_only, save/load or an invalid move (disposed branch, bad token, lease or
KV exhaustion on a small context). After every step the invariants hold:
``available + live == n_seq_max``; each live branch's ``position == kv_seq_pos_max + 1``;
``kv_pressure.cells_used`` equals the sum of the branches' own cells; parent/children links
agree; errors are the documented classes. ``LLOYAL_STATE_STEPS`` scales the run (``make soak``).
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from helpers import machine_report, machine_settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import lloyal

N_SEQ = 4
N_CTX = 192
_MODEL: lloyal.Model | None = None
CHECKS: Counter[str] = Counter()
LETTERS = "root ::= [a-z ]+"
DIGIT_TOKEN = 236832  # "7": never allowed by LETTERS


def _model() -> lloyal.Model:
    global _MODEL
    if _MODEL is None:
        # Batch-invariant contexts (on the CPU, on a GPU run too): the checks compare with ==.
        _MODEL = lloyal.Model(lloyal.default_model_path(), repack=False, n_gpu_layers=0)
    return _MODEL


class Branches(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctx = lloyal.Context(_model(), n_ctx=N_CTX, n_batch=32, n_seq_max=N_SEQ)
        self.store = lloyal.BranchStore(self.ctx)
        self.live: list[lloyal.Branch] = []
        self.dead: list[lloyal.Branch] = []
        self.params = lloyal.SamplingParams(temperature=0.8, seed=5)

    def teardown(self) -> None:
        self.ctx.close()

    # ------------------------------------------------------------------ helpers
    def _pick(self, i: int) -> lloyal.Branch:
        return self.live[i % len(self.live)]

    def _refresh(self) -> None:
        still = [b for b in self.live if not b.disposed]
        self.dead += [b for b in self.live if b.disposed]
        self.live = still

    def _snapshot(self) -> list[tuple[int, int, float]]:
        return [(b.position, self.ctx.kv_seq_pos_max(b.seq_id), b.perplexity) for b in self.live]

    # ------------------------------------------------------------------ rules
    @rule(n=st.integers(1, 40))
    def create_and_prefill(self, n: int) -> None:
        if self.store.available == 0:
            with pytest.raises(lloyal.LeaseExhaustedError):
                lloyal.Branch.create(self.ctx, 0, self.params)
            return
        b = lloyal.Branch.create(self.ctx, 0, self.params)
        self.live.append(b)
        tokens = [(1000 + 37 * i) % 200_000 for i in range(n)]
        room = self.store.kv_pressure.remaining
        if n > room:
            with pytest.raises(lloyal.KvCacheFullError):
                b.prefill(tokens)
            assert b.position == 0
        else:
            b.prefill(tokens)
            assert b.position == n

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def fork(self, i: int) -> None:
        parent = self._pick(i)
        if self.store.available == 0:
            with pytest.raises(lloyal.LeaseExhaustedError):
                parent.fork()
            return
        cells = self.store.kv_pressure.cells_used
        child = parent.fork()
        assert child.position == parent.position and child.parent == parent
        assert self.store.kv_pressure.cells_used == cells
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def produce_twice_is_stable(self, i: int) -> None:
        b = self._pick(i)
        if b.position == 0:
            with pytest.raises(lloyal.LloyalError):
                b.produce()
            return
        first = b.produce().token
        assert b.produce().token == first and 0 <= first < self.ctx.n_vocab

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def batched_commit(self, data: st.DataObject) -> None:
        ready = [b for b in self.live if b.position > 0]
        if not ready:
            return
        chosen = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=len(ready), unique=True))
        before = self._snapshot()
        positions = {b: b.position for b in chosen}
        pairs = [(b, b.produce().token) for b in chosen]
        if len(chosen) > self.store.kv_pressure.remaining:
            with pytest.raises(lloyal.KvCacheFullError):
                self.store.commit(pairs)
            assert self._snapshot() == before  # all-or-nothing
        else:
            self.store.commit(pairs)
            assert all(b.position == positions[b] + 1 for b in chosen)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def single_commit(self, i: int) -> None:
        b = self._pick(i)
        if b.position == 0:
            return
        before = self._snapshot()
        token = b.produce().token
        if self.store.kv_pressure.remaining == 0:
            with pytest.raises(lloyal.KvCacheFullError):
                b.commit(token)
            assert self._snapshot() == before
        else:
            b.commit(token)
            assert b.position == before[self.live.index(b)][0] + 1

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), letters=st.booleans())
    def set_grammar(self, i: int, letters: bool) -> None:
        """Constrain a branch to lowercase letters and spaces (or lift it); a forbidden token is
        refused without changing anything."""
        b = self._pick(i)
        b.set_grammar(LETTERS if letters else None)
        if letters and b.position > 0:
            before = self._snapshot()
            with pytest.raises(lloyal.GrammarError):
                b.commit(DIGIT_TOKEN)
            assert self._snapshot() == before

    @rule()
    def close_and_reopen(self) -> None:
        """Closing the context disposes every branch; a new context starts empty."""
        old = self.live
        self.ctx.close()
        for b in old[:3]:
            with pytest.raises((lloyal.ContextClosedError, lloyal.BranchDisposedError)):
                b.fork()
        with pytest.raises(lloyal.ContextClosedError):
            lloyal.Branch.create(self.ctx, 0, self.params)
        self.ctx = lloyal.Context(_model(), n_ctx=N_CTX, n_batch=32, n_seq_max=N_SEQ)
        self.store = lloyal.BranchStore(self.ctx)
        self.live, self.dead = [], []
        assert self.store.available == N_SEQ

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), token=st.sampled_from([-1, 262_144, 10**12]))
    def bad_token_changes_nothing(self, i: int, token: int) -> None:
        b = self._pick(i)
        before = self._snapshot()
        with pytest.raises(lloyal.InvalidTokenError):
            b.commit(token)
        assert self._snapshot() == before

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def prune(self, i: int) -> None:
        b = self._pick(i)
        if b.children:
            with pytest.raises(lloyal.TopologyError):
                b.prune()
        else:
            b.prune()
        self._refresh()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def prune_subtree(self, i: int) -> None:
        self._pick(i).prune_subtree()
        self._refresh()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def retain_only(self, i: int) -> None:
        winner = self._pick(i)
        self.store.retain_only(winner)
        self._refresh()
        assert self.live == [winner] and winner.parent is None and winner.children == []

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def save_and_load(self, i: int) -> None:
        b = self._pick(i)
        data = b.save_state()
        if self.store.available == 0:
            with pytest.raises(lloyal.LeaseExhaustedError):
                lloyal.Branch.load_state(self.ctx, data)
            return
        own = b.position  # a loaded branch holds all of its cells itself
        if own > self.store.kv_pressure.remaining:
            with pytest.raises(lloyal.KvCacheFullError):
                lloyal.Branch.load_state(self.ctx, data)
            return
        copy = lloyal.Branch.load_state(self.ctx, data)
        assert copy.position == b.position and copy.parent is None
        self.live.append(copy)

    @precondition(lambda self: self.dead)
    @rule(i=st.integers(0, 99))
    def disposed_branch_rejects(self, i: int) -> None:
        b = self.dead[i % len(self.dead)]
        with pytest.raises(lloyal.BranchDisposedError):
            b.fork()
        with pytest.raises(lloyal.BranchDisposedError):
            _ = b.position

    # ------------------------------------------------------------------ invariants
    @invariant()
    def leases_add_up(self) -> None:
        CHECKS["invariant checks (one per step)"] += 1
        assert self.store.available + len(self.live) == N_SEQ

    @invariant()
    def positions_match_kv(self) -> None:
        for b in self.live:
            assert b.position == self.ctx.kv_seq_pos_max(b.seq_id) + 1

    @invariant()
    def cells_used_is_exact(self) -> None:
        assert self.store.kv_pressure.cells_used == sum(b.position - b.fork_head for b in self.live)

    @invariant()
    def topology_is_consistent(self) -> None:
        live = set(self.live)
        for b in self.live:
            if b.parent is not None:
                assert b.parent in live and b in b.parent.children
            assert all(c in live and c.parent == b for c in b.children)


Branches.TestCase.settings = machine_settings()
test_branch_state_machine = Branches.TestCase
_report = machine_report("branch state machine", CHECKS)
