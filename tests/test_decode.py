"""The flat decode path: greedy continuation, logits, chunking, positions, KV-full, rollback."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import exact_model_fixture

import lloyal

model = exact_model_fixture()  # runs compared by ==: batch-invariant, on the CPU on a GPU run too


PROMPT = "The capital of France is Paris. The capital of Germany is"


def greedy(ctx: lloyal.Context, tokens: list[int], n: int, seq_id: int = 0) -> list[int]:
    ctx.decode(tokens, 0, seq_id)
    out, pos = [], len(tokens)
    for _ in range(n):
        t = ctx.sample(temperature=0)
        out.append(t)
        ctx.decode([t], pos, seq_id)
        pos += 1
    return out


def test_greedy_continuation_says_berlin(ctx: lloyal.Context) -> None:
    prompt = ctx.tokenize(PROMPT)
    out = greedy(ctx, prompt, 8)
    assert "Berlin" in ctx.detokenize(out)
    assert ctx.kv_cache_size() == len(prompt) + 8 - 1


def test_logits_shape_dtype_finite_readonly(ctx: lloyal.Context) -> None:
    ctx.decode(ctx.tokenize(PROMPT), 0)
    logits = ctx.get_logits()
    assert isinstance(logits, np.ndarray)
    assert logits.shape == (ctx.n_vocab,) == (262144,)
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert not logits.flags.writeable
    with pytest.raises(ValueError):
        logits[0] = 1.0
    with pytest.raises(ValueError):
        logits += 1.0
    assert int(np.argmax(logits)) == ctx.sample(temperature=0)
    # A copy is writable and does not alias the context's logits.
    mine = logits.copy()
    mine[:] = 0.0
    assert np.array_equal(ctx.get_logits(), logits)


def test_logits_follow_the_last_decode(ctx: lloyal.Context) -> None:
    toks = ctx.tokenize(PROMPT)
    ctx.decode(toks, 0)
    first = ctx.get_logits().copy()
    t = int(np.argmax(first))
    ctx.decode([t], len(toks))
    second = ctx.get_logits()
    assert not np.array_equal(first, second)


def test_logits_before_decode_raise(ctx: lloyal.Context) -> None:
    with pytest.raises(lloyal.LloyalError, match="decode"):
        ctx.get_logits()
    with pytest.raises(lloyal.LloyalError, match="decode"):
        ctx.sample()
    with pytest.raises(lloyal.LloyalError):
        ctx.model_entropy()


def test_decode_is_chunked_by_n_batch(model: lloyal.Model) -> None:
    """600 tokens through n_batch=64 (10 llama_decode calls) give exactly the final logits of
    one n_batch=512 pass (batch-invariant kernels, the default)."""
    tokens = [1000 + (i * 37) % 5000 for i in range(600)]
    with lloyal.Context(model, n_ctx=1024, n_batch=64) as small:
        assert small.n_batch == 64
        small.decode(tokens, 0)
        a = small.get_logits().copy()
        assert small.kv_cache_size() == 599
    with lloyal.Context(model, n_ctx=1024, n_batch=512) as big:
        big.decode(tokens, 0)
        b = big.get_logits()
        assert big.kv_cache_size() == 599
    assert np.array_equal(a, b)


def test_positions(ctx: lloyal.Context) -> None:
    assert ctx.kv_cache_size() == -1
    tokens = ctx.tokenize(PROMPT)
    ctx.decode(tokens, 0)
    assert ctx.kv_cache_size() == ctx.kv_seq_pos_max(0) == len(tokens) - 1
    ctx.decode([5, 6, 7], len(tokens))
    assert ctx.kv_cache_size() == len(tokens) + 2


@pytest.mark.parametrize("offset", [-1, 1, 3, None])
def test_wrong_position_raises_and_changes_nothing(ctx: lloyal.Context, offset: int | None) -> None:
    tokens = ctx.tokenize(PROMPT)
    ctx.decode(tokens, 0)
    before = ctx.get_logits().copy()
    bad = -5 if offset is None else len(tokens) + offset
    with pytest.raises(ValueError, match=f"must be {len(tokens)}"):
        ctx.decode([5, 6], bad)
    assert ctx.kv_cache_size() == len(tokens) - 1
    assert np.array_equal(ctx.get_logits(), before)
    # The right position still works and continues the same sequence.
    t = ctx.sample(temperature=0)
    ctx.decode([t], len(tokens))
    assert ctx.kv_cache_size() == len(tokens)


def test_a_position_past_the_last_a_sequence_holds_is_refused(ctx: lloyal.Context) -> None:
    """Positions near 2**31 would wrap round inside llama.cpp (it then said "positions are
    decreasing"): refused naming the last position, with nothing written."""
    for pos in (2**30, 2**31 - 2):
        with pytest.raises(ValueError, match=f"decode at pos {pos} of 2 tokens would go past position"):
            ctx.decode([5, 6], pos, seq_id=0)
    assert ctx.kv_cache_size() == -1


def test_empty_decode_is_a_no_op(ctx: lloyal.Context) -> None:
    ctx.decode([], 0)  # nothing decoded yet: still no logits
    assert ctx.kv_cache_size() == -1
    with pytest.raises(lloyal.LloyalError):
        ctx.get_logits()
    tokens = ctx.tokenize(PROMPT)
    ctx.decode(tokens, 0)
    before = ctx.get_logits().copy()
    ctx.decode([], 999)  # even at a position that would be wrong
    assert ctx.kv_cache_size() == len(tokens) - 1
    assert np.array_equal(ctx.get_logits(), before)


def test_more_tokens_than_n_ctx_is_kv_cache_full(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256) as ctx:
        with pytest.raises(lloyal.KvCacheFullError) as exc:
            ctx.decode([1000 + i for i in range(300)], 0)
        assert isinstance(exc.value, lloyal.DecodeError)
        assert isinstance(exc.value, lloyal.LloyalError)
        assert "n_ctx=256" in str(exc.value) and "300" in str(exc.value)
        assert ctx.kv_cache_size() == -1  # nothing written
        # The context keeps working afterwards.
        prompt = ctx.tokenize(PROMPT)
        out = greedy(ctx, prompt, 4)
        assert "Berlin" in ctx.detokenize(out)


def test_kv_cache_full_mid_call_rolls_back(model: lloyal.Model) -> None:
    """200 of 256 cells used; 100 more in chunks of 32: the 2nd chunk finds no room. The whole
    call is undone (the first chunk's cells removed), other sequences and the logits are kept,
    and decoding goes on once cells are free."""
    with lloyal.Context(model, n_ctx=256, n_batch=32, n_seq_max=2) as ctx:
        ctx.decode([1000 + i for i in range(200)], 0, 0)
        before = ctx.get_logits().copy()
        with pytest.raises(lloyal.KvCacheFullError, match="n_ctx=256") as exc:
            ctx.decode([2000 + i for i in range(100)], 0, 1)
        assert isinstance(exc.value, lloyal.DecodeError)
        assert ctx.kv_cache_size(1) == -1  # nothing half-written
        assert ctx.kv_cache_size(0) == 199  # the other sequence untouched
        with pytest.raises(lloyal.KvCacheFullError):
            ctx.decode([2000 + i for i in range(100)], 200, 0)
        assert ctx.kv_cache_size(0) == 199
        assert np.array_equal(ctx.get_logits(), before)
        ctx.decode([2000 + i for i in range(40)], 0, 1)  # fits (240 <= 256)
        assert ctx.kv_cache_size(1) == 39
        # Freeing cells makes room again.
        ctx.kv_cache_remove(0, 100)
        assert ctx.kv_cache_size(0) == 99
        ctx.decode([3000 + i for i in range(100)], 40, 1)
        assert ctx.kv_cache_size(1) == 139


def test_invalid_tokens_change_nothing(ctx: lloyal.Context) -> None:
    ctx.decode([2, 100], 0)
    before = ctx.get_logits().copy()
    with pytest.raises(lloyal.InvalidTokenError):
        ctx.decode([5, 262144], 2)
    with pytest.raises(lloyal.InvalidTokenError):
        ctx.decode([-3], 2)
    assert ctx.kv_cache_size() == 1
    assert np.array_equal(ctx.get_logits(), before)


def test_greedy_tokens_identical_across_n_batch_without_flash_attn(model: lloyal.Model) -> None:
    """docs/api.md: greedy output identical for n_batch 32/64/128/512 (exact with flash_attn=False;
    llama.cpp's CPU flash attention rounds differently per batch shape, see README "Numerics")."""
    prompt = [1000 + (i * 53) % 4000 for i in range(150)]
    runs = []
    for n_batch in (32, 64, 128, 512):
        with lloyal.Context(model, n_ctx=512, n_batch=n_batch, flash_attn=False) as ctx:
            b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
            b.prefill(prompt)
            out = []
            for _ in range(16):
                t = b.sample()
                b.commit(t)
                out.append(t)
            runs.append((out, b.perplexity))
    assert all(r[0] == runs[0][0] for r in runs)
    assert all(r[1] == runs[0][1] for r in runs)
