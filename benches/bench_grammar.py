"""JSON-schema-constrained generation vs unconstrained on the same branch setup, and vs
llama-cpp-python's grammar path (LlamaGrammar), in one run.

Two lloyal engines: llguidance (the mask is applied before every draw), which runs JSON schemas
(``llguidance``) and GBNF translated with its meaning kept (``gbnf``), and llama.cpp's GBNF engine
(``gbnf-llama.cpp``: sample unconstrained first, compute the full 262k-token mask only when the
grammar rejects the draw, counted in ``extra_info["grammar_resamples"]``). ``test_issue_schema``
compares them with unconstrained generation on a cooperative and an adversarial prompt;
``test_mask_time`` reports llguidance's mask time per token in µs.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
from conftest import THREADS
from llama_peer import high_level

import lloyal

GROUP = "json-schema"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
# Long enough that both runs stop at the token budget: equal token counts, equal prefill share.
SCHEMA = {"type": "array", "items": PERSON, "minItems": 4, "maxItems": 8}
PROMPT = "Write a JSON list of four people, each with a name, an age and a city:\n"
PARAMS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 11}


def max_tokens(full: bool) -> int:
    return 64 if full else 8


def _lloyal_run(ctx: lloyal.Context, grammar: str | None, n: int) -> tuple[list[int], int]:
    with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(**PARAMS), grammar=grammar) as b:
        b.prefill(ctx.tokenize(PROMPT))
        out = [t.token for t in b.generate(n)]
        return out, b.grammar_resamples


@pytest.mark.benchmark(group=GROUP)
@pytest.mark.parametrize("constrained", [False, True], ids=["unconstrained", "json_schema"])
def test_lloyal(benchmark, model_path: Path, full: bool, constrained: bool) -> None:
    n = max_tokens(full)
    gbnf = lloyal.json_schema_to_grammar(SCHEMA) if constrained else None
    with lloyal.Context(model_path, n_ctx=1024, n_threads=THREADS) as ctx:
        out, resamples = benchmark.pedantic(lambda: _lloyal_run(ctx, gbnf, n), rounds=3 if full else 1)
        text = ctx.detokenize(out)
    benchmark.extra_info.update(tokens=len(out), grammar_resamples=resamples)
    assert 0 < len(out) <= n
    if constrained:  # a prefix of a document matching the schema (or all of it)
        assert text.lstrip().startswith("[")
        if len(out) < n:
            doc = json.loads(text)
            assert all(set(p) == {"name", "age", "city"} for p in doc)


@pytest.mark.benchmark(group=GROUP)
@pytest.mark.parametrize("constrained", [False, True], ids=["unconstrained", "json_schema"])
def test_llama_cpp_python(benchmark, model_path: Path, full: bool, constrained: bool) -> None:
    n = max_tokens(full)
    llm = high_level(model_path, 1024, THREADS)
    import llama_cpp

    grammar = (
        llama_cpp.LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False) if constrained else None
    )

    def run() -> tuple[str, int]:
        llm.reset()
        res = llm.create_completion(
            PROMPT, max_tokens=n, grammar=grammar, temperature=0.8, top_k=40, top_p=0.95, seed=11
        )
        return str(res["choices"][0]["text"]), int(res["usage"]["completion_tokens"])

    text, tokens = benchmark.pedantic(run, rounds=3 if full else 1)
    benchmark.extra_info.update(tokens=tokens)
    assert text and tokens > 0
    if constrained:
        assert text.lstrip().startswith("[")


# The issue's schema: name string, age integer, city enum.
ISSUE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "London", "Tokyo", "New York"]},
    },
    "required": ["name", "age", "city"],
}
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "team": {"type": "string", "maxLength": 20},
        "members": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "role": {"enum": ["lead", "dev", "ops"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 10},
                },
                "required": ["name", "role", "score"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 4,
        },
    },
    "required": ["team", "members"],
    "additionalProperties": False,
}
PROMPTS = {"cooperative": "Generate a person as JSON:\n", "adversarial": "Once upon a time"}


# The GBNF issue's schema: a bounded name and age, a city enum and up to three tags.
TAGGED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo", "New York"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def _grammar(ctx: lloyal.Context, engine: str) -> lloyal.Grammar | str | None:
    if engine == "gbnf":  # GBNF text: translated onto llguidance
        return lloyal.json_schema_to_grammar(ISSUE_SCHEMA)
    if engine == "gbnf-llama.cpp":
        return lloyal.Grammar.from_gbnf(ctx, lloyal.json_schema_to_grammar(ISSUE_SCHEMA), engine="llama.cpp")
    if engine == "llguidance":
        return lloyal.Grammar.from_json_schema(ctx, ISSUE_SCHEMA)
    return None


@pytest.mark.benchmark(group="issue-schema")
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
@pytest.mark.parametrize("engine", ["unconstrained", "gbnf", "gbnf-llama.cpp", "llguidance"])
def test_issue_schema(benchmark, model_path: Path, full: bool, engine: str, prompt: str) -> None:
    """Tokens per second at temperature 0.7 (ratios: against ``unconstrained`` of the same prompt)."""
    n = 48 if full else 6
    params = lloyal.SamplingParams(temperature=0.7, seed=5)
    with lloyal.Context(model_path, n_ctx=512, n_threads=THREADS) as ctx:
        grammar = _grammar(ctx, engine)  # compiled outside the timing (llguidance: trie built once)
        tokens = ctx.tokenize(PROMPTS[prompt])

        def run() -> tuple[list[int], int]:
            with lloyal.Branch.create(ctx, 0, params, grammar=grammar) as b:
                b.prefill(tokens)
                return [t.token for t in b.generate(n)], b.grammar_resamples

        out, resamples = benchmark.pedantic(run, rounds=3 if full else 1)
        text = ctx.detokenize(out)
    benchmark.extra_info.update(tokens=len(out), grammar_resamples=resamples)
    assert 0 < len(out) <= n
    if engine == "llguidance":
        assert text.startswith('{"name":"') or '{"name":"'.startswith(text), text
    if engine in ("gbnf", "llguidance"):
        assert resamples == 0  # masked before every draw: nothing to resample
    if engine != "unconstrained" and len(out) < n:
        assert set(json.loads(text)) == {"name", "age", "city"}


@pytest.mark.benchmark(group="mask-time")
@pytest.mark.parametrize("schema", ["issue", "nested"])
def test_mask_time(benchmark, model_path: Path, full: bool, schema: str) -> None:
    """llguidance's mask per token (compute + apply to the 262k logits), in µs: a document is
    generated greedily on the flat path and each ``Grammar.apply`` is timed."""
    n = 64 if full else 8
    with lloyal.Context(model_path, n_ctx=512, n_threads=THREADS) as ctx:
        s = ISSUE_SCHEMA if schema == "issue" else NESTED_SCHEMA
        lloyal.Grammar.from_json_schema(ctx, s)  # the model's token trie, built once

        def run() -> list[float]:
            g = lloyal.Grammar.from_json_schema(ctx, s)
            ctx.kv_cache_clear()
            prompt = ctx.tokenize("Generate JSON:\n")
            ctx.decode(prompt, 0)
            pos, times = len(prompt), []
            for _ in range(n):
                logits = ctx.get_logits().copy()
                t0 = time.perf_counter()
                g.apply(logits)
                times.append((time.perf_counter() - t0) * 1e6)
                tok = int(logits.argmax())
                if ctx.is_stop_token(tok):
                    break
                g.accept(tok)
                ctx.decode([tok], pos)
                pos += 1
            return times

        times = benchmark.pedantic(run, rounds=1)
    benchmark.extra_info.update(
        tokens=len(times), mask_us_median=statistics.median(times), mask_us_max=max(times)
    )
    assert len(times) > 0
