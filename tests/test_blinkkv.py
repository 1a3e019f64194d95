"""BlinkKV on the real model: clear_and_reseed (flat) and Branch.reseed (lease-aware)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from helpers import run_in_order

import lloyal

STORY = (
    "Once upon a time in a small harbour town there lived a fisherman who kept a diary of every "
    "storm, every catch and every stranger that came ashore. "
) * 4


@pytest.fixture
def ctx3(make_context: Callable[..., lloyal.Context]) -> lloyal.Context:
    return make_context(n_ctx=512, n_seq_max=3)


def test_clear_and_reseed_keeps_sinks_and_tail_and_continues(ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize(STORY)
    ctx.decode(tokens, 0)
    sinks, tail = tokens[:4], tokens[-32:]
    tracker = ctx.create_perplexity_tracker()
    tracker.add_surprisal(ctx.model_surprisal(tail[0]))
    pos = ctx.clear_and_reseed(sinks, tail)
    assert pos == len(sinks) + len(tail)
    assert ctx.kv_cache_size() == len(sinks) + len(tail) - 1
    assert np.isfinite(ctx.get_logits()).all()
    for _ in range(5):  # generation continues right after the reseeded cells
        token = ctx.sample(temperature=0)
        tracker.add_surprisal(ctx.model_surprisal(token))
        ctx.decode([token], pos)
        pos += 1
    assert ctx.kv_cache_size() == pos - 1
    assert tracker.count == 6 and 1.0 <= tracker.perplexity < math.inf


def test_clear_and_reseed_refuses_bad_input(ctx: lloyal.Context) -> None:
    with pytest.raises(ValueError, match="at least one"):
        ctx.clear_and_reseed([], [])
    with pytest.raises(lloyal.InvalidTokenError):
        ctx.clear_and_reseed([2], [10**9])
    # more than the cache holds: refused before anything is cleared
    ctx.decode([2, 651, 6974], 0)
    with pytest.raises(lloyal.KvCacheFullError, match="more sink and tail tokens than the whole cache"):
        ctx.clear_and_reseed([2] * 8, [651] * ctx.n_ctx)
    assert ctx.kv_cache_size() == 2  # seq 0 still ends at position 2


def test_branch_reseed_rewrites_only_its_sequence_and_keeps_metrics(ctx3: lloyal.Context) -> None:
    store = lloyal.BranchStore(ctx3)
    tokens = ctx3.tokenize(STORY)
    greedy = lloyal.SamplingParams(temperature=0)
    a = lloyal.Branch.create(ctx3, 0, greedy)
    other = lloyal.Branch.create(ctx3, 0, greedy)
    a.prefill(tokens)
    other.prefill(tokens[:20])
    surprisals = []
    for _ in range(3):
        t = a.produce().token
        surprisals.append(a.model_surprisal(t))
        a.commit(t)
    assert a.perplexity == pytest.approx(math.exp(sum(surprisals) / 3), rel=1e-6)
    sinks, tail = tokens[:4], tokens[-16:]
    pos = a.reseed(sinks, tail)
    assert pos == a.position == 20
    assert ctx3.kv_seq_pos_max(a.seq_id) == 19
    assert ctx3.kv_seq_pos_max(other.seq_id) == 19 and other.position == 20  # untouched
    assert store.kv_pressure.cells_used == 20 + 20
    assert store.available == 1  # the parking lease went back
    for _ in range(3):  # perplexity keeps accumulating across the reseed
        t = a.produce().token
        surprisals.append(a.model_surprisal(t))
        a.commit(t)
    assert a.perplexity == pytest.approx(math.exp(sum(surprisals) / 6), rel=1e-6)
    assert a.position == 23


def test_branch_reseed_refusals_change_nothing(ctx3: lloyal.Context) -> None:
    tokens = ctx3.tokenize(STORY)
    a = lloyal.Branch.create(ctx3, 0)
    a.prefill(tokens[:40])
    child = a.fork()
    with pytest.raises(lloyal.TopologyError, match="children"):
        a.reseed(tokens[:4], tokens[-8:])
    child.prune()
    with pytest.raises(lloyal.InvalidTokenError):
        a.reseed([2], [10**9])
    with pytest.raises(lloyal.KvCacheFullError):
        a.reseed(tokens[:4], tokens * 5)
    assert a.position == 40 and ctx3.kv_seq_pos_max(a.seq_id) == 39
    assert lloyal.BranchStore(ctx3).available == 2


def test_branch_reseed_on_a_nearly_full_cache_frees_its_cells_first(
    make_context: Callable[..., lloyal.Context],
) -> None:
    """The BlinkKV case: 240 of 256 cells used, reseed to 64 tokens. Keeping the old cells
    while writing the new would need 304 cells, so the old ones are freed first."""
    with make_context(n_ctx=256, n_seq_max=2) as ctx:
        tokens = (ctx.tokenize(STORY) * 20)[:240]
        store = lloyal.BranchStore(ctx)
        a = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
        a.prefill(tokens)
        assert store.kv_pressure.cells_used == 240
        sinks, tail = tokens[:4], tokens[180:]
        assert a.reseed(sinks, tail) == 64
        assert a.position == 64 and ctx.kv_seq_pos_max(a.seq_id) == 63
        assert store.kv_pressure.cells_used == 64
        assert store.available == 1  # no parking lease left behind
        with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)) as twin:
            twin.prefill(sinks + tail)
            for _ in range(4):  # continues exactly like a fresh prefill of the same tokens
                t = a.sample()
                assert twin.sample() == t
                a.commit(t)
                twin.commit(t)
        assert store.kv_pressure.cells_used == 68


def test_cells_of_sequences_no_branch_holds_count_as_taken(
    make_context: Callable[..., lloyal.Context],
) -> None:
    """Flat-path cells on a sequence no branch holds (``ctx.decode``) fill the cache up to 10
    cells. A reseed needing 30 was let through a room check that counted branches' cells only:
    it freed its branch's cells and failed to write the new ones, leaving the branch empty with
    no logits. It is refused up front now, changing nothing; a generation request asking for
    more than the room waits and times out instead of failing after 10 tokens."""
    with make_context(n_ctx=256, n_seq_max=2) as ctx:
        toks = ctx.tokenize("Once upon a time, in a land far away, there lived a")
        br = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
        br.prefill(toks)
        flat = (ctx.tokenize(STORY, add_special=False) * 4)[: 256 - len(toks) - 10]
        ctx.decode(flat, 0, 1)  # seq 1 is free: allowed
        before = (br.position, ctx.kv_seq_pos_max(br.seq_id), br.sample())
        with pytest.raises(lloyal.KvCacheFullError, match="sequences no branch holds"):
            br.reseed(toks[:4], toks[-13:] * 2)
        assert (br.position, ctx.kv_seq_pos_max(br.seq_id), br.sample()) == before
        with pytest.raises(lloyal.KvCacheFullError, match="waited"):
            list(br.generate(max_tokens=20, timeout=0.5))
        assert br.position == before[0]
        ctx.kv_cache_remove(1, 0)  # the room comes back
        assert len(list(br.generate(max_tokens=20))) == 20


def test_a_reseed_keeps_its_parked_cells_from_other_operations(
    make_context: Callable[..., lloyal.Context],
) -> None:
    """A reseed is an engine prefill: while it writes the new cells, the old ones (parked on a
    free lease) still count as used, so a prefill queued behind it that would need them is
    refused instead of failing llama.cpp's decode."""
    with make_context(n_ctx=512, n_batch=64, n_seq_max=3) as ctx:
        store = lloyal.BranchStore(ctx)
        a = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
        b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
        a.prefill([1000 + i for i in range(100)])
        new = [2000 + i for i in range(300)]  # 100 + 300 <= 512: the old cells are parked
        results: list[object] = []
        errors, late = run_in_order(
            ctx,
            [lambda: results.append(a.reseed(new[:4], new[4:])), lambda: b.prefill([3000] * (512 - 400 + 1))],
        )
        assert errors == [] and results == [300]
        assert len(late) == 1 and isinstance(late[0], lloyal.KvCacheFullError)
        assert (a.position, b.position) == (300, 0) and ctx.kv_seq_pos_max(a.seq_id) == 299
        assert store.kv_pressure.cells_used == 300 and store.available == 1  # the parking lease is back
