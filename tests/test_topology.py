"""Branch trees: RESTRICT prune, CASCADE prune_subtree, idempotence, stale handles, lease and
KV-cell accounting (docs/api.md, "Branch" and "BranchStore")."""

from __future__ import annotations

import pytest

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

GREEDY = SamplingParams(temperature=0)
PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture
def ctx(make_context):
    return make_context(n_ctx=512, n_seq_max=6)


def step(b: Branch, n: int = 1) -> None:
    for _ in range(n):
        b.commit(b.produce().token)


@pytest.fixture
def tree(ctx):
    """root -> a -> b, root -> c; each node wrote cells of its own after forking."""
    store = BranchStore(ctx)
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize(PROMPT))
    a = root.fork()
    step(a, 2)
    b = a.fork()
    step(b, 3)
    c = root.fork()
    step(c, 1)
    step(root, 1)
    return store, root, a, b, c


def test_tree_shape(tree, ctx):
    store, root, a, b, c = tree
    n_prompt = len(ctx.tokenize(PROMPT))
    assert root.parent is None
    assert a.parent == root and c.parent == root and b.parent == a
    assert b.parent.parent == root
    assert root.children == [a, c]
    assert a.children == [b]
    assert b.children == [] and c.children == []
    assert [x.is_leaf for x in (root, a, b, c)] == [False, False, True, True]
    assert (a.fork_head, b.fork_head, c.fork_head) == (n_prompt, n_prompt + 2, n_prompt)
    assert (root.position, a.position, b.position, c.position) == (
        n_prompt + 1,
        n_prompt + 2,
        n_prompt + 5,
        n_prompt + 1,
    )
    # shared prefix once + each branch's own cells: 1 (root) + 2 (a) + 3 (b) + 1 (c)
    assert store.kv_pressure.cells_used == n_prompt + 7
    assert store.available == ctx.n_seq_max - 4
    assert len({x.seq_id for x in (root, a, b, c)}) == 4


def test_restrict_prune_names_the_children(tree, ctx):
    store, root, a, b, c = tree
    pressure = store.kv_pressure
    with pytest.raises(lloyal.TopologyError) as ei:
        root.prune()
    msg = str(ei.value)
    assert str(a.handle) in msg and str(c.handle) in msg
    assert str(b.handle) not in msg  # only live children are named
    assert "prune_subtree" in msg
    with pytest.raises(lloyal.TopologyError, match=str(b.handle)):
        a.prune()
    # nothing changed
    assert all(x.is_active for x in (root, a, b, c))
    assert root.children == [a, c]
    assert store.kv_pressure == pressure
    assert store.available == ctx.n_seq_max - 4


def test_leaf_prune_removes_only_its_own_cells(tree, ctx):
    store, root, a, b, c = tree
    used = store.kv_pressure.cells_used
    b_seq = b.seq_id
    before = {x: (x.position, ctx.kv_seq_pos_max(x.seq_id)) for x in (root, a, c)}
    b.prune()
    assert b.disposed
    assert a.children == [] and a.is_leaf
    assert store.kv_pressure.cells_used == used - 3
    assert store.available == ctx.n_seq_max - 3
    assert ctx.kv_seq_pos_max(b_seq) == -1
    # the shared prefix and every other branch's cells stay
    for x, (pos, pos_max) in before.items():
        assert x.position == pos
        assert ctx.kv_seq_pos_max(x.seq_id) == pos_max == pos - 1
    # and the parent still decodes
    step(a, 1)
    assert store.kv_pressure.cells_used == used - 2
    # now a is a leaf: RESTRICT allows it
    a.prune()
    assert root.children == [c]


def test_cascade_prune_subtree_disposes_everything(tree, ctx):
    store, root, a, b, c = tree
    seqs = [x.seq_id for x in (root, a, b, c)]
    root.prune_subtree()
    assert all(x.disposed for x in (root, a, b, c))
    assert store.available == ctx.n_seq_max
    assert store.kv_pressure.cells_used == 0
    assert all(ctx.kv_seq_pos_max(s) == -1 for s in seqs)
    for x in (root, a, b, c):
        with pytest.raises(lloyal.BranchDisposedError):
            x.produce()
    # idempotent
    root.prune_subtree()
    root.prune()
    b.prune()
    b.prune_subtree()
    assert store.available == ctx.n_seq_max


def test_prune_subtree_of_middle_node(tree, ctx):
    store, root, a, b, c = tree
    n_prompt = len(ctx.tokenize(PROMPT))
    a.prune_subtree()
    assert a.disposed and b.disposed
    assert root.is_active and c.is_active
    assert root.children == [c]
    assert store.kv_pressure.cells_used == n_prompt + 2  # root's 1 + c's 1
    assert store.available == ctx.n_seq_max - 2
    assert ctx.kv_seq_pos_max(root.seq_id) == root.position - 1
    assert ctx.kv_seq_pos_max(c.seq_id) == c.position - 1
    # prune idempotent on the disposed middle node, and RESTRICT still guards root
    a.prune()
    with pytest.raises(lloyal.TopologyError):
        root.prune()
    c.prune()
    root.prune()
    root.prune()
    assert store.available == ctx.n_seq_max
    assert store.kv_pressure.cells_used == 0


def test_children_order_after_prune_and_new_fork(ctx):
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize(PROMPT))
    c1, c2, c3 = root.fork(), root.fork(), root.fork()
    assert root.children == [c1, c2, c3]
    c2.prune()
    assert root.children == [c1, c3]
    c4 = root.fork()
    assert root.children == [c1, c3, c4]
    g = c3.fork()
    assert root.children == [c1, c3, c4]
    assert c3.children == [g] and not c3.is_leaf


def test_stale_handle_rejected_after_lease_and_slot_reuse(model):
    """With n_seq_max=2, a new fork must reuse the pruned branch's sequence; the old Python
    object must keep failing and must not reach the new branch."""
    ctx = lloyal.Context(model, n_ctx=256, n_seq_max=2)
    try:
        store = BranchStore(ctx)
        root = Branch.create(ctx, 0, GREEDY)
        root.prefill(ctx.tokenize(PROMPT))
        old = root.fork()
        step(old, 2)
        old_seq, old_handle = old.seq_id, old.handle
        old.prune()
        assert store.available == 1
        new = root.fork()
        assert store.available == 0
        assert new.seq_id == old_seq  # the only free lease
        assert new.handle != old_handle
        assert new != old
        assert new.position == root.position  # not the old branch's position
        with pytest.raises(lloyal.BranchDisposedError):
            _ = old.position
        with pytest.raises(lloyal.BranchDisposedError):
            old.commit(5)
        with pytest.raises(lloyal.BranchDisposedError):
            BranchStore(ctx).commit([(old, 5)])
        # stale prunes are no-ops that do not touch the new tenant
        old.prune()
        old.prune_subtree()
        with old:
            pass
        assert new.is_active
        assert root.children == [new]
        step(new, 1)
        assert new.position == root.position + 1
    finally:
        ctx.close()


def test_handles_never_reused_across_many_forks(ctx):
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill([2, 100, 200])
    seen = {root.handle}
    for _ in range(20):
        child = root.fork()
        assert child.handle not in seen
        seen.add(child.handle)
        child.prune()
    assert BranchStore(ctx).available == ctx.n_seq_max - 1


def test_retain_only_on_a_tree(tree, ctx):
    store, root, a, b, c = tree
    b_pos = b.position
    store.retain_only(b)
    assert b.parent is None and b.children == [] and b.is_active
    assert all(x.disposed for x in (root, a, c))
    assert store.available == ctx.n_seq_max - 1
    # the winner keeps the whole history it saw: shared prefix + a's cells + its own
    assert store.kv_pressure.cells_used == b_pos
    assert ctx.kv_seq_pos_max(b.seq_id) == b_pos - 1
    with pytest.raises(lloyal.BranchDisposedError):
        _ = a.children
    # prunes of the disposed nodes are no-ops; b is now a root that can be pruned
    root.prune_subtree()
    a.prune()
    assert b.is_active
    b.prune()
    assert store.available == ctx.n_seq_max and store.kv_pressure.cells_used == 0


def test_retain_only_of_a_node_with_children(tree, ctx):
    store, root, a, b, c = tree
    b_seq = b.seq_id
    store.retain_only(a)
    assert a.parent is None and a.children == [] and a.is_leaf
    assert b.disposed and root.disposed and c.disposed
    assert ctx.kv_seq_pos_max(b_seq) == -1
    assert store.kv_pressure.cells_used == a.position
    assert store.available == ctx.n_seq_max - 1
    step(a, 1)
    assert store.kv_pressure.cells_used == a.position
