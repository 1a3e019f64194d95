"""Branch.save_state / Branch.load_state on the real model: resume exactly, reject bad data."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
from helpers import produce_commit

import lloyal

PROMPT = "The old lighthouse keeper opened the door and saw"


@pytest.fixture
def ctx2(make_context: Callable[..., lloyal.Context]) -> lloyal.Context:
    return make_context(n_ctx=1024, n_seq_max=2)


def test_greedy_branch_resumes_in_a_fresh_context(model: lloyal.Model, ctx2: lloyal.Context) -> None:
    b = lloyal.Branch.create(ctx2, 0, lloyal.SamplingParams(temperature=0))
    b.prefill(ctx2.tokenize(PROMPT))
    b.commit(b.produce().token)
    data = b.save_state()
    ppl, position, logits = b.perplexity, b.position, b.logits
    expected = produce_commit(b, 5)
    with lloyal.Context(model, n_ctx=1024) as fresh:
        loaded = lloyal.Branch.load_state(fresh, data)
        assert loaded.position == position and loaded.perplexity == ppl
        assert np.array_equal(loaded.logits, logits)
        assert fresh.kv_seq_pos_max(loaded.seq_id) == position - 1
        assert lloyal.BranchStore(fresh).kv_pressure.cells_used == position
        assert produce_commit(loaded, 5) == expected


def test_sampled_branch_keeps_rng_history_and_bias(model: lloyal.Model, ctx2: lloyal.Context) -> None:
    params = lloyal.SamplingParams(temperature=0.9, top_k=50, repeat_penalty=1.3, seed=42)
    b = lloyal.Branch.create(ctx2, 0, params)
    b.prefill(ctx2.tokenize(PROMPT))
    banned = ctx2.tokenize(" a", add_special=False)[0]
    b.set_logit_bias({banned: float("-inf")})
    produce_commit(b, 3)
    data = b.save_state()
    expected = produce_commit(b, 6)
    assert banned not in expected
    with lloyal.Context(model, n_ctx=1024) as fresh:
        loaded = lloyal.Branch.load_state(fresh, data)
        assert produce_commit(loaded, 6) == expected
        assert loaded.sampling_perplexity == pytest.approx(b.sampling_perplexity, rel=1e-6)


def test_grammar_state_is_restored(model: lloyal.Model, ctx2: lloyal.Context) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    b = lloyal.Branch.create(
        ctx2, 0, lloyal.SamplingParams(temperature=0), grammar=lloyal.json_schema_to_grammar(schema)
    )
    b.prefill(ctx2.tokenize("A JSON object with a number n:\n"))
    head = produce_commit(b, 3)
    data = b.save_state()
    tail = [t.token for t in b.generate(30)]
    with lloyal.Context(model, n_ctx=1024) as fresh:
        loaded = lloyal.Branch.load_state(fresh, data)
        assert [t.token for t in loaded.generate(30)] == tail
    doc = json.loads(ctx2.detokenize(head + tail))
    assert isinstance(doc["n"], int)


def test_bad_bytes_raise_state_error_and_change_nothing(ctx2: lloyal.Context) -> None:
    b = lloyal.Branch.create(ctx2, 0)
    b.prefill(ctx2.tokenize(PROMPT))
    data = b.save_state()
    store = lloyal.BranchStore(ctx2)
    cells = store.kv_pressure.cells_used
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    cases = [b"", b"LLOYALBR", data[:-1], data[: len(data) // 3], bytes(flipped), b"\x00" * 64, data + b"x"]
    for bad in cases:
        with pytest.raises(lloyal.StateError, match="cannot load branch state"):
            lloyal.Branch.load_state(ctx2, bad)
    assert store.available == 1 and store.kv_pressure.cells_used == cells
    assert ctx2.kv_seq_pos_max(1) == -1  # the spare sequence was never written


def test_kv_blob_is_not_a_branch_state(ctx2: lloyal.Context) -> None:
    ctx2.decode(ctx2.tokenize(PROMPT), 0, 1)
    with pytest.raises(lloyal.StateError, match="bad magic"):
        lloyal.Branch.load_state(ctx2, ctx2.kv_cache_save(1))


def test_load_needs_a_free_lease(ctx2: lloyal.Context) -> None:
    a = lloyal.Branch.create(ctx2, 0)
    a.prefill(ctx2.tokenize(PROMPT))
    data = a.save_state()
    lloyal.Branch.create(ctx2, 0)
    with pytest.raises(lloyal.LeaseExhaustedError):
        lloyal.Branch.load_state(ctx2, data)
    a.prune()
    loaded = lloyal.Branch.load_state(ctx2, data)
    assert loaded.parent is None and loaded.position == len(ctx2.tokenize(PROMPT))


# --- sequences longer than the sliding window (Gemma 3: 512 positions) -------------------------

LONG = "Once upon a time there was a little fox who lived in the forest. " * 60


@pytest.mark.gemma
def test_a_resumed_branch_past_the_window_saves_and_resumes_with_all_its_cells(
    make_context: Callable[..., lloyal.Context],
) -> None:
    """llama.cpp saves a sequence's sliding-window cells from its last window on, and answers
    its first position from them: a branch resumed twice still counts its 600 cells (it
    counted 512, and the cache then took a prefill it had no room for)."""
    ctx = make_context(n_ctx=1024, n_seq_max=3)
    store = lloyal.BranchStore(ctx)
    tokens = ctx.tokenize(LONG)[:600]
    b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
    b.prefill(tokens)
    data = b.save_state()
    b.prune()
    once = lloyal.Branch.load_state(ctx, data)
    twice_data = once.save_state()
    once.prune()
    twice = lloyal.Branch.load_state(ctx, twice_data)
    assert (twice.position, twice.fork_head, store.kv_pressure.cells_used) == (600, 0, 600)
    other = lloyal.Branch.create(ctx, 0)
    with pytest.raises(lloyal.KvCacheFullError):
        other.prefill(tokens[:425])  # 1024 - 600 = 424 cells are free
    other.prefill(tokens[:424])


@pytest.mark.gemma
def test_forks_of_a_resumed_branch_are_exact_or_refused(make_context: Callable[..., lloyal.Context]) -> None:
    """A resumed 700-token branch holds its sliding-window cells from 188 on: a fork where a
    decode attends to earlier ones (at < 699) would give other logits than a fresh prefill (9.8
    apart at 300), so it is refused; at 699 it continues as a fork of the live branch does,
    and its own forks inherit the limit."""
    ctx = make_context(n_ctx=2048, n_seq_max=4)
    tokens = ctx.tokenize(LONG)[:700]
    live = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
    live.prefill(tokens)
    resumed = lloyal.Branch.load_state(ctx, live.save_state())
    with pytest.raises(ValueError, match=r"fork\(at=300\).*continues exactly only at 699 or later"):
        resumed.fork(at=300)
    a, b = live.fork(at=699), resumed.fork(at=699)
    a.commit(tokens[699])
    b.commit(tokens[699])
    assert np.array_equal(a.logits, b.logits)
    a.prune()
    b.prune()
    with pytest.raises(ValueError, match="continues exactly only at 699"):
        resumed.fork().fork(at=650)
    resumed.prune_subtree()
    head = live.fork(at=300)
    short = lloyal.Branch.load_state(ctx, head.save_state())  # within one window: no limit
    head.prune()
    short.fork(at=100)


def test_states_a_branch_saves_load(ctx2: lloyal.Context) -> None:
    """An infinite sampling perplexity (a token banned with -inf committed) and an empty branch
    made past position 0 round-trip (each was refused on load as bad data)."""
    b = lloyal.Branch.create(ctx2, 0, lloyal.SamplingParams(temperature=0.8, seed=1))
    b.prefill(ctx2.tokenize(PROMPT))
    b.set_logit_bias({9999: float("-inf")})
    b.commit(9999)
    assert b.sampling_perplexity == float("inf")
    loaded = lloyal.Branch.load_state(ctx2, b.save_state())
    assert loaded.sampling_perplexity == float("inf") and loaded.position == b.position
    b.prune()
    loaded.prune()
    empty = lloyal.Branch.create(ctx2, position=5)
    again = lloyal.Branch.load_state(ctx2, empty.save_state())
    assert (again.position, again.fork_head) == (5, 5)
    again.prefill([2, 651])
    assert again.position == 7


def test_a_cache_full_of_flat_cells_is_a_full_cache(ctx2: lloyal.Context) -> None:
    """The branches' count does not see flat-path cells: llama.cpp's refusal for want of free
    cells is KvCacheFullError, not StateError (the data was fine), with the lease returned."""
    tokens = (ctx2.tokenize(PROMPT) * 40)[:400]
    b = lloyal.Branch.create(ctx2, 0, lloyal.SamplingParams(temperature=0))
    b.prefill(tokens)
    data = b.save_state()
    b.prune()
    ctx2.decode(tokens + tokens[:300], 0, seq_id=0)  # 700 flat cells, 324 free
    store = lloyal.BranchStore(ctx2)
    with pytest.raises(lloyal.KvCacheFullError, match="no run of 400 free cells"):
        lloyal.Branch.load_state(ctx2, data)
    assert store.available == 2 and ctx2.kv_cache_size(0) == 699  # the lease came back
