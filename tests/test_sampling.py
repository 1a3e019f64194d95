"""Sampling: every SamplingParams field is honoured and validated."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import lloyal
from lloyal import Dry, Mirostat, SamplingParams, Xtc

PROMPT = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture
def primed(ctx: lloyal.Context) -> lloyal.Context:
    ctx.decode(ctx.tokenize(PROMPT), 0)
    return ctx


def argmax(ctx: lloyal.Context) -> int:
    return int(np.argmax(ctx.get_logits()))


def draws(ctx: lloyal.Context, n: int, **params: object) -> list[int]:
    """n samples from the same logits (no decode in between), fresh sampler state."""
    ctx.reset_sampler()
    return [ctx.sample(**params) for _ in range(n)]


def test_greedy_and_top_k_1(primed: lloyal.Context) -> None:
    best = argmax(primed)
    assert primed.sample(temperature=0) == best
    assert draws(primed, 5, temperature=1.5, top_k=1, seed=3) == [best] * 5


def test_seed_reproduces_and_differs(primed: lloyal.Context) -> None:
    kw = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    a = draws(primed, 20, seed=11, **kw)
    b = draws(primed, 20, seed=11, **kw)
    c = draws(primed, 20, seed=12, **kw)
    assert a == b
    assert a != c
    assert len(set(a)) > 1, "temperature 1.5 over the full vocabulary varies"


def test_tiny_top_p_and_full_min_p_are_greedy(primed: lloyal.Context) -> None:
    best = argmax(primed)
    assert draws(primed, 5, temperature=2.0, top_k=0, top_p=1e-6, min_p=0.0, seed=1) == [best] * 5
    assert draws(primed, 5, temperature=2.0, top_k=0, top_p=1.0, min_p=1.0, seed=1) == [best] * 5
    assert (
        draws(primed, 5, temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1e-6, seed=1) == [best] * 5
    )


def test_repeat_penalty_pushes_a_token_away(primed: lloyal.Context) -> None:
    best = argmax(primed)
    primed.reset_sampler()
    assert primed.sample(temperature=0) == best  # now best is in the history
    assert primed.sample(temperature=0, repeat_penalty=100.0, penalty_last_n=64) != best
    primed.reset_sampler()
    assert primed.sample(temperature=0, repeat_penalty=100.0) == best  # empty history: no effect


def test_presence_and_frequency_penalties(primed: lloyal.Context) -> None:
    best = argmax(primed)
    primed.reset_sampler()
    primed.sample(temperature=0)
    assert primed.sample(temperature=0, presence_penalty=1000.0) != best
    assert primed.sample(temperature=0, frequency_penalty=1000.0) != best
    assert primed.sample(temperature=0, frequency_penalty=1000.0, penalty_last_n=0) == best


def test_mirostat_dry_xtc_are_used(primed: lloyal.Context) -> None:
    for version in (1, 2):
        out = draws(primed, 10, mirostat=Mirostat(version=version, tau=3.0, eta=0.1), seed=5)
        assert all(0 <= t < primed.n_vocab for t in out)
        assert out == draws(primed, 10, mirostat=Mirostat(version=version, tau=3.0, eta=0.1), seed=5)
    # XTC with probability 1 and threshold 0 removes every top choice but the least likely
    # of them, so the argmax can never come out.
    best = argmax(primed)
    xtc = draws(
        primed, 10, temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, xtc=Xtc(probability=1.0, threshold=0.0)
    )
    assert best not in xtc
    dry = draws(primed, 3, temperature=0, dry=Dry(multiplier=0.8))
    assert all(0 <= t < primed.n_vocab for t in dry)


def test_params_object_and_overrides_merge(primed: lloyal.Context) -> None:
    p = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=4)
    a = draws(primed, 8, **{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})
    primed.reset_sampler()
    b = [primed.sample(p) for _ in range(8)]
    assert a == b
    best = argmax(primed)
    assert primed.sample(p, top_k=1) == best


def test_validation() -> None:
    for bad in (
        {"top_k": -1},
        {"top_p": 2.0},
        {"min_p": -0.1},
        {"repeat_penalty": 0.0},
        {"typical_p": 0.0},
        {"temperature": float("nan")},
        {"penalty_last_n": -2},
        {"mirostat": Mirostat(version=3)},
        {"xtc": Xtc(probability=2.0)},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # type: ignore[misc]  # keyword-only
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_k = 3  # type: ignore[misc]
    assert p.replace(top_k=3).top_k == 3
    assert SamplingParams(temperature=0).is_greedy


def test_unknown_override_is_a_type_error(primed: lloyal.Context) -> None:
    with pytest.raises(TypeError, match="top_kk"):
        primed.sample(top_kk=3)
    with pytest.raises(ValueError):
        primed.sample(top_k=-5)
