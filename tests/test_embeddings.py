"""Embeddings (docs/api.md, "Context"): encode/get_embeddings/embed on an embeddings context, batching
across sequences, lease and sequence protection, errors. Real default model, small contexts."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import lloyal
from lloyal import Branch, SamplingParams

CAT = "a cat sat on the mat"
KITTEN = "a kitten sat on the rug"
TAX = "quarterly tax filing deadline"


@pytest.fixture
def ectx(model: lloyal.Model) -> Iterator[lloyal.Context]:
    c = lloyal.Context(model, n_ctx=1024, n_batch=512, n_seq_max=4, embeddings=True)
    try:
        yield c
    finally:
        c.close()


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_dimension_and_unit_norm(ectx: lloyal.Context) -> None:
    assert ectx.embedding_dimension == 640
    v = ectx.embed(CAT)
    assert v.shape == (640,) and v.dtype == np.float32
    assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
    raw = ectx.embed(CAT, normalize=False)
    assert float(np.linalg.norm(raw)) > 1.5, "unnormalised vector keeps its scale"
    assert cos(raw, v) > 0.99999


def test_identical_and_related_texts(ectx: lloyal.Context) -> None:
    cat, cat2, kitten, tax = (ectx.embed(t) for t in (CAT, CAT, KITTEN, TAX))
    assert cos(cat, cat2) > 0.99
    assert cos(cat, kitten) > cos(cat, tax) + 0.1
    assert cos(cat, kitten) > cos(kitten, tax) + 0.1


def test_batched_equals_one_by_one(exact_model: lloyal.Model) -> None:
    # The token rows are batch-invariant (the model is not repacked, on the CPU), but llama.cpp
    # pools them with a matmul over every row of the decode, whose sums round in the last bit:
    # max |diff| ~1e-9 on unit vectors, so 1 - cosine < 1e-6.
    with lloyal.Context(exact_model, n_ctx=1024, n_batch=512, n_seq_max=4, embeddings=True) as ectx:
        batched_equals_one_by_one(ectx)


def batched_equals_one_by_one(ectx: lloyal.Context) -> None:
    assert ectx.batch_invariant
    texts = [CAT, KITTEN, TAX, "hello", CAT]
    batched = ectx.embed(texts)
    assert batched.shape == (5, 640)
    for row, text in zip(batched, texts, strict=True):
        assert cos(row, ectx.embed(text)) > 1 - 1e-6
    assert cos(batched[0], batched[4]) > 1 - 1e-6
    # More texts than sequences (n_seq_max=4): several decodes, same results, order kept.
    many = ectx.embed(texts * 2)
    assert many.shape == (10, 640)
    for i in range(10):
        assert cos(many[i], batched[i % 5]) > 1 - 1e-6
    assert ectx.embed([]).shape == (0, 640)
    for seq in range(4):
        assert ectx.kv_seq_pos_max(seq) == -1, "embed leaves its sequences empty"


def test_encode_and_get_embeddings(ectx: lloyal.Context) -> None:
    tokens = ectx.tokenize(CAT)
    ectx.encode(tokens)
    v = ectx.get_embeddings()
    assert v.shape == (640,)
    assert cos(v, ectx.embed(CAT)) > 0.999
    assert ectx.kv_seq_pos_max(0) == -1
    ectx.encode(ectx.tokenize(TAX), seq_id=2)
    assert cos(ectx.get_embeddings(seq_id=0), v) > 0.99999, "seq 0 keeps its own vectors"
    assert cos(ectx.get_embeddings(seq_id=2), ectx.embed(TAX)) > 0.999
    raw = ectx.get_embeddings(normalize=False)
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 0.5
    with pytest.raises(ValueError, match="encode"):
        ectx.get_embeddings(seq_id=1)


def test_pooling_none_and_last(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256, n_batch=64, embeddings=True, pooling="none") as c:
        tokens = c.tokenize(CAT)
        c.encode(tokens)
        rows = c.get_embeddings()
        assert rows.shape == (len(tokens), 640)
        assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
        long = c.tokenize(" ".join([CAT] * 20))
        assert len(long) > 64
        c.encode(long)  # chunked: every token keeps its row
        assert c.get_embeddings().shape == (len(long), 640)
        with pytest.raises(ValueError, match="pooling"):
            c.embed(CAT)
    with lloyal.Context(model, n_ctx=256, n_batch=64, embeddings=True, pooling="last") as c:
        c.encode(tokens)
        assert cos(c.get_embeddings(), rows[-1]) > 0.999, "last pooling = last token's row"


def test_errors(model: lloyal.Model, ectx: lloyal.Context) -> None:
    with pytest.raises(ValueError, match="pooling applies to embeddings contexts"):
        lloyal.Context(model, n_ctx=256, pooling="cls")  # was accepted and ignored
    with lloyal.Context(model, n_ctx=256) as plain:
        for call in (
            lambda: plain.encode([2, 3]),
            lambda: plain.get_embeddings(),
            lambda: plain.embed("x"),
        ):
            with pytest.raises(ValueError, match="embeddings=True"):
                call()
    with pytest.raises(ValueError, match="empty"):
        ectx.encode([])
    with pytest.raises(lloyal.InvalidTokenError):
        ectx.encode([2, 10**7])
    with pytest.raises(ValueError, match="n_seq_max"):
        ectx.encode([2, 3], seq_id=9)
    with pytest.raises(ValueError, match="n_batch=512"):
        ectx.encode([2] * 513)
    with pytest.raises(ValueError, match="n_batch=512"):
        ectx.embed(["ok", "word " * 600])
    ectx.close()
    for call in (
        lambda: ectx.encode([2, 3]),
        lambda: ectx.get_embeddings(),
        lambda: ectx.embed("x"),
        lambda: ectx.embedding_dimension,
    ):
        with pytest.raises(lloyal.ContextClosedError):
            call()


def test_leases_and_other_sequences_untouched(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=512, n_batch=510, n_seq_max=3, embeddings=True) as c:
        prompt = c.tokenize("The quick brown fox")
        c.decode(prompt, 0, seq_id=1)  # a flat-path sequence embed must not disturb
        branch = Branch.create(c, 0, SamplingParams(temperature=0))  # leases seq 0
        with pytest.raises(lloyal.SeqLeasedError):
            c.encode([2, 3], seq_id=0)
        v = c.embed([CAT, KITTEN, TAX])  # only seq 2 is free: three decodes
        assert v.shape == (3, 640)
        assert cos(v[0], v[1]) > cos(v[0], v[2])
        assert c.kv_seq_pos_max(1) == len(prompt) - 1, "flat sequence untouched"
        assert c.kv_seq_pos_max(2) == -1
        c.kv_cache_remove(1, 0)
        c.decode(prompt, 0, seq_id=1)
        c.decode(prompt, 0, seq_id=2)
        with pytest.raises(lloyal.SeqLeasedError):
            c.embed(CAT)  # no empty unleased sequence, and a branch holds seq 0
        branch.prune()
        c.kv_cache_remove(1, 0)
        assert c.embed(CAT).shape == (640,)
        assert c.kv_seq_pos_max(2) == len(prompt) - 1


def test_texts_are_packed_within_the_cells_left(model: lloyal.Model) -> None:
    """156 cells left (100 held by a flat-path sequence): two 101-token texts each fit, together
    they do not. They were packed into one 202-token decode and failed with KvCacheFullError;
    they now go in two decodes. A run longer than the whole cache (pooling none) is refused up
    front rather than after the chunks that fit."""
    with lloyal.Context(model, n_ctx=256, n_batch=256, n_seq_max=4, embeddings=True) as c:
        held = c.tokenize("word " * 99)
        c.decode(held, 0, 0)
        text = "word " * 99
        one = c.embed(text)
        both = c.embed([text, text])
        assert both.shape == (2, 640) and np.allclose(both[0], one, atol=1e-5)
        assert c.kv_seq_pos_max(0) == len(held) - 1, "the flat sequence is untouched"
    with lloyal.Context(model, n_ctx=256, n_batch=64, embeddings=True, pooling="none") as c:
        t0 = time.monotonic()
        with pytest.raises(
            lloyal.KvCacheFullError, match=r"300 cells needed .*more tokens than the whole cache"
        ):
            c.encode(c.tokenize("word " * 400)[:300])
        assert time.monotonic() - t0 < 1.0


def test_mean_pooling_needs_n_batch_multiple_of_n_seq_max(model: lloyal.Model) -> None:
    # llama.cpp would abort the process on this shape (mean-pooling graph reservation); the
    # hint stays within n_ctx (513 would be taken down to 512 again)
    with pytest.raises(ValueError, match=r"try n_batch=510$"):
        lloyal.Context(model, n_ctx=512, n_batch=512, n_seq_max=3, embeddings=True)
    with pytest.raises(ValueError, match=r"try n_batch=12$"):
        lloyal.Context(model, n_ctx=512, n_batch=10, n_seq_max=3, embeddings=True)
    # an n_batch above n_ctx (the default 512 too), which llama.cpp takes down to n_ctx: lloyal
    # takes it down to a multiple of n_seq_max (the process aborted on all three)
    for n_ctx, n_batch, n_seq_max, expect in ((256, 513, 3, 255), (250, 512, 4, 248), (300, 512, 8, 296)):
        with lloyal.Context(model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, embeddings=True) as c:
            assert c.n_batch == expect
            assert c.embed(["a", "b c"]).shape == (2, 640)
    with pytest.raises(ValueError, match=r"n_ctx \(8\) must be at least n_seq_max \(16\)"):
        lloyal.Context(model, n_ctx=8, n_seq_max=16, embeddings=True)
    with lloyal.Context(model, n_ctx=512, n_seq_max=3, embeddings=True, pooling="last") as c:
        assert c.embed(["a", "b"]).shape == (2, 640)
