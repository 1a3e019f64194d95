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
