"""Entropy, surprisal and perplexity trackers against numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest

import lloyal

LN2 = math.log(2)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities via log-sum-exp in float64."""
    x = logits.astype(np.float64)
    m = x.max()
    out: np.ndarray = x - (m + np.log(np.exp(x - m).sum()))
    return out


@pytest.fixture(params=["The capital of France is", "Once upon a time, in a small village by the sea,"])
def primed(ctx: lloyal.Context, request: pytest.FixtureRequest) -> lloyal.Context:
    ctx.decode(ctx.tokenize(request.param), 0)
    return ctx


def test_entropy_matches_numpy(primed: lloyal.Context) -> None:
    lp = log_softmax(primed.get_logits())
    h = float(-(np.exp(lp) * lp).sum())
    assert h > 0.0
    assert primed.model_entropy() == pytest.approx(h, rel=1e-4)
    assert primed.model_entropy("nats") == primed.model_entropy()
    assert primed.model_entropy("bits") == pytest.approx(primed.model_entropy("nats") / LN2, rel=1e-9)
    assert primed.model_entropy() <= math.log(primed.n_vocab)


def test_surprisal_matches_numpy(primed: lloyal.Context) -> None:
    logits = primed.get_logits()
    lp = log_softmax(logits)
    order = [int(i) for i in np.argsort(-logits)]
    best = order[0]
    for t in [best, *order[1:4], order[1000], order[-1]]:
        nats = primed.model_surprisal(t)
        assert nats == pytest.approx(-lp[t], rel=1e-4, abs=1e-5)
        assert primed.model_surprisal(t, "nats") == nats
        assert primed.model_surprisal(t, "bits") == pytest.approx(nats / LN2, rel=1e-9)
    # The greedy token is the least surprising.
    others = [*order[1:6], 12345, 200000]
    assert all(primed.model_surprisal(best) < primed.model_surprisal(t) for t in others)
    assert primed.sample(temperature=0) == best


def test_metric_argument_errors(primed: lloyal.Context) -> None:
    with pytest.raises(ValueError, match="dits"):
        primed.model_entropy("dits")
    with pytest.raises(ValueError):
        primed.model_surprisal(5, "dits")
    for bad in (-1, primed.n_vocab):
        with pytest.raises(lloyal.InvalidTokenError):
            primed.model_surprisal(bad)


def test_perplexity_tracker(ctx: lloyal.Context) -> None:
    t = ctx.create_perplexity_tracker()
    assert isinstance(t, lloyal.PerplexityTracker)
    assert math.isinf(t.perplexity) and t.perplexity > 0 and t.count == 0
    t.add_surprisal(math.log(2))
    assert t.perplexity == pytest.approx(2.0)
    t.add_surprisal(math.log(8))
    assert t.count == 2
    assert t.perplexity == pytest.approx(4.0)  # exp(mean(ln 2, ln 8)) = exp(ln 4)
    xs = [0.3, 1.7, 2.2, 0.05]
    for x in xs:
        t.add_surprisal(x)
    assert t.perplexity == pytest.approx(math.exp((math.log(2) + math.log(8) + sum(xs)) / 6))

    for bad in (float("nan"), -0.5):
        with pytest.raises(ValueError, match="surprisal is -log p >= 0"):
            t.add_surprisal(bad)
    assert t.count == 6, "refused values are not counted"

    c = t.clone()
    assert c.count == t.count and c.perplexity == t.perplexity
    c.add_surprisal(10.0)
    assert t.count == 6 and c.count == 7
    assert c.perplexity > t.perplexity

    t.reset()
    assert math.isinf(t.perplexity) and t.count == 0
    assert c.count == 7  # the clone is independent both ways
    assert lloyal.PerplexityTracker().count == 0


def test_perplexity_of_a_greedy_continuation(ctx: lloyal.Context) -> None:
    """Feeding model_surprisal of each generated token gives exp(mean surprisal)."""
    toks = ctx.tokenize("The capital of France is")
    ctx.decode(toks, 0)
    tracker = ctx.create_perplexity_tracker()
    surprisals = []
    pos = len(toks)
    for _ in range(5):
        t = ctx.sample(temperature=0)
        s = ctx.model_surprisal(t)
        surprisals.append(s)
        tracker.add_surprisal(s)
        ctx.decode([t], pos)
        pos += 1
    assert tracker.count == 5
    assert tracker.perplexity == pytest.approx(math.exp(sum(surprisals) / 5))
    assert 1.0 <= tracker.perplexity < 50.0  # greedy tokens are likely ones


def test_sampling_perplexity_is_not_truncated_by_top_k_or_top_p(ctx: lloyal.Context) -> None:
    """docs/concepts.md: sampling_perplexity is taken under penalties, biases and temperature,
    without top-k/top-p/min-p truncation: a token outside the truncated set is finite."""
    params = lloyal.SamplingParams(temperature=2.0, top_k=1, top_p=0.1, min_p=0.9, penalty_last_n=0)
    with lloyal.Branch.create(ctx, 0, params) as b:
        b.prefill(ctx.tokenize("The capital of France is"))
        logits = b.logits
        rare = int(np.argsort(-logits)[1000])  # far outside top-1 / top-p 0.1
        b.commit(rare)
        want = -log_softmax(logits / 2.0)[rare]  # the temperature-2 distribution, untruncated
        assert math.isfinite(b.sampling_perplexity)
        assert math.log(b.sampling_perplexity) == pytest.approx(want, rel=1e-4)
        assert math.log(b.perplexity) == pytest.approx(-log_softmax(logits)[rare], rel=1e-4)


def _sampled_run(model: lloyal.Model, kept: bool) -> tuple[list[int], list[int], float]:
    """Tokens of a sampled branch committed one by one and of its fork through the engine
    (``generate``), and the first one's model perplexity, on a context that keeps sampling
    perplexity or not."""
    params = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=11)
    with lloyal.Context(model, n_ctx=512, n_seq_max=3, sampling_perplexity=kept) as c:
        assert c.sampling_perplexity is kept
        with lloyal.Branch.create(c, 0, params) as b:
            b.prefill(c.tokenize("Once upon a time, in a small village by the sea,"))
            kid = b.fork()
            one_by_one = []
            for _ in range(8):
                one_by_one.append(b.produce().token)
                b.commit(one_by_one[-1])
            engine = [t.token for t in kid.generate(8)]
            if kept:
                assert 1.0 <= b.sampling_perplexity < math.inf and 1.0 <= kid.sampling_perplexity < math.inf
            else:
                for br in (b, kid, b.fork()):
                    with pytest.raises(lloyal.LloyalError, match="sampling_perplexity=True") as err:
                        _ = br.sampling_perplexity
                    assert type(err.value) is lloyal.LloyalError
            return one_by_one, engine, b.perplexity


def test_sampling_perplexity_off_keeps_tokens_and_model_perplexity(exact_model: lloyal.Model) -> None:
    """Context(sampling_perplexity=False): the same tokens for a seed, committed one by one and
    through the engine, and the same model perplexity; reading the sampling perplexity of a
    branch, or of a fork, raises a LloyalError that says how to keep it."""
    kept, off = _sampled_run(exact_model, True), _sampled_run(exact_model, False)
    assert kept[0] == kept[1] and len(kept[0]) == 8  # one by one = the engine, with its own fork
    assert off[:2] == kept[:2]
    assert off[2] == pytest.approx(kept[2], rel=1e-12)


def test_sampling_perplexity_off_survives_save_and_load(exact_model: lloyal.Model) -> None:
    """A branch saved on a context that keeps sampling perplexity and loaded into one that does
    not keeps its model perplexity and raises on the sampling one; back in a keeping context it
    has the value it was saved with."""
    params = lloyal.SamplingParams(temperature=0.8, seed=5)
    with (
        lloyal.Context(exact_model, n_ctx=256) as on,
        lloyal.Context(exact_model, n_ctx=256, sampling_perplexity=False) as off,
    ):
        with lloyal.Branch.create(on, 0, params) as b:
            b.prefill(on.tokenize("The capital of France is"))
            for t in b.generate(3):
                assert t.token >= 0
            data, ppl, sppl = b.save_state(), b.perplexity, b.sampling_perplexity
        with lloyal.Branch.load_state(off, data) as loaded:
            assert loaded.perplexity == pytest.approx(ppl, rel=1e-9)
            with pytest.raises(lloyal.LloyalError, match="does not track sampling perplexity"):
                _ = loaded.sampling_perplexity
            data = loaded.save_state()
        with lloyal.Branch.load_state(on, data) as back:
            assert back.sampling_perplexity == pytest.approx(sppl, rel=1e-9)
