"""JSON-schema-constrained generation vs unconstrained on the same branch setup, and vs
llama-cpp-python's grammar path (LlamaGrammar), in one run.

lloyal samples from the unconstrained distribution first and checks only the chosen token
against the grammar; the full 262k-token mask is computed only when that token is rejected
(counted in ``extra_info["grammar_resamples"]``).
"""

from __future__ import annotations

import json
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
