"""Finished requests' KV kept as cached branches, found by longest token prefix, evicted LRU.

Each entry is a live :class:`lloyal.Branch` whose KV holds exactly ``tokens`` (positions
``0..len(tokens)``) and whose logits snapshot is that of the last token. A new request forks
the entry with the longest prefix of its prompt (0 new cells for the shared part) and prefills
only the rest. Entries cost a lease each; :meth:`PrefixCache.evict` prunes least-recently-used
entries that nothing depends on (a leaf branch: no live fork of it) until enough leases or KV
cells are free. An entry a running request forked from has a live child, so it is never evicted
under that request.

Entries also cost time: llama.cpp attends over every KV cell up to the highest one in use, so
cells held for possible reuse slow every decode of every request (measured: 14,000 such cells
made a 16-stream step 15-18% slower, and 13,000 made a 300-token prompt's prefill 37% slower).
:meth:`PrefixCache.trim` keeps the cells the entries hold of their own within a budget; the
server's follows :attr:`PrefixCache.reuse`, the share of recent prompts the cache served.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import lloyal

from .radix import RadixTree

V = TypeVar("V")

__all__ = ["GHOSTS", "MIN_SHARED", "REUSE_WEIGHT", "CacheEntry", "PrefixCache", "reusable"]

GHOSTS = 64
"""Keys of evicted entries remembered (without their KV): a prompt one of them would have
served counts as reuse, so a cache trimmed too far grows back (as ARC's ghost lists do)."""

REUSE_WEIGHT = 0.1
"""Weight of the newest request in :attr:`PrefixCache.reuse` (about the last 10 requests count)."""

MIN_SHARED = 16
"""Fewest tokens a request reuses from an entry it does not match whole: sharing less (the
BOS token, a chat template's opening) saves next to no prefill, yet ties the new branch to the
entry (a parent with a live child is never evicted)."""


@dataclass(eq=False)
class CacheEntry:
    """A cached branch and the tokens its KV holds."""

    branch: lloyal.Branch
    tokens: tuple[int, ...]
    cells: int = 0  # KV cells of its own (after the point it was forked at), freed when pruned
    last_used: float = field(default_factory=time.monotonic)
    pins: int = 0  # running requests about to fork from it
    holder: object = None  # what else may pin it (``pins``): the request it came from


class PrefixCache:
    """Cached branches of one context, indexed by a radix tree over their tokens."""

    def __init__(self, store: lloyal.BranchStore) -> None:
        self._store = store
        self.cells = 0  # cells of their own the entries hold
        self._tree: RadixTree[CacheEntry] = RadixTree()
        self.reuse = 1.0  # moving average of the share of a prompt the cache served or would have
        self._ghosts: RadixTree[bool] = RadixTree()  # keys of recently evicted entries
        self._ghost_order: deque[tuple[int, ...]] = deque()
        self.hit_tokens = 0  # prompt tokens served from the cache (for the hit rate)
        self.lookup_tokens = 0  # prompt tokens looked up
        self.evictions = 0
        self._orphans: list[tuple[lloyal.Branch, object]] = []  # (branch, holder): see release

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
        Fewer than :data:`MIN_SHARED` shared tokens (unless that is all of ``tokens``) is a miss.
        """
        found = reusable(self._tree, tokens)
        if found is None or found[1].branch.disposed:
            return None, 0
        used, entry = found
        entry.last_used = time.monotonic()
        entry.pins += 1
        return entry, used

    def record(self, hit: int, prompt: Sequence[int]) -> None:
        """Count a request's prompt: ``hit`` of its tokens came from the cache. :attr:`reuse`
        also counts what a recently evicted entry would have served."""
        self.hit_tokens += hit
        self.lookup_tokens += len(prompt)
        ghost = reusable(self._ghosts, prompt)
        if ghost is not None:
            hit = max(hit, ghost[0])
        self.reuse += REUSE_WEIGHT * (hit / max(1, len(prompt)) - self.reuse)

    def add(self, branch: lloyal.Branch, tokens: Sequence[int], cells: int, holder: object = None) -> None:
        """Keep ``branch`` (holding ``tokens``, ``cells`` of them its own) as an entry; an older
        entry for the same tokens is pruned. ``holder`` (an object with ``pins``) keeps the
        entry while it has pins, as :meth:`release` does."""
        key = tuple(tokens)
        old = self._tree.get(key)
        if old is not None and old.branch is not branch:
            if not _unpinned(old) or not old.branch.is_leaf:
                self.release(branch, holder)  # keep the one others depend on
                old.last_used = time.monotonic()
                return
            old.branch.prune()
            self.cells -= old.cells
        self._tree.insert(key, CacheEntry(branch, key, cells, holder=holder))
        self.cells += cells

    def release(self, branch: lloyal.Branch, holder: object = None) -> None:
        """Prune ``branch``, which the cache does not keep, as soon as nothing depends on it:
        now when it is a leaf and ``holder`` (an object with ``pins``, such as a request that
        is about to fork it) has none, else at a later :meth:`sweep` (live forks of a running
        request's branch are other requests' choices)."""
        self._orphans.append((branch, holder))
        self.sweep()

    def sweep(self) -> None:
        """Prune released branches that nothing depends on any more."""
        kept: list[tuple[lloyal.Branch, object]] = []
        for branch, holder in self._orphans:
            if branch.disposed:
                continue
            if branch.is_leaf and not getattr(holder, "pins", 0):
                branch.prune()
            else:
                kept.append((branch, holder))
        self._orphans = kept

    def trim(self, budget: int) -> None:
        """Prune LRU entries nothing depends on until the cells the entries hold of their own
        are within ``budget``."""
        if self.cells <= budget:
            return
        for victim in self.evictable():  # one pass: a parent freed by it waits for the next trim
            self.drop(victim)
            if self.cells <= budget:
                return

    def evictable(self) -> list[CacheEntry]:
        """Entries that can go now (unpinned leaves), least recently used first."""
        out = [e for e in self.entries() if _unpinned(e) and e.branch.is_leaf]
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
        self.cells -= entry.cells
        if not entry.branch.disposed:
            entry.branch.prune()
        self.evictions += 1
        if self._orphans:
            self.sweep()  # its parent may have been released while it lived
        if self._ghosts.get(entry.tokens) is None:
            self._ghosts.insert(entry.tokens, True)
            self._ghost_order.append(entry.tokens)
            while len(self._ghost_order) > GHOSTS:
                self._ghosts.remove(self._ghost_order.popleft())

    def clear(self) -> None:
        """Prune every entry (children first) and every released branch."""
        for b, _ in self._orphans:
            if not b.disposed:
                b.prune_subtree()
        self._orphans.clear()
        for e in sorted(self.entries(), key=lambda e: -len(e.tokens)):
            self._tree.remove(e.tokens)
            if not e.branch.disposed:
                e.branch.prune_subtree()
        self.cells = 0


def _unpinned(e: CacheEntry) -> bool:
    return e.pins == 0 and not getattr(e.holder, "pins", 0)


def reusable(tree: RadixTree[V], tokens: Sequence[int]) -> tuple[int, V] | None:
    """``(tokens reused, value)`` of the key in ``tree`` a request for ``tokens`` would fork:
    a whole key that prefixes ``tokens``, or a longer shared run of a diverging key (at least
    one token left to prefill); None below :data:`MIN_SHARED` shared tokens (unless that is
    all of ``tokens``)."""
    n_full, full = tree.longest_prefix(tokens)
    d, part = tree.deepest_match(tokens)
    d = min(d, len(tokens) - 1)
    if part is not None and d > n_full:
        n_full, full = d, part
    if full is None or n_full < min(MIN_SHARED, len(tokens)):
        return None
    return n_full, full
