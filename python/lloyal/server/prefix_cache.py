"""Finished requests' KV kept as cached branches, found by longest token prefix, evicted LRU.

Each entry is a live :class:`lloyal.Branch` whose KV holds exactly ``tokens`` (positions
``0..len(tokens)``) and whose logits snapshot is that of the last token. A new request forks
the entry with the longest prefix of its prompt (0 new cells for the shared part) and prefills
only the rest. Entries cost a lease each; :meth:`PrefixCache.evict` prunes least-recently-used
entries that nothing depends on (a leaf branch: no live fork of it) until enough leases or KV
cells are free. An entry a running request forked from has a live child, so it is never evicted
under that request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import lloyal

from .radix import RadixTree

__all__ = ["CacheEntry", "PrefixCache"]


@dataclass(eq=False)
class CacheEntry:
    """A cached branch and the tokens its KV holds."""

    branch: lloyal.Branch
    tokens: tuple[int, ...]
    last_used: float = field(default_factory=time.monotonic)
    pins: int = 0  # running requests about to fork from it


class PrefixCache:
    """Cached branches of one context, indexed by a radix tree over their tokens."""

    def __init__(self, store: lloyal.BranchStore) -> None:
        self._store = store
        self._tree: RadixTree[CacheEntry] = RadixTree()
        self.hit_tokens = 0  # prompt tokens served from the cache (for the hit rate)
        self.lookup_tokens = 0  # prompt tokens looked up
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._tree)

    def entries(self) -> list[CacheEntry]:
        """Every cached entry (any order)."""
        return [e for _, e in self._tree.items()]

    def lookup(self, tokens: Sequence[int]) -> tuple[CacheEntry | None, int]:
        """The entry to fork for ``tokens`` and how many tokens to reuse, pinned (unpin: ``pins -= 1``).

        An entry whose whole sequence is a prefix of ``tokens`` is forked whole (its logits come
        along); an entry that shares more tokens but then diverges is forked at the shared length
        (``Branch.fork(at=)``), keeping at least one token to prefill so the fork gets logits.
        """
        n_full, full = self._tree.longest_prefix(tokens)
        d, part = self._tree.deepest_match(tokens)
        d = min(d, len(tokens) - 1)
        entry, used = (part, d) if part is not None and d > n_full else (full, n_full)
        if entry is None or entry.branch.disposed or used == 0:
            return None, 0
        entry.last_used = time.monotonic()
        entry.pins += 1
        return entry, used

    def record(self, hit: int, total: int) -> None:
        """Count a request's prompt: ``hit`` of its ``total`` tokens came from the cache."""
        self.hit_tokens += hit
        self.lookup_tokens += total

    def add(self, branch: lloyal.Branch, tokens: Sequence[int]) -> None:
        """Keep ``branch`` (holding ``tokens``) as an entry; an older entry for the same tokens is pruned."""
        key = tuple(tokens)
        old = self._tree.get(key)
        if old is not None and old.branch is not branch:
            if old.pins or not old.branch.is_leaf:
                branch.prune_subtree()  # keep the one others depend on
                old.last_used = time.monotonic()
                return
            old.branch.prune()
        self._tree.insert(key, CacheEntry(branch, key))

    def evictable(self) -> list[CacheEntry]:
        """Entries that can go now (unpinned leaves), least recently used first."""
        out = [e for e in self.entries() if e.pins == 0 and e.branch.is_leaf]
        return sorted(out, key=lambda e: e.last_used)

    def evict(self, *, leases: int = 0, cells: int = 0) -> bool:
        """Prune LRU entries until ``leases`` leases and ``cells`` KV cells are free; True when they are.

        Pruning an entry frees only its own cells (those after its fork point), so several may go.
        """
        while self._store.available < leases or self._store.kv_pressure.remaining < cells:
            victims = self.evictable()
            if not victims:
                return False
            self.drop(victims[0])
        return True

    def drop(self, entry: CacheEntry) -> None:
        """Remove ``entry`` and prune its branch."""
        self._tree.remove(entry.tokens)
        if not entry.branch.disposed:
            entry.branch.prune()
        self.evictions += 1

    def clear(self) -> None:
        """Prune every entry (children first)."""
        for e in sorted(self.entries(), key=lambda e: -len(e.tokens)):
            self._tree.remove(e.tokens)
            if not e.branch.disposed:
                e.branch.prune_subtree()
