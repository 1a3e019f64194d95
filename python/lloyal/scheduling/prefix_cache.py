"""Finished requests' KV kept as cached branches, found by longest token prefix, evicted LRU.

The cache lives in the core, next to the lease and cell allocator (:class:`lloyal._lloyal.PrefixCache`,
``crates/lloyal-core/src/cache``): each entry is a live :class:`lloyal.Branch` whose KV holds
exactly its tokens; a new request forks the entry with the longest prefix of its prompt (0 new
cells for the shared part) and prefills only the rest. The engine evicts least recently used
entries nothing depends on (a leaf branch: no live fork of it; no pin) when a branch, a prompt
or a token needs a lease or cells that are not free, and prunes released branches once nothing
depends on them, inside its ticks: the scheduler never prunes for room on the event loop. An
entry a running request forked from has a live child, so it is never evicted under that request.

Entries also cost time: llama.cpp attends over every KV cell up to the highest one in use, so
cells held for possible reuse slow every decode of every request (measured: 14,000 such cells
made a 16-stream step 15-18% slower, and 13,000 made a 300-token prompt's prefill 37% slower).
:meth:`PrefixCache.trim` sets the budget of cells the entries may hold of their own; the
server's follows ``stats()["reuse"]``, the share of recent prompts the cache served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import lloyal
from lloyal import _lloyal

__all__ = ["GHOSTS", "MIN_SHARED", "CacheEntry", "PrefixCache"]

GHOSTS: int = _lloyal.PREFIX_GHOSTS
"""Keys of evicted entries remembered (without their KV): a prompt one of them would have
served counts as reuse, so a cache trimmed too far grows back (as ARC's ghost lists do)."""

MIN_SHARED: int = _lloyal.PREFIX_MIN_SHARED
"""Fewest tokens a request reuses from an entry it does not match whole
(:class:`lloyal._lloyal.Admission`): sharing less (the BOS token, a chat template's opening)
saves next to no prefill, yet ties the new branch to the entry (a parent with a live child is
never evicted)."""


@dataclass(frozen=True, eq=False)
class CacheEntry:
    """A cached branch and the tokens its KV holds."""

    branch: lloyal.Branch
    tokens: tuple[int, ...]


class PrefixCache:
    """The prefix cache of ``ctx`` (one per context: two of these share it)."""

    def __init__(self, ctx: lloyal.Context) -> None:
        self._native = _lloyal.PrefixCache(ctx)
        self._store = lloyal.BranchStore(ctx)

    def __len__(self) -> int:
        return len(self._native)

    def entries(self) -> list[CacheEntry]:
        """Every cached entry (any order)."""
        return [CacheEntry(b, tuple(t)) for b, t in self._native.entries()]

    def record(self, hit: int, prompt: Sequence[int]) -> None:
        """Count a request's prompt: ``hit`` of its tokens came from the cache. :attr:`reuse`
        also counts what a recently evicted entry would have served."""
        self._native.record(hit, list(prompt))

    def add(self, branch: lloyal.Branch, tokens: Sequence[int]) -> None:
        """Keep ``branch`` (holding ``tokens``) as an entry; when an entry already holds these
        tokens it stays and ``branch`` is released."""
        self._native.add(branch, list(tokens))

    def release(self, branch: lloyal.Branch) -> None:
        """Prune ``branch``, which the cache does not keep, as soon as nothing depends on it (no
        live fork of it, no pin)."""
        self._native.release(branch)

    def trim(self, budget: int) -> None:
        """Keep the cells the entries hold of their own within ``budget``: least recently used
        entries nothing depends on go now (when no tick runs) and at the end of every tick."""
        self._native.budget = max(0, budget)

    def follow_reuse(self) -> None:
        """Keep the budget at ``n_ctx`` times ``stats()["reuse"]``, recomputed by the core at
        every trim (the end of each tick, each :meth:`add` or :meth:`release`) until
        :meth:`trim` sets one, and the entries nothing forks (a conversation's turns count once)
        at most as many as the last 16 hits reached back, counting the requests an
        ``Admission`` admitted on a miss, which will add one each."""
        self._native.follow_reuse()

    def keep_evicted(self, host_bytes: int) -> None:
        """Copy entries into host memory as they are evicted, keeping at most ``host_bytes`` of
        copies (0: none; least recently used go first): a request that reuses more of a copy
        than of any live entry has it written back instead of prefilling its tokens again (as
        llama-server's ``--cache-ram``). A copy holds the entry's KV cells and logits."""
        self._native.host_budget = max(0, host_bytes)

    @property
    def host_budget(self) -> int:
        """Most bytes the copies of evicted entries hold (0: none kept)."""
        return self._native.host_budget

    @property
    def budget(self) -> int | None:
        """The budget in force (``None``: no limit)."""
        return self._native.budget

    async def make_room(self, *, leases: int = 0, cells: int = 0) -> bool:
        """Evict entries until ``leases`` leases and ``cells`` KV cells are free; whether they are.
        Free already: answered at once from the occupancy the last call left; else awaited (the
        engine evicts after the tick in progress, the event loop serving meanwhile)."""
        if self._store.available >= leases and self._store.kv_pressure.remaining >= cells:
            return True
        try:
            await self._native.amake_room(leases=leases, cells=cells)
        except (lloyal.LeaseExhaustedError, lloyal.KvCacheFullError):
            return False
        return True

    def clear(self) -> None:
        """Prune every entry (children first) and every released branch, and drop the host
        tier's copies."""
        self._native.clear()

    @property
    def cells(self) -> int:
        """KV cells the entries hold of their own (after their fork points)."""
        return sum(max(0, e.branch.position - e.branch.fork_head) for e in self.entries())

    def stats(self) -> dict[str, int | float]:
        """Counters: ``entries``, ``released`` (not pruned yet), ``hit_tokens``, ``lookup_tokens``,
        ``evictions``, ``reuse`` (the share of recent prompts the cache served, or would have),
        and the host tier's ``host_*`` (``PrefixCache.stats`` of ``lloyal._lloyal``)."""
        return self._native.stats()
