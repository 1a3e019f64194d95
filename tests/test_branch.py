"""Branch: create/fork/produce/commit, sampler cloning, steering vs logit bias, disposal,
identity, flat-path protection (docs/api.md, "Branch" and "Errors"). Real default model, small contexts."""

from __future__ import annotations

import asyncio
import contextlib
import math

import numpy as np
import pytest
from helpers import context_fixture, prefilled, produce_commit

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

GREEDY = SamplingParams(temperature=0)
PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox"


ctx = context_fixture(n_ctx=512, n_seq_max=4)


@pytest.fixture
def root(ctx):
    return prefilled(ctx, PROMPT)


def greedy(branch: Branch, n: int) -> list[int]:
    return produce_commit(branch, n, forbid_stop=True)


# --------------------------------------------------------------------------- create / prefill


def test_create_initial_state(ctx):
    store = BranchStore(ctx)
    b = Branch.create(ctx, 0, GREEDY)
    assert b.position == 0 and b.fork_head == 0
    assert math.isinf(b.perplexity) and b.perplexity > 0
    assert math.isinf(b.sampling_perplexity)
    assert b.parent is None and b.children == [] and b.is_leaf
    assert b.is_active and not b.disposed
    assert 0 <= b.seq_id < ctx.n_seq_max
    assert b.context is ctx
    assert store.available == ctx.n_seq_max - 1
    assert store.kv_pressure.cells_used == 0
    assert ctx.kv_seq_pos_max(b.seq_id) == -1

    at5 = Branch.create(ctx, 5)
    assert at5.position == 5 and at5.fork_head == 5
    assert at5.seq_id != b.seq_id
    with pytest.raises(ValueError):
        Branch.create(ctx, -1)
    assert store.available == ctx.n_seq_max - 2


def test_prefill_writes_kv_but_accepts_nothing(ctx):
    store = BranchStore(ctx)
    b = Branch.create(ctx, 0, GREEDY)
    toks = ctx.tokenize(PROMPT)
    b.prefill(toks[:5])
    b.prefill(toks[5:])
    assert b.position == len(toks)
    assert ctx.kv_seq_pos_max(b.seq_id) == len(toks) - 1
    assert store.kv_pressure.cells_used == len(toks)
    assert math.isinf(b.perplexity)
    logits = b.logits
    assert logits.shape == (ctx.n_vocab,) and logits.dtype == np.float32
    # logits is a copy: mutating it changes nothing
    logits[:] = 0
    assert np.max(b.logits) > 0
    # the flat path on another seq gives the same next-token distribution
    ctx.decode(toks, 0, seq_id=3)
    assert int(np.argmax(ctx.get_logits())) == int(np.argmax(b.logits))


def test_perplexity_inf_before_commit_and_bounded_after(root):
    assert math.isinf(root.perplexity)
    surprisals = []
    for _ in range(10):
        tok = root.produce().token
        surprisals.append(root.model_surprisal(tok))
        root.commit(tok)
    ppl = root.perplexity
    assert 1.0 <= ppl < 1000.0
    assert ppl == pytest.approx(math.exp(sum(surprisals) / len(surprisals)), rel=1e-5)
    # greedy at temperature 0 with no penalties: sampling perplexity is the model's
    assert root.sampling_perplexity == pytest.approx(ppl, rel=1e-5)


def test_accept_records_metrics_without_decoding(ctx, root):
    store = BranchStore(ctx)
    pos, cells = root.position, store.kv_pressure.cells_used
    logits = root.logits
    tok = root.produce().token
    s = root.model_surprisal(tok)
    root.accept(tok)
    assert root.position == pos
    assert store.kv_pressure.cells_used == cells
    assert np.array_equal(root.logits, logits)
    assert root.perplexity == pytest.approx(math.exp(s), rel=1e-6)
    with pytest.raises(lloyal.InvalidTokenError):
        root.accept(ctx.n_vocab)


# --------------------------------------------------------------------------- produce


def test_produce_is_idempotent_and_writes_nothing_greedy(ctx, root):
    store = BranchStore(ctx)
    pos, cells = root.position, store.kv_pressure.cells_used
    logits = root.logits
    p1, p2 = root.produce(), root.produce()
    assert p1 == p2 and p1.token == p2.token
    assert p1.token == int(np.argmax(logits))
    assert root.sample() == p1.token
    assert p1.text == ctx.token_to_text(p1.token)
    assert p1.is_stop is False
    assert root.position == pos
    assert store.kv_pressure.cells_used == cells
    assert np.array_equal(root.logits, logits)
    assert math.isinf(root.perplexity)


def test_produce_is_idempotent_with_temperature_and_seed(ctx):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    root = Branch.create(ctx, 0, params)
    root.prefill(ctx.tokenize("Once upon a time"))
    pos = root.position
    first = root.produce()
    for _ in range(5):
        assert root.produce() == first
        assert root.sample() == first.token
    assert root.position == pos

    # produce() does not consume randomness: a twin that produced once follows the same
    # stream as one that produced many times.
    twin = root.fork()
    assert twin.produce() == first
    many, once = [], []
    for _ in range(6):
        for _ in range(3):
            t = root.produce().token
        root.commit(t)
        many.append(t)
        t = twin.produce().token
        twin.commit(t)
        once.append(t)
    assert many == once
    assert root.position == twin.position == pos + 6


def test_reseed_sampler_changes_stream_deterministically(ctx):
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    root = Branch.create(ctx, 0, params)
    root.prefill(ctx.tokenize("Once upon a time"))
    a, b = root.fork(), root.fork()
    draws = {}
    for br, seed in ((a, 11), (b, 11)):
        br.reseed_sampler(seed)
        draws[br] = []
        for _ in range(4):
            t = br.produce().token
            br.commit(t)
            draws[br].append(t)
    assert draws[a] == draws[b]


# --------------------------------------------------------------------------- fork


def test_a_start_position_beyond_reach_is_refused(ctx: lloyal.Context) -> None:
    """Positions grow a cell a token: a start near i32's end would wrap round (a 2**40 start
    was clamped to 2**31 - 1, and one token later was negative, its cell stranded)."""
    for position in (2**40, 2**31 - 1, (1 << 30) + 1, -1):
        with pytest.raises(ValueError, match=r"position must be in \[0, 1073741824\]"):
            Branch.create(ctx, position)
    assert BranchStore(ctx).available == 4
    with Branch.create(ctx, 1 << 30, SamplingParams(temperature=0)) as far:
        far.prefill(ctx.tokenize("Hi"))
        assert far.position == (1 << 30) + len(ctx.tokenize("Hi"))


def test_fork_costs_no_cells_and_starts_at_parent_position(ctx, root):
    store = BranchStore(ctx)
    before = store.kv_pressure
    avail = store.available
    child = root.fork()
    assert store.kv_pressure == before
    assert store.available == avail - 1
    assert child.position == root.position
    assert child.fork_head == root.position
    assert child.seq_id != root.seq_id
    # the child sees the parent's prefix (shared cells, no copy)
    assert ctx.kv_seq_pos_max(child.seq_id) == root.position - 1
    assert np.array_equal(child.logits, root.logits)
    assert child.produce().token == root.produce().token
    assert child.parent == root and root.children == [child]
    assert math.isinf(child.perplexity)

    # each commit costs exactly one cell, on the committing branch only
    child.commit(child.produce().token)
    assert store.kv_pressure.cells_used == before.cells_used + 1
    assert child.position == root.position + 1
    assert ctx.kv_seq_pos_max(root.seq_id) == root.position - 1
    root.commit(root.produce().token)
    assert store.kv_pressure.cells_used == before.cells_used + 2
    assert child.position == root.position


def test_fork_clones_metrics_and_sampler_history(ctx, root):
    greedy(root, 3)
    ppl = root.perplexity
    child = root.fork()
    assert child.perplexity == ppl
    assert child.sampling_perplexity == root.sampling_perplexity
    # same next tokens as the parent from here on
    assert greedy(child, 3) == greedy(root, 3)
    assert child.perplexity == pytest.approx(root.perplexity, rel=1e-9)


def test_fork_clones_seeded_rng(ctx):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=99)
    root = Branch.create(ctx, 0, params)
    root.prefill(ctx.tokenize("My favourite animal is the"))
    pending = root.produce().token  # a produced-but-not-committed token is not inherited...
    child = root.fork()
    # ...but the RNG state is: the child draws the same token from the same logits
    assert child.produce().token == pending == root.produce().token
    both = [root.produce().token, child.produce().token]
    root.commit(both[0])
    child.commit(both[1])
    assert root.produce().token == child.produce().token


def test_forked_logits_stay_with_each_branch_after_either_decodes(ctx, root):
    """A fork shares the parent's logits snapshot until one of them decodes; each decode then
    gives only that branch new logits, and later decodes (which reuse the old buffer once no
    fork shares it) never write into another branch's snapshot."""
    snapshot = root.logits.copy()
    child = root.fork()
    first = int(np.argmax(snapshot))
    root.commit(first)
    assert np.array_equal(child.logits, snapshot)
    assert not np.array_equal(root.logits, snapshot)
    after_first = root.logits.copy()
    child.commit(first)  # same token at the same position: the same logits (batch-invariant)
    assert np.array_equal(child.logits, after_first)
    assert np.array_equal(root.logits, after_first)
    second = int(np.argsort(after_first)[-2])  # the children diverge from here
    root.commit(int(np.argmax(after_first)))
    root_logits = root.logits.copy()
    child.commit(second)
    assert np.array_equal(root.logits, root_logits)
    assert not np.array_equal(child.logits, root_logits)
    child_logits = child.logits.copy()
    root.commit(root.produce().token)
    assert np.array_equal(child.logits, child_logits)


def test_fork_without_logits(ctx, root):
    child = root.fork(clone_logits=False)
    assert child.position == root.position
    with pytest.raises(lloyal.LloyalError):
        child.produce()
    # writing a token gives it logits of its own
    child.commit(root.produce().token)
    assert child.logits.shape == (ctx.n_vocab,)


# --------------------------------------------------------------------------- steer / bias


def test_steer_not_inherited_logit_bias_inherited(ctx, root):
    logits = root.logits
    order = np.argsort(logits)[::-1]
    g, second = int(order[0]), int(order[1])
    assert root.produce().token == g

    root.steer({second: 100.0})
    assert root.produce().token == second
    steered_child = root.fork()
    assert steered_child.produce().token == g, "steer must not be inherited"
    root.clear_steer()
    assert root.produce().token == g

    root.set_logit_bias({g: float("-inf")})
    assert root.produce().token != g
    banned_child = root.fork()
    assert banned_child.produce().token == root.produce().token != g
    # the ban holds on later steps too
    for _ in range(3):
        t = banned_child.produce().token
        assert t != g
        banned_child.commit(t)
    # an earlier fork is unaffected
    assert steered_child.produce().token == g
    root.set_logit_bias({})
    assert root.produce().token == g


def test_bias_validation(ctx, root):
    with pytest.raises(lloyal.InvalidTokenError):
        root.set_logit_bias({ctx.n_vocab: 1.0})
    with pytest.raises(lloyal.InvalidTokenError):
        root.steer({-3: 1.0})
    with pytest.raises(ValueError):
        root.set_logit_bias({5: float("nan")})
    with pytest.raises(ValueError):
        root.steer({5: float("inf")})


def test_a_bias_of_most_of_the_vocabulary_samples_among_the_rest(ctx, root):
    """A ban of all but a few tokens (a map as long as the vocabulary, which a search per entry
    made take seconds a sample) leaves the best allowed token; one that bans every token, with
    steering's bans counted, is refused with the bias unchanged (it sampled a banned token 0)."""
    logits = np.array(root.logits)
    allowed = [int(t) for t in np.argsort(logits)[:3]]  # the three worst tokens
    ban = {t: float("-inf") for t in range(ctx.n_vocab) if t not in allowed}
    root.set_logit_bias(ban)
    assert root.produce().token == max(allowed, key=lambda t: logits[t])
    sampled = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.8, top_k=40, seed=3))
    sampled.prefill([2, 651])
    sampled.set_logit_bias(ban)
    assert all(sampled.produce().token in allowed for _ in range(3))
    root.steer({t: float("-inf") for t in allowed[:2]})
    with pytest.raises(ValueError, match="bans every token of the vocabulary"):
        root.steer({t: float("-inf") for t in allowed})
    with pytest.raises(ValueError, match="bans every token of the vocabulary"):
        sampled.set_logit_bias({t: float("-inf") for t in range(ctx.n_vocab)})
    assert root.produce().token == allowed[2]  # the bias and steering before stay


# --------------------------------------------------------------------------- invalid tokens


def snapshot(b: Branch) -> tuple:
    return (b.position, b.perplexity, b.sampling_perplexity, b.logits, b.produce().token)


def assert_same(b: Branch, snap: tuple) -> None:
    pos, ppl, sppl, logits, tok = snap
    assert b.position == pos
    assert (math.isinf(b.perplexity) and math.isinf(ppl)) or b.perplexity == ppl
    assert (math.isinf(b.sampling_perplexity) and math.isinf(sppl)) or b.sampling_perplexity == sppl
    assert np.array_equal(b.logits, logits)
    assert b.produce().token == tok


def test_commit_out_of_range_token_changes_nothing(ctx, root):
    store = BranchStore(ctx)
    greedy(root, 1)
    snap = snapshot(root)
    pressure = store.kv_pressure
    for bad in (ctx.n_vocab, ctx.n_vocab + 1000, -1):
        with pytest.raises(lloyal.InvalidTokenError) as ei:
            root.commit(bad)
        assert isinstance(ei.value, ValueError)
        assert str(bad) in str(ei.value)
    with pytest.raises(lloyal.InvalidTokenError):
        root.prefill([10, 20, ctx.n_vocab])
    with pytest.raises(lloyal.InvalidTokenError):
        root.model_surprisal(ctx.n_vocab)
    assert_same(root, snap)
    assert store.kv_pressure == pressure
    assert ctx.kv_seq_pos_max(root.seq_id) == root.position - 1


@pytest.mark.parametrize("big", [2**31, 2**64, -(2**70)])  # past 64 bits: was a bare OverflowError
@pytest.mark.parametrize(
    "call",
    [
        "commit",
        "prefill",
        "accept",
        "store.commit",
        "store.prefill",
        "verify",
        "score",
        "set_logit_bias",
        "model_surprisal",
        "generate",
    ],
)
def test_huge_token_ids_raise_invalid_token_error(ctx, root, call, big):
    store = BranchStore(ctx)
    fn = {
        "commit": lambda: root.commit(big),
        "prefill": lambda: root.prefill([1, big]),
        "accept": lambda: root.accept(big),
        "store.commit": lambda: store.commit([(root, big)]),
        "store.prefill": lambda: store.prefill([(root, [1, big])]),
        "verify": lambda: root.verify([big]),
        "score": lambda: root.score([1, big]),
        "set_logit_bias": lambda: root.set_logit_bias({big: 1.0}),
        "model_surprisal": lambda: root.model_surprisal(big),
        "generate": lambda: list(root.generate(1, prompt=[big])),
    }[call]
    snap = snapshot(root)
    with pytest.raises(lloyal.InvalidTokenError):
        fn()
    assert_same(root, snap)


def test_empty_prefill_is_noop(ctx, root):
    store = BranchStore(ctx)
    snap = snapshot(root)
    pressure = store.kv_pressure
    root.prefill([])
    store.prefill([(root, [])])
    store.commit([])
    assert_same(root, snap)
    assert store.kv_pressure == pressure


# --------------------------------------------------------------------------- identity


def test_equality_hash_and_children_order(ctx, root):
    a, b, c = root.fork(), root.fork(), root.fork()
    assert a.parent == root
    assert hash(a.parent) == hash(root)
    assert a.parent is not root  # a new Python object, equal by handle
    assert {root, a.parent, b.parent, a, b, c, a} == {root, a, b, c}
    assert root.children == [a, b, c]
    assert root.children[1] == b and root.children[1] != c
    assert root != a and a != b
    assert root != object() and root != root.handle
    assert not root.is_leaf and a.is_leaf
    seqs = [x.seq_id for x in (root, a, b, c)]
    assert len(set(seqs)) == 4
    handles = [x.handle for x in (root, a, b, c)]
    assert len(set(handles)) == 4
    d = {root: "root", a: "a"}
    assert d[a.parent] == "root"
    assert d[root.children[0]] == "a"
    assert "Branch(" in repr(root)


def test_branches_of_different_contexts_are_not_equal(model):
    c1 = lloyal.Context(model, n_ctx=256)
    c2 = lloyal.Context(model, n_ctx=256)
    try:
        b1, b2 = Branch.create(c1), Branch.create(c2)
        assert b1 != b2
        assert len({b1, b2}) == 2
    finally:
        c1.close()
        c2.close()


# --------------------------------------------------------------------------- flat path


def test_flat_path_cannot_touch_a_leased_sequence(ctx, root):
    seq = root.seq_id
    pos = root.position
    free = next(s for s in range(ctx.n_seq_max) if s != seq)
    with pytest.raises(lloyal.SeqLeasedError) as ei:
        ctx.decode([100, 200], pos, seq_id=seq)
    assert str(seq) in str(ei.value)
    with pytest.raises(lloyal.SeqLeasedError):
        ctx.kv_cache_remove(seq, 0)
    with pytest.raises(lloyal.SeqLeasedError):
        ctx.kv_seq_keep(seq)
    with pytest.raises(lloyal.SeqLeasedError):
        ctx.kv_seq_copy(free, seq)
    with pytest.raises(lloyal.SeqLeasedError):
        ctx.kv_cache_clear()
    assert root.position == pos
    assert ctx.kv_seq_pos_max(seq) == pos - 1
    assert ctx.kv_cache_size(seq) == pos - 1  # reading is allowed
    # once the branch is gone the sequence belongs to the flat path again
    root.prune()
    assert ctx.kv_seq_pos_max(seq) == -1
    ctx.decode([2, 100, 200], 0, seq_id=seq)
    assert ctx.kv_seq_pos_max(seq) == 2
    ctx.kv_cache_remove(seq, 0)
    assert ctx.kv_seq_pos_max(seq) == -1


def test_create_takes_an_empty_sequence(ctx):
    """Cells the flat path left on a sequence are never wiped by a lease: that id is skipped."""
    ctx.decode([2, 100, 200], 0, seq_id=0)
    b = Branch.create(ctx, 0, GREEDY)
    assert b.seq_id == 1
    assert (ctx.kv_seq_pos_max(0), ctx.kv_seq_pos_max(1)) == (2, -1)
    b.prefill([2, 300])
    assert (ctx.kv_seq_pos_max(0), ctx.kv_seq_pos_max(1)) == (2, 1)


# --------------------------------------------------------------------------- disposal


def _disposed_calls(b: Branch, ctx, token: int):
    logits = np.zeros(ctx.n_vocab, dtype=np.float32)
    return {
        "produce": lambda: b.produce(),
        "sample": lambda: b.sample(),
        "commit": lambda: b.commit(token),
        "prefill": lambda: b.prefill([token]),
        "fork": lambda: b.fork(),
        "accept": lambda: b.accept(token),
        "reseed_sampler": lambda: b.reseed_sampler(1),
        "set_sampler_params": lambda: b.set_sampler_params(GREEDY),
        "set_logit_bias": lambda: b.set_logit_bias({token: -1.0}),
        "set_sampling": lambda: b.set_sampling(GREEDY),
        "steer": lambda: b.steer({token: 1.0}),
        "clear_steer": lambda: b.clear_steer(),
        "logits": lambda: b.logits,
        "set_logits": lambda: b.set_logits(logits),
        "model_entropy": lambda: b.model_entropy(),
        "model_surprisal": lambda: b.model_surprisal(token),
        "position": lambda: b.position,
        "fork_head": lambda: b.fork_head,
        "perplexity": lambda: b.perplexity,
        "sampling_perplexity": lambda: b.sampling_perplexity,
        "parent": lambda: b.parent,
        "children": lambda: b.children,
        "is_leaf": lambda: b.is_leaf,
        "seq_id": lambda: b.seq_id,
        "next(iter)": lambda: next(iter(b)),
        "next(generate)": lambda: next(b.generate(3)),
        "aprefill": lambda: asyncio.run(b.aprefill([token])),
        "acommit": lambda: asyncio.run(b.acommit(token)),
    }


def test_disposed_branch_rejects_every_call(ctx, root):
    store = BranchStore(ctx)
    child = root.fork()
    token = child.produce().token
    handle = child.handle
    child.prune()
    assert child.disposed is True
    assert child.is_active is False
    assert child.handle == handle
    assert root.children == []
    for name, call in _disposed_calls(child, ctx, token).items():
        with pytest.raises(lloyal.BranchDisposedError):
            call()
            pytest.fail(f"{name} did not raise")
    for name, call in {
        "store.commit": lambda: store.commit([(child, token)]),
        "store.prefill": lambda: store.prefill([(child, [token])]),
        "store.produce_all": lambda: store.produce_all([root, child]),
        "store.retain_only": lambda: store.retain_only(child),
    }.items():
        with pytest.raises(lloyal.BranchDisposedError):
            call()
            pytest.fail(f"{name} did not raise")
    # idempotent prunes are no-ops; the live branch is untouched
    child.prune()
    child.prune_subtree()
    with child:
        pass
    assert root.is_active
    assert store.available == ctx.n_seq_max - 1


def test_disposed_error_message_names_handle(root):
    child = root.fork()
    child.prune()
    with pytest.raises(lloyal.BranchDisposedError, match=str(child.handle)):
        _ = child.position


def test_context_close_disposes_branches(model):
    ctx = lloyal.Context(model, n_ctx=256, n_seq_max=2)
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill([2, 100])
    child = root.fork()
    with root:
        ctx.close()
    assert root.disposed and child.disposed
    assert not root.is_active
    with pytest.raises((lloyal.ContextClosedError, lloyal.BranchDisposedError)):
        _ = root.position
    with pytest.raises((lloyal.ContextClosedError, lloyal.BranchDisposedError)):
        child.produce()
    # prune after close: a no-op or ContextClosedError (both allowed by the contract)
    for call in (root.prune, child.prune_subtree):
        with contextlib.suppress(lloyal.ContextClosedError):
            call()


# --------------------------------------------------------------------------- context manager


def test_branch_context_manager_prunes_subtree(ctx, root):
    store = BranchStore(ctx)
    avail = store.available
    cells = store.kv_pressure.cells_used
    with root.fork() as child:
        assert child.is_active
        grand = child.fork()
        grand.commit(grand.produce().token)
        child.commit(child.produce().token)
        assert store.available == avail - 2
        assert store.kv_pressure.cells_used == cells + 2
    assert child.disposed and grand.disposed
    assert root.is_active and root.children == []
    assert store.available == avail
    assert store.kv_pressure.cells_used == cells

    with pytest.raises(RuntimeError, match="boom"), root.fork() as failing:
        raise RuntimeError("boom")
    assert failing.disposed
    assert store.available == avail


def test_set_logits_and_metrics(ctx, root):
    logits = np.full(ctx.n_vocab, -30.0, dtype=np.float32)
    logits[123] = 10.0  # any id of any vocabulary
    root.set_logits(logits)
    assert np.array_equal(root.logits, logits)
    assert root.produce().token == 123
    assert root.model_surprisal(123) == pytest.approx(0.0, abs=1e-3)
    assert root.model_entropy() == pytest.approx(0.0, abs=1e-2)
    assert root.model_entropy("bits") >= 0.0
    with pytest.raises(ValueError):
        root.set_logits(np.zeros(10, dtype=np.float32))
    with pytest.raises(ValueError, match="every value of logits is -inf"):  # produce() would give token 0
        root.set_logits(np.full(ctx.n_vocab, -np.inf, dtype=np.float32))
    assert root.produce().token == 123
    wide = np.full(ctx.n_vocab, -30.0)  # float64, numpy's default
    wide[7] = 10.0
    root.set_logits(wide)
    assert root.produce().token == 7 and root.logits.dtype == np.float32


def test_negative_counts_are_value_errors_naming_the_argument(ctx, root):
    """Not pyo3's bare OverflowError ("can't convert negative int to unsigned")."""
    for kwargs, name in (
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"top_logprobs": -2}, "top_logprobs"),
        ({"lookahead": 0}, "lookahead"),
    ):
        with pytest.raises(ValueError, match=name):
            root.generate(**kwargs)
    with pytest.raises(ValueError, match=r"top_logprobs must be in 0\.\.=20, got -1"):
        root.score(ctx.tokenize("Hi"), -1)
    for seed in (-1, 2**32, 2**70):  # past 64 bits too
        with pytest.raises(ValueError, match=rf"seed must be in 0\.\.=4294967295, got {seed}"):
            root.reseed_sampler(seed)
    with pytest.raises(ValueError, match="sampling parameter seed = 18446744073709551616 is out of range"):
        Branch.create(ctx, 0, SamplingParams(seed=2**64))
    with pytest.raises(ValueError, match="n_gpu_layers must be >= 0"):
        lloyal.Model(ctx.model.path, n_gpu_layers=-5)
    assert root.position == BranchStore(ctx).kv_pressure.cells_used == len(ctx.tokenize(PROMPT))


def test_set_sampler_params_overrides_keep_the_other_fields(ctx):
    """Keyword overrides alone change only those fields: with top_k=1 kept, a hot temperature
    still picks the argmax; a whole SamplingParams replaces every field (top_k back to 40)."""
    b = Branch.create(ctx, 0, SamplingParams(temperature=0.0, top_k=1, seed=3))
    b.prefill(ctx.tokenize("The weather today is"))
    best = int(np.argmax(b.logits))
    b.set_sampler_params(temperature=5.0, min_p=0.0, top_p=1.0)
    picks = set()
    for seed in range(12):
        b.reseed_sampler(seed)
        picks.add(b.produce().token)
    assert picks == {best}
    b.set_sampler_params(SamplingParams(temperature=5.0, min_p=0.0, top_p=1.0))
    hot = set()
    for seed in range(12):
        b.reseed_sampler(seed)
        hot.add(b.produce().token)
    assert len(hot) > 1, "a full SamplingParams resets top_k to its default (40)"


def test_set_sampling_replaces_params_seed_bias_and_grammar_at_once_or_not_at_all(ctx):
    b = Branch.create(ctx, 0, SamplingParams(temperature=0.0))
    b.prefill(ctx.tokenize("The weather today is"))
    best = int(np.argmax(b.logits))
    b.set_logit_bias({best: float("-inf")})
    b.set_grammar('root ::= "x"')
    # one call replaces all of it (no bias, no grammar, hot sampling with a seed) and equals
    # the four setters one by one
    hot = SamplingParams(temperature=5.0, top_k=0, top_p=1.0, min_p=0.0)
    x, y, z = b.fork(), b.fork(), b.fork()
    x.set_sampling(hot, seed=11)
    y.set_sampler_params(hot)
    y.reseed_sampler(11)
    y.set_logit_bias({})
    y.set_grammar(None)
    z.set_sampling(hot, seed=12)

    def run(br: Branch) -> list[int]:
        out = []
        for _ in range(8):
            t = br.produce().token
            br.commit(t)
            out.append(t)
        return out

    xs = run(x)
    assert xs == run(y) != run(z)
    assert best in xs or len(set(xs)) > 1  # the ban and the one-token grammar are gone
    b.set_sampling(SamplingParams(temperature=0.0))
    assert b.produce().token == best, "the bias was cleared (None: no bias) and greedy is back"
    b.set_sampling(SamplingParams(temperature=0.0), logit_bias={best: float("-inf")})
    banned = b.produce().token
    assert banned != best
    # a bad part refuses the whole call: the ban and greedy stay
    with pytest.raises(lloyal.InvalidTokenError):
        b.set_sampling(hot, logit_bias={ctx.n_vocab: 1.0})
    with pytest.raises(lloyal.GrammarError):
        b.set_sampling(hot, grammar="root ::= (")
    with pytest.raises(ValueError):
        b.set_sampling(hot, seed=-1)
    # a bias value that is not a number is refused before the grammar and params are put in
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be finite or -inf"):
            b.set_sampling(hot, logit_bias={5: bad}, grammar='root ::= "xyz"')
    assert b.produce().token == banned
    b.set_sampling(SamplingParams(temperature=0.0), grammar='root ::= "Hello"')
    assert "Hello".startswith(ctx.token_to_text(b.produce().token))


def test_set_sampling_fresh_forgets_the_penalty_history_and_perplexity(ctx):
    """A fork of a branch that sampled, set up ``fresh``, samples as a new branch holding the
    same tokens (prefilled: no history, no perplexity) does; without ``fresh`` it keeps the
    parent's history, and its penalties see the parent's tokens."""
    strict = SamplingParams(temperature=0.0, repeat_penalty=3.0, penalty_last_n=64)
    parent = Branch.create(ctx, 0, strict)
    prompt = ctx.tokenize("One, two, one, two, one,")
    parent.prefill(prompt)
    said = ctx.tokenize(" two, one, two,", add_special=False)
    for t in said:
        parent.commit(t)  # its history: the tokens the model goes on with
    cold = Branch.create(ctx, 0, strict)
    cold.prefill(prompt + said)

    def run(br: Branch) -> list[int]:
        out = []
        for _ in range(6):
            out.append(br.produce().token)
            br.commit(out[-1])
        return out

    kept, fresh = parent.fork(), parent.fork()
    fresh.set_sampling(strict, fresh=True)
    kept.set_sampling(strict)
    assert fresh.perplexity == cold.perplexity and kept.perplexity == parent.perplexity
    want = run(cold)
    assert run(fresh) == want != run(kept)
    assert fresh.perplexity == cold.perplexity


def test_create_and_fork_skip_sequences_holding_flat_cells(make_context) -> None:
    ctx = make_context(n_ctx=512, n_seq_max=3)
    flat = ctx.tokenize("Flat path tokens")
    ctx.decode(flat, 0, seq_id=0)
    store = lloyal.BranchStore(ctx)
    with lloyal.Branch.create(ctx, 0) as b:
        assert b.seq_id == 1  # seq 0 holds flat cells: skipped, not wiped
        assert ctx.kv_seq_pos_max(0) == len(flat) - 1
        b.prefill(flat)
        child = b.fork()
        assert child.seq_id == 2
        flat_message = r"\(\[0\]\) hold flat-path cells.*kv_cache_remove"
        with pytest.raises(lloyal.LeaseExhaustedError, match=flat_message):
            b.fork()
        with pytest.raises(lloyal.LeaseExhaustedError, match="flat-path"):
            lloyal.Branch.create(ctx, 0)
        assert store.available == 1 and ctx.kv_seq_pos_max(0) == len(flat) - 1
        ctx.kv_cache_remove(0, 0)  # freed: leasable again
        with lloyal.Branch.create(ctx, 0) as c:
            assert c.seq_id == 0
    assert store.available == 3
