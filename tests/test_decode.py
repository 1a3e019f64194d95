"""The flat decode path: greedy continuation, logits, chunking, positions, KV-full, rollback."""

from __future__ import annotations

import numpy as np
import pytest

import lloyal

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
    out = greedy(ctx, ctx.tokenize(PROMPT), 8)
    assert "Berlin" in ctx.detokenize(out)


def test_logits_shape_dtype_finite_readonly(ctx: lloyal.Context) -> None:
    ctx.decode(ctx.tokenize(PROMPT), 0)
    logits = ctx.get_logits()
    assert logits.shape == (ctx.n_vocab,)
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()
    with pytest.raises(ValueError):
        logits[0] = 1.0
    assert int(np.argmax(logits)) == ctx.sample(temperature=0)


def test_logits_before_decode_raise(ctx: lloyal.Context) -> None:
    with pytest.raises(lloyal.LloyalError, match="decode"):
        ctx.get_logits()
    with pytest.raises(lloyal.LloyalError):
        ctx.sample()


def test_decode_is_chunked_by_n_batch(model: lloyal.Model) -> None:
    tokens = [1000 + (i * 37) % 5000 for i in range(600)]
    with lloyal.Context(model, n_ctx=1024, n_batch=64, flash_attn=False) as small:
        small.decode(tokens, 0)
        a = small.get_logits().copy()
        assert small.kv_cache_size() == 599
    with lloyal.Context(model, n_ctx=1024, n_batch=512, flash_attn=False) as big:
        big.decode(tokens, 0)
        b = big.get_logits()
    assert np.allclose(a, b, atol=1e-3)


def test_positions_and_wrong_position(ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize(PROMPT)
    ctx.decode(tokens, 0)
    assert ctx.kv_cache_size() == len(tokens) - 1
    before = ctx.get_logits().copy()
    with pytest.raises(ValueError, match=f"must be {len(tokens)}"):
        ctx.decode([5], len(tokens) + 3)
    assert ctx.kv_cache_size() == len(tokens) - 1
    assert np.array_equal(ctx.get_logits(), before)
    ctx.decode([], 999)  # empty decode: no-op
    assert ctx.kv_cache_size() == len(tokens) - 1


def test_kv_cache_full(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256, n_seq_max=2) as ctx:
        ctx.decode(list(range(1000, 1200)), 0, 0)
        with pytest.raises(lloyal.KvCacheFullError) as exc:
            ctx.decode(list(range(1000, 1100)), 0, 1)
        assert isinstance(exc.value, lloyal.DecodeError)
        assert "n_ctx=256" in str(exc.value)
        assert ctx.kv_cache_size(1) == -1  # nothing half-written
        with pytest.raises(lloyal.KvCacheFullError):
            ctx.decode(list(range(300)), 0, 1)  # more than the whole cache
        ctx.kv_cache_remove(0, 100)
        ctx.decode(list(range(1000, 1100)), 0, 1)  # works again after freeing cells
        assert ctx.kv_cache_size(1) == 99


def test_invalid_tokens_change_nothing(ctx: lloyal.Context) -> None:
    ctx.decode([2, 100], 0)
    with pytest.raises(lloyal.InvalidTokenError):
        ctx.decode([5, 262144], 2)
    with pytest.raises(lloyal.InvalidTokenError):
        ctx.decode([-3], 2)
    assert ctx.kv_cache_size() == 1
