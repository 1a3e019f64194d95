"""Sampling: every SamplingParams field is honoured and validated (docs/api.md, "Sampling").

Most tests draw several times from the same logits (no decode in between). ``ctx.sample``
accepts each drawn token into the flat sampler's history, which is how penalty history is
filled; ``reset_sampler()`` forgets it (and the RNG state).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import lloyal
from lloyal import Dry, Mirostat, SamplingParams, Xtc

PROMPT = "Once upon a time, in a small village by the sea, there lived"
FULL = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}  # no truncation: the whole vocabulary


@pytest.fixture
def primed(ctx: lloyal.Context) -> lloyal.Context:
    ctx.decode(ctx.tokenize(PROMPT), 0)
    return ctx


def ranked(ctx: lloyal.Context) -> list[int]:
    """Token ids by descending logit (ties: lower id first, like argmax)."""
    return [int(i) for i in np.argsort(-ctx.get_logits(), kind="stable")[:10]]


def draws(ctx: lloyal.Context, n: int, **params: object) -> list[int]:
    """n samples from the same logits, fresh sampler state."""
    ctx.reset_sampler()
    return [ctx.sample(**params) for _ in range(n)]


def generate(ctx: lloyal.Context, n: int, **params: object) -> list[int]:
    """Greedy-loop generation from PROMPT with the flat path, fresh KV and sampler."""
    ctx.kv_cache_clear()
    ctx.reset_sampler()
    toks = ctx.tokenize(PROMPT)
    ctx.decode(toks, 0)
    pos, out = len(toks), []
    for _ in range(n):
        t = ctx.sample(**params)
        out.append(t)
        ctx.decode([t], pos)
        pos += 1
    return out


def test_sampled_tokens_are_valid(primed: lloyal.Context) -> None:
    out = draws(primed, 20, temperature=1.0, seed=0)
    assert all(isinstance(t, int) and 0 <= t < primed.n_vocab for t in out)
    # Defaults (top_k=40, top_p=0.95, min_p=0.05) keep only a handful of candidates here.
    assert set(out) <= set(ranked(primed))


def test_greedy_is_argmax_and_top_k_1_equals_greedy(primed: lloyal.Context) -> None:
    best = ranked(primed)[0]
    assert primed.sample(temperature=0) == best
    assert primed.sample(temperature=-1.0) == best  # temperature <= 0 is greedy
    assert SamplingParams(temperature=0).is_greedy
    assert draws(primed, 5, temperature=1.5, top_k=1, seed=3) == [best] * 5
    # Over a whole generation, top_k=1 sampling at temperature 1 is the greedy sequence.
    greedy = generate(primed, 8, temperature=0)
    assert generate(primed, 8, temperature=1.0, top_k=1, seed=7) == greedy


def test_seed_reproduces_and_differs(primed: lloyal.Context) -> None:
    kw = {"temperature": 1.0, **FULL}
    a = draws(primed, 20, seed=11, **kw)
    b = draws(primed, 20, seed=11, **kw)
    c = draws(primed, 20, seed=12, **kw)
    assert a == b
    assert a != c
    assert len(set(a)) > 1, "temperature 1 over the full vocabulary varies"


def test_temperature_is_honoured(primed: lloyal.Context) -> None:
    """A hotter distribution spreads draws over more distinct tokens."""
    cold = draws(primed, 30, temperature=0.3, seed=5, **FULL)
    hot = draws(primed, 30, temperature=3.0, seed=5, **FULL)
    assert len(set(hot)) > len(set(cold))
    assert len(set(hot)) >= 10


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_alone_draws_the_chains_tokens(ctx: lloyal.Context, top_p: float) -> None:
    """Top-p with no other filter is cut straight from the row (sampler/top_p.rs replays the
    chain's f32 softmax); XTC with a threshold above 0.5 (which removes nothing and draws no
    random number) sends the same request through llama.cpp's chain. The same seed must give the
    same tokens, on real rows, at a temperature that spreads the draws over the whole nucleus,
    and with penalties (replaced logits)."""
    prompts = [PROMPT, "I think that", "The best way to learn a new language is"]
    settings = [{"temperature": 1.0}, {"temperature": 50.0}, {"temperature": 2.0, "repeat_penalty": 1.5}]
    for prompt in prompts:
        ctx.kv_cache_clear()
        ctx.decode(ctx.tokenize(prompt), 0)
        for extra in settings:
            params = {"top_k": 0, "top_p": top_p, "seed": 5, **extra}
            fast = draws(ctx, 60, **params, min_p=0.0)
            chain = draws(ctx, 60, **params, min_p=0.0, xtc=Xtc(probability=1.0, threshold=1.0))
            assert fast == chain, (prompt, extra)
    # the spread draws met many tokens of the last row's nucleus, not only its best one
    assert len(set(fast)) > 1


def test_a_ban_bans_an_infinite_logit_on_every_path(ctx: lloyal.Context) -> None:
    """A -inf bias on a +inf logit bans it (their sum was NaN: the draw over the whole row
    treated it as banned, llama.cpp's chain as a weight that broke every draw into its last
    token); banning every token the row leaves is an error, not the first banned token."""
    row = np.random.default_rng(9).normal(0, 3, ctx.n_vocab).astype(np.float32)
    row[777] = np.inf
    noop = Xtc(probability=1.0, threshold=1.0)  # XTC off (threshold > 0.5): the chain runs

    def run(**params: object) -> list[int]:
        with lloyal.Branch.create(ctx, 0, SamplingParams(top_k=0, min_p=0.0, seed=1, **params)) as b:  # type: ignore[arg-type]
            b.set_logits(row)
            b.set_logit_bias({777: float("-inf")})
            out = []
            for _ in range(8):
                out.append(b.produce().token)
                b.accept(out[-1])
            return out

    for params in ({"temperature": 1.0, "top_p": 1.0}, {"temperature": 1.0, "top_p": 0.9}):
        fast, chain = run(**params), run(**params, xtc=noop)
        assert fast == chain and 777 not in fast and len(set(fast)) > 4, params
    only = np.full(ctx.n_vocab, -np.inf, np.float32)
    only[[5, 9]] = [0.0, -1.0]
    with lloyal.Branch.create(ctx, 0, SamplingParams(temperature=1.0, seed=1)) as b:
        b.set_logits(only)
        b.set_logit_bias({5: float("-inf"), 9: float("-inf")})
        with pytest.raises(ValueError, match="banned by the logit bias"):
            b.produce()


def test_tiny_top_p_min_p_1_and_tiny_typical_p_are_greedy(primed: lloyal.Context) -> None:
    best = ranked(primed)[0]
    hot = {"temperature": 3.0, "seed": 1}
    assert len(set(draws(primed, 8, **hot, **FULL))) > 1  # untruncated: varied
    assert draws(primed, 8, **hot, **{**FULL, "top_p": 1e-6}) == [best] * 8
    assert draws(primed, 8, **hot, **{**FULL, "min_p": 1.0}) == [best] * 8
    # Locally typical sampling keeps the token whose surprisal is closest to the entropy
    # (computed on the untempered logits: typical_p runs before temperature in the chain).
    x = primed.get_logits().astype(np.float64)
    logp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    entropy = -(np.exp(logp) * logp).sum()
    typical = int(np.argmin(np.abs(-logp - entropy)))
    assert draws(primed, 8, **hot, **FULL, typical_p=1e-6) == [typical] * 8


def test_top_k_limits_candidates(primed: lloyal.Context) -> None:
    top3 = set(ranked(primed)[:3])
    out = draws(primed, 30, temperature=5.0, top_k=3, top_p=1.0, min_p=0.0, seed=2)
    assert set(out) <= top3
    assert len(set(out)) > 1


def test_repeat_penalty_pushes_a_repeated_token_away(primed: lloyal.Context) -> None:
    best = ranked(primed)[0]
    primed.reset_sampler()
    assert primed.sample(temperature=0, repeat_penalty=100.0) == best  # empty history: no effect
    # best is now in the history: a strong repeat penalty makes it lose.
    other = primed.sample(temperature=0, repeat_penalty=100.0, penalty_last_n=64)
    assert other != best
    assert other in ranked(primed)
    # penalty_last_n=1 looks only at the last token (other), so best is free again.
    assert primed.sample(temperature=0, repeat_penalty=100.0, penalty_last_n=1) == best
    # penalty_last_n=0 disables penalties.
    assert primed.sample(temperature=0, repeat_penalty=100.0, penalty_last_n=0) == best
    # Penalties never modify the logits the context exposes.
    assert ranked(primed)[0] == best


def test_presence_and_frequency_penalties(primed: lloyal.Context) -> None:
    best = ranked(primed)[0]
    primed.reset_sampler()
    primed.sample(temperature=0)
    assert primed.sample(temperature=0, presence_penalty=1000.0) != best
    assert primed.sample(temperature=0, frequency_penalty=1000.0) != best
    assert primed.sample(temperature=0, frequency_penalty=1000.0, penalty_last_n=0) == best


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_is_honoured(primed: lloyal.Context, version: int) -> None:
    best = ranked(primed)[0]
    # Plain sampling at temperature 3 over the whole vocabulary is all over the place ...
    assert len(set(draws(primed, 12, temperature=3.0, seed=3, **FULL))) > 6
    # ... a tiny mirostat target surprise truncates to the single most likely token ...
    tight = Mirostat(version=version, tau=1e-3, eta=0.1)
    assert draws(primed, 12, temperature=3.0, mirostat=tight, seed=3, **FULL) == [best] * 12
    # ... and mirostat replaces top-k: top_k=1 does not make a high-tau mirostat greedy.
    loose = Mirostat(version=version, tau=10.0, eta=0.1)
    out = draws(primed, 12, temperature=3.0, top_k=1, mirostat=loose, seed=3)
    assert len(set(out)) > 1
    assert all(0 <= t < primed.n_vocab for t in out)
    assert draws(primed, 12, temperature=3.0, top_k=1, mirostat=loose, seed=3) == out  # seeded
    assert not SamplingParams(temperature=0, mirostat=loose).is_greedy


def test_xtc_is_honoured(primed: lloyal.Context) -> None:
    """XTC with probability 1 and threshold 0 removes every top choice above the threshold
    but the least likely of them: after top_k=5 only the 5th best token remains."""
    order = ranked(primed)
    kw = {"temperature": 1.0, "top_k": 5, "top_p": 1.0, "min_p": 0.0}
    without = draws(primed, 10, seed=4, **kw)
    assert order[0] in without
    out = draws(primed, 10, seed=4, xtc=Xtc(probability=1.0, threshold=0.0), **kw)
    assert out == [order[4]] * 10
    # probability 0 disables it.
    assert draws(primed, 10, seed=4, xtc=Xtc(probability=0.0, threshold=0.0), **kw) == without


def test_dry_is_honoured_with_a_window(primed: lloyal.Context) -> None:
    """DRY penalises a token that would extend a sequence repeated in the history."""
    best = ranked(primed)[0]
    primed.reset_sampler()
    history = [primed.sample(temperature=0) for _ in range(6)]
    assert history == [best] * 6
    # best would extend the run "best best ..." once more: DRY pushes it away.
    assert primed.sample(temperature=0, dry=Dry(multiplier=50.0, penalty_last_n=64)) != best
    # multiplier 0 disables it.
    primed.reset_sampler()
    for _ in range(6):
        primed.sample(temperature=0)
    assert primed.sample(temperature=0, dry=Dry(multiplier=0.0, penalty_last_n=64)) == best


def test_dry_default_window_is_honoured(primed: lloyal.Context) -> None:
    best = ranked(primed)[0]
    primed.reset_sampler()
    assert [primed.sample(temperature=0) for _ in range(6)] == [best] * 6
    assert primed.sample(temperature=0, dry=Dry(multiplier=50.0)) != best


def test_a_dry_sampler_made_again_is_a_copy_that_samples_the_same(model: lloyal.Model) -> None:
    """Making a DRY sampler scans the vocabulary for each breaker (~48 ms for the default four):
    a second one with the same settings is a copy of the first, and branches sampling with
    either (and the same seed) draw the same tokens; DRY is on in both (another multiplier draws
    other ones)."""
    prompt = "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat"

    def run(dry: Dry) -> list[int]:
        with lloyal.Context(model, n_ctx=256, n_threads=2) as ctx:
            b = lloyal.Branch.create(ctx, 0, SamplingParams(temperature=0.8, seed=3, dry=dry))
            b.prefill(ctx.tokenize(prompt))
            return [t.token for t in b.generate(24)]

    only_here = Dry(multiplier=50.0, sequence_breakers=("\n", "zq-test"))  # made in this test first
    made, copied = run(only_here), run(only_here)
    assert made == copied
    assert made != run(Dry(multiplier=0.0, sequence_breakers=("\n", "zq-test")))


def test_params_object_and_overrides_merge(primed: lloyal.Context) -> None:
    p = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=4)
    a = draws(primed, 8, **{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})
    primed.reset_sampler()
    b = [primed.sample(p) for _ in range(8)]
    primed.reset_sampler()
    c = [primed.sample(params=p) for _ in range(8)]
    assert a == b == c
    assert len(set(a)) > 1
    best = ranked(primed)[0]
    # Overrides win over the params object; the other fields of the object still apply.
    primed.reset_sampler()
    assert [primed.sample(p, top_k=1) for _ in range(5)] == [best] * 5
    primed.reset_sampler()
    assert [primed.sample(p, temperature=0) for _ in range(5)] == [best] * 5
    # seed comes from p when not overridden: the override changes only what it names.
    primed.reset_sampler()
    assert [primed.sample(p, top_p=1.0) for _ in range(8)] == a
    primed.reset_sampler()
    assert [primed.sample(p, seed=5) for _ in range(8)] != a


def test_validation() -> None:
    for bad in (
        {"top_k": -1},
        {"top_p": 2.0},
        {"top_p": -0.1},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"repeat_penalty": 0.0},
        {"repeat_penalty": -1.0},
        {"typical_p": 0.0},
        {"temperature": float("nan")},
        {"penalty_last_n": -2},
        {"mirostat": Mirostat(version=3)},
        {"mirostat": Mirostat(tau=0.0)},
        {"xtc": Xtc(probability=2.0)},
        {"dry": Dry(base=0.5)},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    SamplingParams(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, penalty_last_n=-1)  # edges are valid
    # llama.cpp allocated this window at once (2**31 tokens: an abort)
    with pytest.raises(ValueError, match=r"dry penalty_last_n must be in -1\.\.=1048576"):
        SamplingParams(dry=Dry(multiplier=0.8, penalty_last_n=2**31 - 1))
    SamplingParams(dry=Dry(multiplier=0.8, penalty_last_n=2**20))
    # a number or a flag is not "off" read as the sampler with its defaults, turned on
    for part, bad in (("mirostat", 0), ("mirostat", False), ("mirostat", 1), ("dry", 5), ("xtc", "on")):
        with pytest.raises(TypeError, match=rf"{part} must be a lloyal\.\w+, a dict of its fields, or None"):
            SamplingParams(**{part: bad})
    assert SamplingParams(mirostat={"version": 1}).mirostat == {"version": 1}


def test_frozen_and_keyword_only() -> None:
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Mirostat(2)  # type: ignore[call-arg]
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_k = 3  # type: ignore[misc]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p) == (0.8, 40, 0.95, 0.05, 1.0)
    penalties = (p.repeat_penalty, p.frequency_penalty, p.presence_penalty, p.penalty_last_n)
    assert penalties == (1.0, 0.0, 0.0, 64)
    assert (p.seed, p.mirostat, p.dry, p.xtc) == (None, None, None, None)
    q = p.replace(top_k=3)
    assert q.top_k == 3 and p.top_k == 40
    with pytest.raises(ValueError):
        p.replace(top_k=-3)
    assert hash(p) == hash(SamplingParams()) and p == SamplingParams()


def test_sampling_parameters_of_another_type_are_refused(primed: lloyal.Context) -> None:
    """Anything but a SamplingParams or a dict would be read as the defaults (random sampling
    where greedy was meant): a number, a string, a list, the class itself, a namespace."""
    from types import SimpleNamespace

    for bad, named in (
        (0.0, "float"),
        ("greedy", "str"),
        ([("temperature", 0)], "list"),
        (SamplingParams, "the class"),
        (SimpleNamespace(temperature=0.0), "SimpleNamespace"),
    ):
        with pytest.raises(TypeError, match=rf"must be a lloyal\.SamplingParams or a dict.*{named}"):
            primed.sample(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"must be a lloyal\.SamplingParams"):
            lloyal.Branch.create(primed, 0, bad)  # type: ignore[arg-type]
    assert lloyal.BranchStore(primed).available == 1  # the refused creates took no lease


def test_unknown_or_bad_override(primed: lloyal.Context) -> None:
    with pytest.raises(TypeError, match="top_kk"):
        primed.sample(top_kk=3)
    with pytest.raises(TypeError, match="top_kk"):
        primed.sample(SamplingParams(), top_kk=3)
    with pytest.raises(ValueError):
        primed.sample(top_k=-5)
    with pytest.raises(ValueError):
        primed.sample(SamplingParams(), top_p=7.0)
    with pytest.raises(ValueError):
        primed.sample(mirostat=Mirostat(version=3))
    with pytest.raises(TypeError):
        primed.sample(top_k="many")


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("repeatPenalty", "repeat_penalty"),
        ("topK", "top_k"),
        ("penaltyLastN", "penalty_last_n"),
        ("penalties", "repeat_penalty, frequency_penalty, presence_penalty, penalty_last_n"),
        ("advanced", "typical_p, mirostat, dry, xtc"),
        ("top_kk", "valid keys: temperature"),
    ],
)
def test_unknown_dict_key_is_refused_with_its_name(primed: lloyal.Context, key: str, hint: str) -> None:
    params = {"temperature": 0, key: 1.1}
    with pytest.raises(ValueError, match=rf"unknown sampling parameter key '{key}'") as err:
        primed.sample(params)
    assert hint in str(err.value)
    with pytest.raises(ValueError, match=key), lloyal.Branch.create(primed, 0, params):
        pass
    assert lloyal.BranchStore(primed).available == 1  # the refused create took no lease


def test_unknown_nested_dict_key_is_refused(primed: lloyal.Context) -> None:
    with pytest.raises(ValueError, match="unknown mirostat key 'taw'"):
        primed.sample({"mirostat": {"version": 2, "taw": 3.0}})
    with pytest.raises(ValueError, match=r"unknown dry key 'allowedLength'.*allowed_length"):
        primed.sample({"dry": {"allowedLength": 3}})
    with pytest.raises(ValueError, match="unknown xtc key 'p'"):
        primed.sample({"xtc": {"p": 0.5}})
    # The valid spellings work, and a camelCase keyword override is a TypeError with the hint.
    primed.sample({"temperature": 0, "mirostat": {"version": 2, "tau": 3.0}, "dry": {"allowed_length": 3}})
    with pytest.raises(TypeError, match=r"repeatPenalty.*did you mean 'repeat_penalty'"):
        primed.sample(repeatPenalty=1.1)


def test_a_dict_of_known_keys_is_honoured(primed: lloyal.Context) -> None:
    best = ranked(primed)[0]
    primed.reset_sampler()
    assert primed.sample({"temperature": 0, "repeat_penalty": 100.0}) == best
    assert primed.sample({"temperature": 0, "repeat_penalty": 100.0}) != best  # the penalty bites


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11),
        SamplingParams(temperature=1.5, mirostat=Mirostat(version=2, tau=5.0, eta=0.1), seed=11),
        SamplingParams(temperature=1.0, top_k=20, xtc=Xtc(probability=0.5, threshold=0.05), seed=11),
    ],
    ids=["chain", "mirostat", "xtc"],
)
def test_an_uncommitted_draw_changes_nothing(exact_model: lloyal.Model, params: SamplingParams) -> None:
    """`produce` draws on the branch's own sampler and puts its RNG back (on a copy where the
    draw changes the chain: mirostat's mu, XTC's RNG): a branch that produced twice, then
    committed another token, continues exactly like its twin that never produced."""
    with lloyal.Context(exact_model, n_ctx=512, n_seq_max=3) as ctx:
        root = lloyal.Branch.create(ctx, 0, params)
        root.prefill(ctx.tokenize(PROMPT))
        drew, twin = root.fork(), root.fork()
        first = drew.produce().token
        assert drew.produce().token == first  # idempotent
        forced = 1000 if first != 1000 else 1001  # not the drawn token
        drew.commit(forced)
        twin.commit(forced)
        ahead: list[list[int]] = [[], []]
        for _ in range(6):
            for out, b in zip(ahead, (drew, twin), strict=True):
                t = b.produce().token
                b.commit(t)
                out.append(t)
        assert ahead[0] == ahead[1]
