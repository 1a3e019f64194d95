"""Entropy, surprisal and perplexity trackers against numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest

import lloyal


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def test_entropy_and_surprisal(ctx: lloyal.Context) -> None:
    ctx.decode(ctx.tokenize("The capital of France is"), 0)
    logits = ctx.get_logits()
    lp = log_softmax(logits)
    h = float(-(np.exp(lp) * lp).sum())
    assert ctx.model_entropy() == pytest.approx(h, rel=1e-4)
    assert ctx.model_entropy("bits") == pytest.approx(ctx.model_entropy("nats") / math.log(2), rel=1e-9)
    best = int(np.argmax(logits))
    assert ctx.model_surprisal(best) == pytest.approx(-lp[best], rel=1e-4, abs=1e-5)
    assert ctx.model_surprisal(best, "bits") == pytest.approx(
        ctx.model_surprisal(best) / math.log(2), rel=1e-9
    )
    others = [int(i) for i in np.argsort(logits)[-6:-1]]
    assert all(ctx.model_surprisal(best) <= ctx.model_surprisal(t) for t in others)
    with pytest.raises(ValueError):
        ctx.model_entropy("dits")
    with pytest.raises(lloyal.InvalidTokenError):
        ctx.model_surprisal(-1)


def test_perplexity_tracker(ctx: lloyal.Context) -> None:
    t = ctx.create_perplexity_tracker()
    assert math.isinf(t.perplexity) and t.count == 0
    t.add_surprisal(math.log(2))
    t.add_surprisal(math.log(8))
    assert t.perplexity == pytest.approx(4.0)
    c = t.clone()
    c.add_surprisal(0.0)
    assert t.count == 2 and c.count == 3
    t.reset()
    assert math.isinf(t.perplexity)
    assert lloyal.PerplexityTracker().count == 0
