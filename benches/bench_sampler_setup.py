"""What a sampler costs to set up and to run with a long bias map::

    python -m pytest benches/bench_sampler_setup.py --benchmark-enable -s

- ``dry-setup``: ``Branch.create`` with DRY (the 4 default sequence breakers). A setting the model
  has not seen yet makes llama.cpp scan every token's text per breaker; a setting seen before is a
  copy of the sampler made then (``sampler::DryPrototypes``). Rounds alternate between the two.
- ``bias-map``: one ``produce()`` (temperature 0.8, top-k 40) with 100,000 tokens banned by
  ``set_logit_bias`` against none: the bias is merged with the row's candidates in n log n.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

from conftest import THREADS

import lloyal

SAMPLED = lloyal.SamplingParams(temperature=0.8, top_k=40, seed=1)
DEFAULT_BREAKERS = ("\n", ":", '"', "*")


def _dry(extra: str | None) -> lloyal.SamplingParams:
    breakers = DEFAULT_BREAKERS if extra is None else (*DEFAULT_BREAKERS, extra)
    return SAMPLED.replace(dry=lloyal.Dry(multiplier=0.8, sequence_breakers=breakers))


def _create_seconds(ctx: lloyal.Context, params: lloyal.SamplingParams) -> float:
    t0 = time.perf_counter()
    b = lloyal.Branch.create(ctx, 0, params)
    seconds = time.perf_counter() - t0
    b.prune()
    return seconds


def test_dry_made_and_copied(benchmark, model_path: Path, full: bool) -> None:
    benchmark.group = "dry-setup"
    rounds = 5 if full else 1
    fresh = (f"lloyal-bench-{i}-{time.time_ns()}" for i in itertools.count())  # never seen before
    made: list[float] = []
    copied: list[float] = []
    with lloyal.Context(model_path, n_ctx=256, n_threads=THREADS) as ctx:
        _create_seconds(ctx, _dry(None))  # the default setting's first sampler, made
        for _ in range(rounds):
            made.append(_create_seconds(ctx, _dry(next(fresh))))
            copied.append(_create_seconds(ctx, _dry(None)))
        benchmark.pedantic(lambda: _create_seconds(ctx, _dry(None)), rounds=rounds, iterations=1)
    ms = (statistics.median(made) * 1e3, statistics.median(copied) * 1e3)
    print(f"\ndry-setup: made {ms[0]:.2f} ms, copied {ms[1]:.3f} ms ({ms[0] / ms[1]:.0f}x), {rounds} rounds")
    assert ms[1] < ms[0]


def test_a_long_bias_map(benchmark, model_path: Path, prompt_tokens: list[int], full: bool) -> None:
    benchmark.group = "bias-map"
    rounds = 5 if full else 1
    banned = {t: float("-inf") for t in range(100_000)}
    with lloyal.Context(model_path, n_ctx=512, n_threads=THREADS) as ctx:
        b = lloyal.Branch.create(ctx, 0, SAMPLED)
        b.prefill(prompt_tokens[:32])
        seeds = itertools.count(10)

        def produce_seconds(bias: dict[int, float]) -> float:
            b.set_logit_bias(bias)
            b.reseed_sampler(next(seeds))  # produce() caches its draw until an input changes
            t0 = time.perf_counter()
            token = b.produce().token
            seconds = time.perf_counter() - t0
            assert token not in bias
            return seconds

        plain = [produce_seconds({}) for _ in range(rounds)]
        biased = [produce_seconds(banned) for _ in range(rounds)]
        benchmark.pedantic(lambda: produce_seconds(banned), rounds=rounds, iterations=1)
    ms = (statistics.median(plain) * 1e3, statistics.median(biased) * 1e3)
    print(f"\nbias-map: none {ms[0]:.2f} ms, 100,000 banned {ms[1]:.2f} ms a produce(), {rounds} rounds")
