"""A radix tree over token ids: which stored sequence is the longest prefix of a prompt.

Pure data structure (no llama.cpp): keys are token sequences, values are whatever the caller
stores (the server stores cached branches). Edges hold runs of tokens, so a 2,000-token prompt
shared by many requests is one edge, not 2,000 nodes.

Example:
    >>> t: RadixTree[str] = RadixTree()
    >>> t.insert([1, 2, 3], "a")
    >>> t.insert([1, 2, 3, 4, 5], "b")
    >>> t.longest_prefix([1, 2, 3, 4, 9])
    (3, 'a')
    >>> t.longest_prefix([1, 2, 3, 4, 5, 6])
    (5, 'b')
    >>> t.deepest_match([1, 2, 3, 4, 7])
    (4, 'b')
    >>> t.remove([1, 2, 3])
    True
    >>> t.longest_prefix([1, 2, 3, 4])
    (0, None)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

__all__ = ["RadixTree"]

V = TypeVar("V")


class _Node(Generic[V]):
    __slots__ = ("children", "edge", "has_value", "value")

    def __init__(self, edge: tuple[int, ...]) -> None:
        self.edge = edge
        self.children: dict[int, _Node[V]] = {}
        self.has_value = False
        self.value: V | None = None


def _common(a: Sequence[int], a0: int, b: tuple[int, ...]) -> int:
    """Length of the common prefix of ``a[a0:]`` and ``b``."""
    n = min(len(a) - a0, len(b))
    i = 0
    while i < n and a[a0 + i] == b[i]:
        i += 1
    return i


class RadixTree(Generic[V]):
    """Token-sequence keys to values, with longest-stored-prefix lookup."""

    def __init__(self) -> None:
        self._root: _Node[V] = _Node(())
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def insert(self, key: Sequence[int], value: V) -> None:
        """Store ``value`` under ``key`` (replacing a value stored under the same key)."""
        node, i = self._root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf: _Node[V] = _Node(tuple(key[i:]))
                node.children[key[i]] = leaf
                node = leaf
                i = len(key)
                break
            k = _common(key, i, child.edge)
            if k < len(child.edge):  # split the edge at k
                mid: _Node[V] = _Node(child.edge[:k])
                child.edge = child.edge[k:]
                mid.children[child.edge[0]] = child
                node.children[key[i]] = mid
                child = mid
            node, i = child, i + k
        if not node.has_value:
            self._len += 1
        node.has_value, node.value = True, value

    def get(self, key: Sequence[int]) -> V | None:
        """The value stored under exactly ``key``, or None."""
        path = self._path(key)
        return path[-1].value if path is not None and path[-1].has_value else None

    def longest_prefix(self, key: Sequence[int]) -> tuple[int, V | None]:
        """``(length, value)`` of the longest stored key that is a prefix of ``key`` (``(0, None)``)."""
        best: tuple[int, V | None] = (0, None)
        node, i = self._root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None or _common(key, i, child.edge) < len(child.edge):
                break
            node, i = child, i + len(child.edge)
            if node.has_value:
                best = (i, node.value)
        return best

    def deepest_match(self, key: Sequence[int]) -> tuple[int, V | None]:
        """``(d, value)``: the most tokens ``d`` that ``key`` shares with any stored key, and a value
        stored under such a key (the shortest one); ``(0, None)`` when nothing shares a token."""
        node, i = self._root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            k = _common(key, i, child.edge)
            node, i = child, i + k
            if k < len(child.edge):
                break
        if i == 0:
            return 0, None
        stack = [node]  # breadth-first: the shortest stored key below the divergence point
        while stack:
            nxt: list[_Node[V]] = []
            for n in stack:
                if n.has_value:
                    return i, n.value
                nxt.extend(n.children.values())
            stack = nxt
        return 0, None  # unreachable: every leaf holds a value

    def remove(self, key: Sequence[int]) -> bool:
        """Drop the value stored under ``key``; False when there was none."""
        path = self._path(key)
        if path is None or len(path) == 1 or not path[-1].has_value:
            return False
        node = path[-1]
        node.has_value, node.value = False, None
        self._len -= 1
        # Prune empty leaves and merge single-child pass-through nodes.
        while len(path) > 1:
            n, parent = path[-1], path[-2]
            if not n.has_value and not n.children:
                del parent.children[n.edge[0]]
            elif not n.has_value and len(n.children) == 1:
                (only,) = n.children.values()
                only.edge = n.edge + only.edge
                parent.children[n.edge[0]] = only
            else:
                break
            path.pop()
        return True

    def items(self) -> Iterator[tuple[tuple[int, ...], V]]:
        """Every stored ``(key, value)``, in no particular order."""
        stack: list[tuple[_Node[V], tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            key = prefix + node.edge
            if node.has_value:
                yield key, node.value  # type: ignore[misc]
            stack.extend((c, key) for c in node.children.values())

    def _path(self, key: Sequence[int]) -> list[_Node[V]] | None:
        """The nodes from the root down to the one whose edges spell exactly ``key``; None when
        no node ends there."""
        path, i = [self._root], 0
        while i < len(key):
            child = path[-1].children.get(key[i])
            if child is None or _common(key, i, child.edge) < len(child.edge):
                return None
            path.append(child)
            i += len(child.edge)
        return path
