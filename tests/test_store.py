"""BranchStore: batched commit, packed prefill, leases, retain_only, KV pressure (docs/api.md, "BranchStore").

Runs on the real default model (Gemma 3 270M). Every context here is small; prompts are
short except where the contract is about long prompts (n_batch invariance, KV full).
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import context_fixture, exact_model_fixture, greedy_steps, prefilled, produce_commit

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

model = exact_model_fixture()  # runs compared by ==: batch-invariant, on the CPU on a GPU run too


GREEDY = SamplingParams(temperature=0)

# Exactly 150 tokens (with BOS) for the default model.
LONG_PROMPT = (
    "The lighthouse keeper had lived on the island for almost thirty years. Every evening he "
    "climbed the one hundred and twelve steps of the spiral staircase, trimmed the wick, "
    "polished the great brass lens and watched the beam sweep slowly across the dark water. "
    "Ships passed in the night, their crews never knowing his name, yet each of them trusted "
    "the steady light he kept. In the winter storms the waves rose higher than the rocks, and "
    "salt spray rattled against the windows like handfuls of gravel. He kept a journal of "
    "every vessel he saw, noting the weather, the wind and the colour of the sea. One morning, "
    "after a long and violent night, he found a small wooden boat washed up on the shingle "
    "beach below the tower. Inside it"
)

PROMPTS = [
    "The history of the Roman Empire",
    "In a small village by the sea, there lived",
    "def fibonacci(n):\n    ",
    "My favourite recipe for vegetable soup is",
]


def make_ctx(model, **kw):
    kw.setdefault("n_ctx", 512)
    kw.setdefault("n_seq_max", 4)
    return lloyal.Context(model, **kw)


ctx = context_fixture(n_ctx=512, n_seq_max=4)


def greedy(branch: Branch, n: int) -> list[int]:
    """n greedy produce/commit steps on one branch; the tokens."""
    return produce_commit(branch, n, forbid_stop=True)


def top_tokens(logits: np.ndarray, k: int) -> list[int]:
    return [int(t) for t in np.argsort(logits)[::-1][:k]]


def snapshot(b: Branch) -> dict:
    return {
        "position": b.position,
        "fork_head": b.fork_head,
        "perplexity": b.perplexity,
        "sampling_perplexity": b.sampling_perplexity,
        "logits": b.logits,
        "produce": b.produce().token,
    }


def assert_unchanged(b: Branch, before: dict) -> None:
    after = snapshot(b)
    assert after["position"] == before["position"]
    assert after["fork_head"] == before["fork_head"]
    for k in ("perplexity", "sampling_perplexity"):
        x, y = after[k], before[k]
        assert (math.isinf(x) and math.isinf(y)) or x == y, k
    assert np.array_equal(after["logits"], before["logits"])
    assert after["produce"] == before["produce"]


# --------------------------------------------------------------------------- batched commit


def _run_generation(model, n_branches: int, batched: bool, steps: int = 6):
    ctx = make_ctx(model, n_ctx=512, n_seq_max=4)
    try:
        store = BranchStore(ctx)
        branches = [Branch.create(ctx, 0, GREEDY) for _ in range(n_branches)]
        for b, p in zip(branches, PROMPTS, strict=False):
            b.prefill(ctx.tokenize(p))
        tokens: list[list[int]] = [[] for _ in branches]
        used0 = store.kv_pressure.cells_used
        greedy_steps(branches, tokens, steps, batched, forbid_stop=True)
        assert store.kv_pressure.cells_used == used0 + steps * n_branches
        return (
            tokens,
            [b.perplexity for b in branches],
            [b.position for b in branches],
            [b.logits for b in branches],
        )
    finally:
        ctx.close()


def test_batched_commit_matches_single_commits(model):
    """N branches committed together in one decode == the same N branches committed one by one."""
    tok_b, ppl_b, pos_b, logits_b = _run_generation(model, 3, batched=True)
    tok_s, ppl_s, pos_s, logits_s = _run_generation(model, 3, batched=False)
    assert tok_b == tok_s
    assert len({tuple(t) for t in tok_b}) == 3, "the three prompts should diverge"
    assert pos_b == pos_s
    for x, y in zip(ppl_b, ppl_s, strict=True):
        assert 1.0 <= x < 1000.0
        assert x == y  # batch-invariant kernels (the default): bit-identical
    for x, y in zip(logits_b, logits_s, strict=True):
        assert np.array_equal(x, y)


# --------------------------------------------------------------------------- packed prefill


def _individual_logits(model, token_lists):
    out = []
    ctx = make_ctx(model, n_ctx=512, n_seq_max=1)
    try:
        for toks in token_lists:
            b = Branch.create(ctx, 0, GREEDY)
            b.prefill(toks)
            out.append(b.logits)
            b.prune()
    finally:
        ctx.close()
    return out


def _packed(model, token_lists, n_batch):
    ctx = make_ctx(model, n_ctx=512, n_batch=n_batch, n_seq_max=len(token_lists))
    try:
        store = BranchStore(ctx)
        branches = [Branch.create(ctx, 0, GREEDY) for _ in token_lists]
        store.prefill(list(zip(branches, token_lists, strict=False)))
        for b, toks in zip(branches, token_lists, strict=False):
            assert b.position == len(toks)
            assert ctx.kv_seq_pos_max(b.seq_id) == len(toks) - 1
            assert math.isinf(b.perplexity), "prefill must not accept tokens"
        assert store.kv_pressure.cells_used == sum(map(len, token_lists))
        return [b.logits for b in branches]
    finally:
        ctx.close()


def _variable_items(model):
    ctx = make_ctx(model, n_ctx=256, n_seq_max=1)
    try:
        long = ctx.tokenize(LONG_PROMPT)
        return [ctx.tokenize(PROMPTS[0]), long[:45], ctx.tokenize(PROMPTS[2]), long[:3]]
    finally:
        ctx.close()


@pytest.mark.parametrize("n_batch", [512, 16])
def test_store_prefill_variable_lengths_positions_and_logits(model, n_batch):
    """Variable-length items (split across decodes when n_batch=16): right positions, and each
    branch's logits are exactly those of its own prompt decoded alone (batch-invariant)."""
    items = _variable_items(model)
    packed = _packed(model, items, n_batch)
    single = _individual_logits(model, items)
    for p, s in zip(packed, single, strict=True):
        assert p.shape == (model.n_vocab,)
        assert np.array_equal(p, s)


def test_empty_commit_and_prefill_are_noops(ctx):
    store = BranchStore(ctx)
    root = prefilled(ctx, PROMPTS[0])
    before = snapshot(root)
    pressure = store.kv_pressure
    store.commit([])
    store.prefill([])
    store.prefill([(root, [])])
    root.prefill([])
    assert_unchanged(root, before)
    assert store.kv_pressure == pressure


def test_duplicate_branch_in_one_call_is_rejected(ctx):
    store = BranchStore(ctx)
    root = prefilled(ctx, PROMPTS[0])
    other = root.fork()
    before = snapshot(root)
    other_before = snapshot(other)
    pressure = store.kv_pressure
    with pytest.raises(ValueError, match="twice"):
        store.commit([(root, 5), (other, 6), (root, 7)])
    with pytest.raises(ValueError, match="twice"):
        store.prefill([(root, [5, 6]), (root, [7])])
    assert_unchanged(root, before)
    assert_unchanged(other, other_before)
    assert store.kv_pressure == pressure


def test_invalid_token_in_batch_changes_nothing(ctx):
    store = BranchStore(ctx)
    root = prefilled(ctx, PROMPTS[0])
    a, b = root.fork(), root.fork()
    snaps = [snapshot(x) for x in (root, a, b)]
    pressure = store.kv_pressure
    with pytest.raises(lloyal.InvalidTokenError):
        store.commit([(a, a.produce().token), (b, ctx.n_vocab)])
    with pytest.raises(lloyal.InvalidTokenError):
        store.commit([(a, -1), (b, b.produce().token)])
    with pytest.raises(lloyal.InvalidTokenError):
        store.prefill([(a, [1, 2, 3]), (b, [4, ctx.n_vocab + 10])])
    for x, s in zip((root, a, b), snaps, strict=False):
        assert_unchanged(x, s)
    assert store.kv_pressure == pressure


def test_branch_from_other_context_rejected(model, ctx):
    store = BranchStore(ctx)
    other_ctx = make_ctx(model, n_ctx=256, n_seq_max=1)
    try:
        foreign = Branch.create(other_ctx, 0, GREEDY)
        foreign.prefill(other_ctx.tokenize("Hi"))
        with pytest.raises(ValueError, match="different context"):
            store.commit([(foreign, 5)])
        assert foreign.position == len(other_ctx.tokenize("Hi"))
    finally:
        other_ctx.close()


def test_produce_all_matches_individual_produce(ctx):
    store = BranchStore(ctx)
    branches = [Branch.create(ctx, 0, GREEDY) for _ in range(3)]
    store.prefill([(b, ctx.tokenize(p)) for b, p in zip(branches, PROMPTS, strict=False)])
    positions = [b.position for b in branches]
    produced = store.produce_all(branches)
    assert [p.token for p in produced] == [b.produce().token for b in branches]
    assert [p.token for p in produced] == [int(np.argmax(b.logits)) for b in branches]
    assert [p.text for p in produced] == [ctx.token_to_text(p.token) for p in produced]
    assert [b.position for b in branches] == positions
    assert store.produce_all([]) == []


def test_a_commit_of_produced_tokens_draws_the_next_ones_in_its_tick(ctx):
    """Branches whose commit carries the token ``produce`` drew for them get their next tokens
    drawn in the commit's tick (counted in ``sample_seconds``), the same tokens a fresh draw
    gives; a commit of other tokens draws nothing."""
    store = BranchStore(ctx)
    sampling = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
    root = prefilled(ctx, PROMPTS[0], sampling)
    kids = [root, root.fork()]
    for i, k in enumerate(kids):
        k.reseed_sampler(11 + i)
    twins = [k.fork() for k in kids]  # the same sampler and RNG state: the reference draws
    for step in range(4):
        drawn = [p.token for p in store.produce_all(kids)]  # drawn in the last tick after the first
        for t in twins:
            t.set_logit_bias({})  # forget any draw made ahead: the twins draw afresh
        assert drawn == [t.produce().token for t in twins]
        before = ctx.engine_stats().sample_seconds
        store.commit(list(zip(kids + twins, drawn + drawn, strict=True)))
        assert ctx.engine_stats().sample_seconds > before, step
        assert [t.position for t in twins] == [k.position for k in kids]
    before = ctx.engine_stats().sample_seconds
    store.commit([(k, 1000 + i) for i, k in enumerate(kids + twins)])  # not what produce drew
    assert ctx.engine_stats().sample_seconds == before


def test_kv_pressure_and_context(ctx):
    store = BranchStore(ctx)
    assert store.context is ctx
    p = store.kv_pressure
    assert (p.n_ctx, p.cells_used, p.remaining) == (ctx.n_ctx, 0, ctx.n_ctx)
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill([2, 100, 200, 300])
    p = store.kv_pressure
    assert (p.cells_used, p.remaining) == (4, ctx.n_ctx - 4)


# --------------------------------------------------------------------------- leases


def test_lease_exhaustion_and_recycling(ctx):
    store = BranchStore(ctx)
    n = ctx.n_seq_max
    assert n == 4 and store.available == 4
    root = prefilled(ctx, PROMPTS[0])
    kids = [root.fork() for _ in range(n - 1)]
    assert store.available == 0
    assert len({b.seq_id for b in [root, *kids]}) == n
    pressure = store.kv_pressure
    with pytest.raises(lloyal.LeaseExhaustedError) as ei:
        root.fork()
    msg = str(ei.value)
    assert "n_seq_max" in msg and str(n) in msg
    assert f"{n} live" in msg
    with pytest.raises(lloyal.LeaseExhaustedError, match="n_seq_max"):
        Branch.create(ctx, 0, GREEDY)
    assert root.children == kids
    assert store.kv_pressure == pressure
    assert store.available == 0

    freed_seq = kids[1].seq_id
    kids[1].prune()
    assert store.available == 1
    new = root.fork()
    assert store.available == 0
    assert new.seq_id == freed_seq
    assert new.handle != kids[1].handle
    assert new.position == root.position
    new.commit(new.produce().token)
    assert new.position == root.position + 1

    root.prune_subtree()
    assert store.available == n
    assert store.kv_pressure.cells_used == 0


def test_lease_exhaustion_message_counts(model):
    """Message names n_seq_max and the live count (n_seq_max=2 here)."""
    ctx = make_ctx(model, n_ctx=256, n_seq_max=2)
    try:
        a = Branch.create(ctx, 0, GREEDY)
        Branch.create(ctx, 0, GREEDY)
        with pytest.raises(lloyal.LeaseExhaustedError) as ei:
            a.fork()
        msg = str(ei.value)
        assert "n_seq_max" in msg and "2 live" in msg
        assert isinstance(ei.value, lloyal.LloyalError)
    finally:
        ctx.close()


# --------------------------------------------------------------------------- retain_only


def _retain_scenario(model, winner_index: int, advance_losers: bool):
    """Root + 3 children that each commit a different first token; retain_only(child)."""
    ctx = make_ctx(model, n_ctx=512, n_seq_max=4)
    try:
        store = BranchStore(ctx)
        prompt = ctx.tokenize(PROMPTS[1])
        root = Branch.create(ctx, 0, GREEDY)
        root.prefill(prompt)
        kids = [root.fork() for _ in range(3)]
        firsts = top_tokens(root.logits, 3)
        store.commit(list(zip(kids, firsts, strict=False)))
        winner = kids[winner_index]
        losers = [root] + [k for k in kids if k != winner]
        if advance_losers:
            store.commit([(b, b.produce().token) for b in losers[1:]])
        loser_seqs = [b.seq_id for b in losers]
        winner_seq = winner.seq_id
        logits = winner.logits

        store.retain_only(winner)

        assert store.available == ctx.n_seq_max - 1
        assert winner.parent is None
        assert winner.children == []
        assert winner.is_leaf and winner.is_active and not winner.disposed
        assert winner.seq_id == winner_seq
        assert winner.position == len(prompt) + 1
        assert np.array_equal(winner.logits, logits)
        assert store.kv_pressure.cells_used == len(prompt) + 1
        for b, seq in zip(losers, loser_seqs, strict=False):
            assert b.disposed and not b.is_active
            with pytest.raises(lloyal.BranchDisposedError):
                _ = b.position
            with pytest.raises(lloyal.BranchDisposedError):
                b.produce()
            assert ctx.kv_seq_pos_max(seq) == -1
        assert ctx.kv_seq_pos_max(winner_seq) == len(prompt)
        after = greedy(winner, 8)
        winner_ppl = winner.perplexity
        # Leases are usable again.
        extra = winner.fork()
        assert extra.position == winner.position
        assert store.available == ctx.n_seq_max - 2
        assert winner.children == [extra]
    finally:
        ctx.close()

    twin_ctx = make_ctx(model, n_ctx=512, n_seq_max=1)
    try:
        twin = Branch.create(twin_ctx, 0, GREEDY)
        twin.prefill(prompt)
        twin.commit(firsts[winner_index])
        return after, winner_ppl, greedy(twin, 8), twin.perplexity
    finally:
        twin_ctx.close()


def test_retain_only_winner_keeps_generating_identically(model):
    """The first child wins, so its later cells land in the same KV order as in a fresh
    context: its greedy continuation equals a twin that never had siblings."""
    after, ppl, twin_after, twin_ppl = _retain_scenario(model, 0, advance_losers=False)
    assert after == twin_after
    assert ppl == twin_ppl


def test_retain_only_middle_winner_keeps_generating_identically(model):
    """A middle child wins after its siblings advanced past it: retain_only rewrites its cells
    in order, so its next tokens do not land in freed cells ahead of its own and it continues
    exactly like a twin that never had siblings."""
    after, ppl, twin_after, twin_ppl = _retain_scenario(model, 1, advance_losers=True)
    assert after == twin_after
    assert ppl == twin_ppl


def test_retain_only_rejects_disposed_winner(ctx):
    store = BranchStore(ctx)
    root = Branch.create(ctx, 0, GREEDY)
    child = root.fork()
    child.prune()
    with pytest.raises(lloyal.BranchDisposedError):
        store.retain_only(child)
    assert root.is_active and store.available == ctx.n_seq_max - 1


# --------------------------------------------------------------------------- KV full


def test_kv_full_batched_commit_of_seven_changes_nothing(model):
    ctx = make_ctx(model, n_ctx=256, n_seq_max=8)
    try:
        store = BranchStore(ctx)
        n_ctx = store.kv_pressure.n_ctx
        assert n_ctx == ctx.n_ctx
        toks = (ctx.tokenize(LONG_PROMPT) * 3)[: n_ctx - 10]
        root = Branch.create(ctx, 0, GREEDY)
        root.prefill(toks)
        kids = [root.fork() for _ in range(7)]
        assert store.kv_pressure.cells_used == n_ctx - 10  # forks cost nothing
        store.commit(list(zip(kids, top_tokens(root.logits, 7), strict=False)))
        assert store.kv_pressure.remaining == 3
        snaps = [snapshot(b) for b in kids]
        root_snap = snapshot(root)
        pos_max = [ctx.kv_seq_pos_max(b.seq_id) for b in kids]
        pressure = store.kv_pressure

        pairs = [(b, s["produce"]) for b, s in zip(kids, snaps, strict=False)]
        with pytest.raises(lloyal.KvCacheFullError) as ei:
            store.commit(pairs)
        assert isinstance(ei.value, lloyal.DecodeError)
        assert "n_ctx" in str(ei.value)

        for b, s in zip(kids, snaps, strict=False):
            assert_unchanged(b, s)
        assert_unchanged(root, root_snap)
        assert [ctx.kv_seq_pos_max(b.seq_id) for b in kids] == pos_max
        assert store.kv_pressure == pressure

        # The context keeps working: free some cells, then a smaller batch commits.
        for b in kids[3:]:
            b.prune()
        assert store.kv_pressure.remaining == 7
        store.commit(pairs[:3])
        for b, s in zip(kids[:3], snaps[:3], strict=False):
            assert b.position == s["position"] + 1
            assert math.isfinite(b.perplexity)
        assert store.kv_pressure.remaining == 4
    finally:
        ctx.close()


def test_kv_full_inside_llama_decode_rolls_back(model):
    """Cells held through the flat path are invisible to the branch accounting, so the commit
    reaches llama_decode, which finds no slot: still KvCacheFullError, nothing changed."""
    ctx = make_ctx(model, n_ctx=256, n_seq_max=8)
    try:
        store = BranchStore(ctx)
        n_ctx = store.kv_pressure.n_ctx
        root = prefilled(ctx, PROMPTS[1])
        kids = [root.fork() for _ in range(6)]
        branches = [root, *kids]
        free_seq = next(s for s in range(8) if s not in {b.seq_id for b in branches})
        filler = (ctx.tokenize(LONG_PROMPT, add_special=False) * 3)[: n_ctx - root.position - 3]
        ctx.decode(filler, 0, seq_id=free_seq)
        snaps = [snapshot(b) for b in branches]
        pos_max = [ctx.kv_seq_pos_max(b.seq_id) for b in branches]
        pairs = [(b, t) for b, t in zip(branches, top_tokens(root.logits, 7), strict=False)]
        with pytest.raises(lloyal.KvCacheFullError):
            store.commit(pairs)
        for b, s in zip(branches, snaps, strict=False):
            assert_unchanged(b, s)
        assert [ctx.kv_seq_pos_max(b.seq_id) for b in branches] == pos_max
        # Free the flat cells: the same commit now succeeds.
        ctx.kv_cache_remove(free_seq, 0)
        store.commit(pairs)
        assert [b.position for b in branches] == [s["position"] + 1 for s in snaps]
    finally:
        ctx.close()


def test_packed_prefill_failing_in_a_later_decode_rolls_back(model):
    """n_batch=32 splits the prefill into several decodes; the first succeeds, a later one
    finds no KV slot. The cells of the successful decode must be removed again."""
    ctx = make_ctx(model, n_ctx=256, n_batch=32, n_seq_max=4)
    try:
        store = BranchStore(ctx)
        n_ctx = store.kv_pressure.n_ctx
        a, b = Branch.create(ctx, 0, GREEDY), Branch.create(ctx, 0, GREEDY)
        a.prefill(ctx.tokenize(PROMPTS[0]))
        free_seq = next(s for s in range(4) if s not in (a.seq_id, b.seq_id))
        filler = (ctx.tokenize(LONG_PROMPT, add_special=False) * 3)[: n_ctx - a.position - 40]
        ctx.decode(filler, 0, seq_id=free_seq)
        snap_a = snapshot(a)
        pressure = store.kv_pressure
        words = ctx.tokenize(LONG_PROMPT, add_special=False)
        items = [(a, words[:30]), (b, words[30:60])]  # 60 tokens, 40 real cells free
        with pytest.raises(lloyal.KvCacheFullError):
            store.prefill(items)
        assert_unchanged(a, snap_a)
        assert b.position == 0
        assert ctx.kv_seq_pos_max(a.seq_id) == snap_a["position"] - 1
        assert ctx.kv_seq_pos_max(b.seq_id) == -1
        assert store.kv_pressure == pressure
        ctx.kv_cache_remove(free_seq, 0)
        store.prefill(items)
        assert a.position == snap_a["position"] + 30 and b.position == 30
        assert ctx.kv_seq_pos_max(b.seq_id) == 29
    finally:
        ctx.close()


# --------------------------------------------------------------------------- stop vs sibling


def test_stop_token_on_one_branch_sibling_continues(ctx):
    store = BranchStore(ctx)
    root = prefilled(ctx, PROMPTS[0])
    p0 = root.position
    a, b = root.fork(), root.fork()
    eog = ctx.eog_token
    active = [a, b]
    generated = {a: [], b: []}
    stopped_at = {}
    for step in range(5):
        if step == 2:
            a.steer({eog: 1000.0})
        produced = store.produce_all(active)
        pairs = []
        for br, p in zip(active, produced, strict=False):
            if p.is_stop:
                assert p.token == eog and ctx.is_stop_token(p.token)
                stopped_at[br] = step
            else:
                pairs.append((br, p.token))
                generated[br].append(p.token)
        active = [br for br, _ in pairs]
        store.commit(pairs)
    assert stopped_at == {a: 2}
    assert a.position == p0 + 2
    assert b.position == p0 + 5
    assert ctx.kv_seq_pos_max(a.seq_id) == p0 + 1
    assert ctx.kv_seq_pos_max(b.seq_id) == p0 + 4
    assert eog not in generated[a] and eog not in generated[b]
    # Both followed the greedy path of the root until a stopped.
    assert generated[a] == generated[b][:2]
    assert greedy(root, 5) == generated[b]


# --------------------------------------------------------------------------- bugs found


def test_n_batch_smaller_than_n_seq_max_does_not_crash():
    code = textwrap.dedent(
        """
        import lloyal
        try:
            ctx = lloyal.Context(lloyal.default_model_path(), n_ctx=256, n_batch=2, n_seq_max=4)
        except ValueError:
            print("REFUSED")
        else:
            p = lloyal.SamplingParams(temperature=0)
            root = lloyal.Branch.create(ctx, 0, p)
            root.prefill(ctx.tokenize("Hello there"))
            kids = [root.fork() for _ in range(3)]
            store = lloyal.BranchStore(ctx)
            store.commit([(b, b.produce().token) for b in [root, *kids]])
            assert [b.position for b in [root, *kids]] == [root.position] * 4
            print("WORKS")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # n_outputs_max is raised to n_seq_max, so the commit of 4 runs as 2 decodes of 2 rows.
    assert proc.stdout.strip() == "WORKS"


def test_available_and_kv_pressure_do_not_wait_for_a_call_holding_the_context(model: lloyal.Model) -> None:
    """Both are published at the end of every call, so a scheduler deciding whether a request
    fits reads them while a long call (here a flat-path decode of 75 chunks) holds the context
    lock; before, the read waited for that call, up to a prefill chunk in the server."""
    import threading
    import time

    with lloyal.Context(model, n_ctx=2048, n_batch=16, n_seq_max=4) as ctx:
        store = BranchStore(ctx)
        b = Branch.create(ctx, 0, SamplingParams(temperature=0))
        b.prefill(ctx.tokenize("The lighthouse keeper"))
        want = (store.available, store.kv_pressure)
        done = threading.Event()

        def long_call() -> None:
            ctx.decode([1000 + (i * 7) % 3000 for i in range(1200)], 0, seq_id=3)
            done.set()

        t = threading.Thread(target=long_call)
        t.start()
        time.sleep(0.3)  # the decode now holds the lock (for a second or more)
        got = (store.available, store.kv_pressure)
        still_running = not done.is_set()  # the getters keep the GIL: the thread cannot set it in between
        t.join()
        assert got == want and still_running
        assert ctx.kv_seq_pos_max(3) == 1199 and (store.available, store.kv_pressure) == want


def test_kv_pressure_and_engine_stats_read_the_core_values(ctx):
    """Both classes wrap the core's value: every field is a property, and ``repr`` lists them
    all as a dataclass's does (floats and booleans written as Python writes them)."""
    store = BranchStore(ctx)
    root = prefilled(ctx, PROMPTS[0])
    p = store.kv_pressure
    used = root.position
    assert (p.n_ctx, p.cells_used, p.remaining, p.cells_parked) == (512, used, 512 - used, 0)
    assert repr(p) == f"KvPressure(n_ctx=512, cells_used={used}, remaining={512 - used}, cells_parked=0)"
    stats = ctx.engine_stats()
    fields = [
        "ticks", "decode_calls", "rows", "ops_submitted", "ops_completed", "ops_failed",
        "ops_coalesced", "max_ops_per_tick", "queue_depth", "in_flight", "generating", "waiting",
        "tick_seconds", "decode_seconds", "sample_seconds", "lease_waiting", "prefill_cap",
        "paused", "gather", "burst_waits", "burst_wait_seconds", "kv_compactions",
    ]  # fmt: skip
    want = ", ".join(f"{f}={getattr(stats, f)!r}" for f in fields)
    assert repr(stats) == f"EngineStats({want})"
    assert stats.decode_calls >= 1 and stats.paused is False
    before = ctx.engine_gather
    try:
        ctx.engine_gather = 1e-05  # a float Python writes with an exponent
        assert "paused=False, gather=1e-05, burst_waits=" in repr(ctx.engine_stats())
    finally:
        ctx.engine_gather = before
    root.prune()
