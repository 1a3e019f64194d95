"""Context: properties, lifecycle, closed-context errors, option validation."""

from __future__ import annotations

from pathlib import Path

import pytest

import lloyal


def test_properties(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=768, n_batch=128, n_seq_max=3, n_threads=1) as ctx:
        assert (ctx.n_ctx, ctx.n_batch, ctx.n_seq_max, ctx.n_threads) == (768, 128, 3, 1)
        assert ctx.n_vocab == ctx.vocab_size == 262144
        # f16 K and V, 256-wide heads, 1 KV head, 18 layers: 2 * 2 * 256 * 18 bytes per cell.
        assert ctx.memory_size == 768 * 2 * 2 * 256 * 18
        assert not ctx.closed and ctx.flash_attn and not ctx.embeddings
        assert ctx.model.architecture == "gemma3"
    assert ctx.closed


def test_close_is_idempotent_and_everything_after_raises(model: lloyal.Model) -> None:
    ctx = lloyal.Context(model, n_ctx=256)
    ctx.decode([2, 100], 0)
    ctx.close()
    ctx.close()
    for call in (
        lambda: ctx.decode([5], 2),
        lambda: ctx.sample(),
        lambda: ctx.get_logits(),
        lambda: ctx.tokenize("x"),
        lambda: ctx.detokenize([5]),
        lambda: ctx.token_to_text(5),
        lambda: ctx.kv_cache_size(),
        lambda: ctx.kv_cache_clear(),
        lambda: ctx.model_entropy(),
        lambda: ctx.memory_size,
        lambda: lloyal.Branch.create(ctx),
    ):
        with pytest.raises(lloyal.ContextClosedError, match="closed"):
            call()


@pytest.mark.parametrize(
    "options",
    [
        {"n_seq_max": 0},
        {"n_seq_max": 300},
        {"type_k": "f8"},
        {"pooling": "max"},
        {"n_batch": 0},
        {"n_threads": 0},
        {"type_v": "q8_0", "flash_attn": False},
    ],
)
def test_bad_options_raise_value_error(model: lloyal.Model, options: dict[str, object]) -> None:
    with pytest.raises(ValueError) as exc:
        lloyal.Context(model, **options)  # type: ignore[arg-type]
    assert next(iter(options)) in str(exc.value)


def test_create_context_and_path(model_path: Path) -> None:
    with lloyal.create_context(n_ctx=256) as ctx:
        assert ctx.n_ctx == 256
    with lloyal.create_context(model_path, n_ctx=256, n_seq_max=2) as ctx:
        assert ctx.n_seq_max == 2
    with lloyal.Context(str(model_path), n_ctx=256) as ctx:
        assert ctx.model.n_vocab == 262144


def test_two_contexts_are_independent(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256) as a, lloyal.Context(model, n_ctx=256) as b:
        a.decode(a.tokenize("Hello there"), 0)
        assert b.kv_cache_size() == -1
        a.close()
        b.decode([2], 0)
        assert b.kv_cache_size() == 0
