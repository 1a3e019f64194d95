"""The server's radix tree against a brute-force model (pure Python, no model needed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lloyal.scheduling.radix import RadixTree

keys = st.lists(st.integers(0, 3), min_size=1, max_size=8).map(tuple)
ops = st.lists(st.tuples(st.sampled_from(["insert", "remove"]), keys), max_size=40)


def brute_longest(store: dict[tuple[int, ...], int], key: tuple[int, ...]) -> tuple[int, int | None]:
    best: tuple[int, int | None] = (0, None)
    for k, v in store.items():
        if key[: len(k)] == k and len(k) > best[0]:
            best = (len(k), v)
    return best


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(keys, min_size=1, max_size=10))
def test_matches_a_dict(script: list[tuple[str, tuple[int, ...]]], probes: list[tuple[int, ...]]) -> None:
    tree: RadixTree[int] = RadixTree()
    model: dict[tuple[int, ...], int] = {}
    for i, (op, key) in enumerate(script):
        if op == "insert":
            tree.insert(key, i)
            model[key] = i
        else:
            assert tree.remove(key) == (key in model)
            model.pop(key, None)
        assert len(tree) == len(model)
    assert dict(tree.items()) == model
    for p in probes + list(model):
        assert tree.longest_prefix(p) == brute_longest(model, p)
        assert tree.get(p) == model.get(p)
        d, v = tree.deepest_match(p)
        shared = [(_lcp(k, p), k) for k in model]
        assert d == max([n for n, _ in shared], default=0)
        if d:
            assert v is not None and any(model[k] == v and n == d for n, k in shared)


def test_edges_hold_runs_of_tokens() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert(list(range(2000)), "long")
    tree.insert([*range(1000), 7], "branch")
    assert tree.longest_prefix([*range(2000), 5]) == (2000, "long")
    assert tree.longest_prefix([*range(1000), 7, 7]) == (1001, "branch")
    assert tree.longest_prefix(list(range(999))) == (0, None)
    root = tree._root
    assert len(root.children) == 1 and len(next(iter(root.children.values())).edge) == 1000  # one split
