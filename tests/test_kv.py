"""Raw KV sequence ops: copy, keep, remove, clear, ranges."""

from __future__ import annotations

import pytest

import lloyal


@pytest.fixture
def ctx4(model: lloyal.Model):  # type: ignore[no-untyped-def]
    with lloyal.Context(model, n_ctx=512, n_seq_max=4) as c:
        yield c


def test_copy_then_keep(ctx4: lloyal.Context) -> None:
    toks = ctx4.tokenize("The capital of France is Paris. The capital of Germany is")
    ctx4.decode(toks, 0, 0)
    ctx4.kv_seq_copy(0, 1)
    assert ctx4.kv_seq_pos_max(1) == ctx4.kv_seq_pos_max(0) == len(toks) - 1
    ctx4.kv_seq_keep(1)
    assert ctx4.kv_seq_pos_max(0) == -1
    assert ctx4.kv_seq_pos_max(1) == len(toks) - 1
    ctx4.decode([ctx4.sample(temperature=0)], len(toks), 1)  # continues at the right position
    assert ctx4.kv_cache_size(1) == len(toks)


def test_partial_copy_and_remove(ctx4: lloyal.Context) -> None:
    ctx4.decode(list(range(1000, 1020)), 0, 0)
    ctx4.kv_seq_copy(0, 2, 0, 10)
    assert ctx4.kv_seq_pos_max(2) == 9
    ctx4.kv_cache_remove(0, 15)
    assert ctx4.kv_cache_size(0) == 14
    ctx4.kv_cache_remove(0, 5, 10)
    assert ctx4.kv_cache_size(0) == 14  # a hole, the end stays
    ctx4.kv_cache_clear()
    assert [ctx4.kv_seq_pos_max(s) for s in range(4)] == [-1, -1, -1, -1]


def test_bad_seq_ids_and_ranges(ctx4: lloyal.Context) -> None:
    for call in (
        lambda: ctx4.kv_seq_pos_max(4),
        lambda: ctx4.kv_cache_remove(-1, 0),
        lambda: ctx4.kv_seq_copy(0, 9),
        lambda: ctx4.decode([5], 0, 7),
        lambda: ctx4.kv_cache_remove(0, 5, 2),
        lambda: ctx4.kv_cache_remove(0, -3),
    ):
        with pytest.raises(ValueError):
            call()
