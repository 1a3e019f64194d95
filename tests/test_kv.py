"""Raw KV sequence ops: copy, keep, remove, clear, ranges."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import context_fixture

import lloyal

PROMPT = "The capital of France is Paris. The capital of Germany is"


ctx4 = context_fixture(n_ctx=512, n_seq_max=4)


def test_copy_then_keep(ctx4: lloyal.Context) -> None:
    toks = ctx4.tokenize(PROMPT)
    n = len(toks)
    ctx4.decode(toks, 0, 0)
    t0 = ctx4.sample(temperature=0)
    assert [ctx4.kv_seq_pos_max(s) for s in range(4)] == [n - 1, -1, -1, -1]

    ctx4.kv_seq_copy(0, 1)
    assert ctx4.kv_seq_pos_max(1) == ctx4.kv_seq_pos_max(0) == n - 1
    assert ctx4.kv_cache_size(1) == n - 1

    # Seq 1 sees the copied prompt: the same next token gives the same logits on both.
    ctx4.decode([t0], n, 0)
    on_0 = ctx4.get_logits().copy()
    ctx4.decode([t0], n, 1)
    on_1 = ctx4.get_logits().copy()
    assert np.array_equal(on_0, on_1)

    ctx4.kv_seq_keep(1)
    assert ctx4.kv_seq_pos_max(0) == -1
    assert ctx4.kv_seq_pos_max(1) == n
    # Seq 1 continues at the right position, and only there.
    with pytest.raises(ValueError):
        ctx4.decode([5], n, 1)
    t1 = int(np.argmax(on_1))
    ctx4.decode([t1], n + 1, 1)
    assert ctx4.kv_cache_size(1) == n + 1
    assert ctx4.kv_cache_size(0) == -1
    # Seq 0 is empty again and can start over at 0.
    ctx4.decode([2], 0, 0)
    assert ctx4.kv_cache_size(0) == 0


def test_partial_copy(ctx4: lloyal.Context) -> None:
    ctx4.decode(list(range(100, 120)), 0, 0)
    ctx4.kv_seq_copy(0, 2, 0, 10)
    assert ctx4.kv_seq_pos_max(2) == 9
    ctx4.kv_seq_copy(0, 3, 0, -1)
    assert ctx4.kv_seq_pos_max(3) == 19
    ctx4.kv_seq_copy(0, 0)  # onto itself: a no-op
    assert ctx4.kv_seq_pos_max(0) == 19
    ctx4.decode([5], 10, 2)  # the partial copy continues at its own end
    assert ctx4.kv_seq_pos_max(2) == 10
    assert ctx4.kv_seq_pos_max(0) == 19


def test_remove_trims(ctx4: lloyal.Context) -> None:
    ctx4.decode(list(range(100, 120)), 0, 0)
    ctx4.kv_cache_remove(0, 15)  # [15, end)
    assert ctx4.kv_cache_size(0) == 14
    ctx4.kv_cache_remove(0, 12, -1)
    assert ctx4.kv_cache_size(0) == 11
    ctx4.kv_cache_remove(0, 5, 10)  # a hole: the end stays
    assert ctx4.kv_cache_size(0) == 11
    ctx4.decode([5, 6], 12, 0)  # decoding continues after the trimmed end
    assert ctx4.kv_cache_size(0) == 13
    ctx4.kv_cache_remove(0, 0)
    assert ctx4.kv_cache_size(0) == -1


def test_remove_only_touches_its_sequence(ctx4: lloyal.Context) -> None:
    ctx4.decode(list(range(100, 120)), 0, 0)
    ctx4.kv_seq_copy(0, 1)
    ctx4.kv_cache_remove(1, 5)
    assert ctx4.kv_seq_pos_max(1) == 4
    assert ctx4.kv_seq_pos_max(0) == 19


def test_clear_empties_every_sequence(ctx4: lloyal.Context) -> None:
    for s in range(4):
        ctx4.decode(list(range(100, 105 + s)), 0, s)
    assert [ctx4.kv_seq_pos_max(s) for s in range(4)] == [4, 5, 6, 7]
    ctx4.kv_cache_clear()
    assert [ctx4.kv_seq_pos_max(s) for s in range(4)] == [-1, -1, -1, -1]
    ctx4.decode([2, 100], 0, 3)  # starts over at 0
    assert ctx4.kv_seq_pos_max(3) == 1


@pytest.mark.parametrize("seq_id", [-1, 4, 100])
def test_seq_id_out_of_range(ctx4: lloyal.Context, seq_id: int) -> None:
    ctx4.decode([2, 100], 0, 0)
    for call in (
        lambda: ctx4.kv_seq_pos_max(seq_id),
        lambda: ctx4.kv_cache_size(seq_id),
        lambda: ctx4.kv_cache_remove(seq_id, 0),
        lambda: ctx4.kv_seq_copy(0, seq_id),
        lambda: ctx4.kv_seq_copy(seq_id, 1),
        lambda: ctx4.kv_seq_keep(seq_id),
        lambda: ctx4.decode([5], 0, seq_id),
    ):
        with pytest.raises(ValueError, match="n_seq_max=4"):
            call()
    assert ctx4.kv_seq_pos_max(0) == 1  # nothing changed
    assert [ctx4.kv_seq_pos_max(s) for s in (1, 2, 3)] == [-1, -1, -1]


def test_huge_seq_id_is_a_value_error(ctx4: lloyal.Context) -> None:
    with pytest.raises(ValueError, match="n_seq_max"):
        ctx4.kv_seq_pos_max(2**40)


@pytest.mark.parametrize(("start", "end"), [(5, 2), (-3, -1), (-1, 4), (3, -2)])
def test_invalid_ranges(ctx4: lloyal.Context, start: int, end: int) -> None:
    ctx4.decode(list(range(100, 110)), 0, 0)
    with pytest.raises(ValueError, match="range"):
        ctx4.kv_cache_remove(0, start, end)
    with pytest.raises(ValueError, match="range"):
        ctx4.kv_seq_copy(0, 1, start, end)
    assert ctx4.kv_seq_pos_max(0) == 9
    assert ctx4.kv_seq_pos_max(1) == -1
