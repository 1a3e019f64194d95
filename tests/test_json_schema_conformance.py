"""Every document generated under a JSON schema (tests/json_schema_corpus.py) parses and
validates with `jsonschema`: greedy, and at temperature 1 on two reseeded forks, all from one
prefilled root; and Hypothesis-generated schemas either give valid documents or are refused
with `GrammarError`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from helpers import lockstep
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_schema_corpus import CORPUS

import lloyal

MAX_TOKENS = 64
PROMPT = "Write one JSON value:\n"


@pytest.fixture(scope="module")
def root(model: lloyal.Model) -> Iterator[lloyal.Branch]:
    with lloyal.Context(model, n_ctx=1024, n_seq_max=4) as ctx:
        b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0))
        b.prefill(ctx.tokenize(PROMPT))
        yield b


def test_corpus_size() -> None:
    assert len(CORPUS) >= 30
    for schema in CORPUS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def _run(ctx: lloyal.Context, branches: list[lloyal.Branch]) -> list[str | None]:
    """Step every branch in lockstep (one produce_all and one commit per step) to its end; a
    branch still going after MAX_TOKENS gives None."""
    out, live = lockstep(branches, MAX_TOKENS + 1)
    return [None if i in live else ctx.detokenize(o) for i, o in enumerate(out)]


def _finish(ctx: lloyal.Context, branches: list[lloyal.Branch]) -> list[str]:
    """The documents of branches that must end within MAX_TOKENS (greedy, bounded schemas: the
    longest greedy document of the corpus takes under half of it)."""
    texts = _run(ctx, branches)
    assert all(t is not None for t in texts), f"not finished within {MAX_TOKENS} tokens: {texts}"
    return [t for t in texts if t is not None]


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_generated_documents_validate(root: lloyal.Branch, name: str) -> None:
    """Greedy ends within the budget and validates. The two temperature-1 forks validate when
    they end; one may draw past any budget (a number's digits are unbounded), and then its
    prefix must still let the grammar go on, which holds whatever the kernels draw."""
    schema = CORPUS[name]
    ctx = root.context
    grammar = lloyal.Grammar.from_json_schema(ctx, schema)
    with root.fork() as greedy:
        greedy.set_grammar(grammar)
        hot = [greedy.fork() for _ in range(2)]
        for i, b in enumerate(hot):
            b.set_sampler_params(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0, seed=17 + i)
        texts = _run(ctx, [greedy, *hot])
        assert texts[0] is not None, f"greedy did not end within {MAX_TOKENS} tokens"
        for b, text in zip([greedy, *hot], texts, strict=True):
            if text is not None:
                jsonschema.validate(json.loads(text), schema)
            else:
                token = b.produce().token  # the grammar still allows a next token ...
                b.commit(token)  # ... and accepts it
        for b in hot:
            b.prune()


def _schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Small bounded schemas (every document fits the token budget), nested up to 2 levels."""
    leaves = st.one_of(
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.integers(-20, 20).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 9}),
        st.integers(0, 3).map(lambda k: {"type": "string", "minLength": k, "maxLength": k + 3}),
        st.lists(st.sampled_from(["a", "b", "c", 1, 2, None]), min_size=1, max_size=3, unique=True).map(
            lambda v: {"enum": v}
        ),
        st.just({"type": "string", "pattern": "^[a-z]{1,3}$"}),
    )

    def extend(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
        keys = st.sampled_from(["a", "b", "c", "d"])
        return st.one_of(
            st.tuples(inner, st.integers(0, 2)).map(
                lambda t: {"type": "array", "items": t[0], "minItems": min(1, t[1]), "maxItems": t[1]}
            ),
            st.dictionaries(keys, inner, min_size=1, max_size=2).flatmap(
                lambda props: st.sets(st.sampled_from(sorted(props))).map(
                    lambda req: {
                        "type": "object",
                        "properties": props,
                        "required": sorted(req),
                        "additionalProperties": False,
                    }
                )
            ),
            st.lists(inner, min_size=2, max_size=2).map(lambda alts: {"anyOf": alts}),
        )

    return st.recursive(leaves, extend, max_leaves=4)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas())
def test_hypothesis_schemas_validate_or_are_refused(root: lloyal.Branch, schema: dict[str, Any]) -> None:
    ctx = root.context
    try:
        grammar = lloyal.Grammar.from_json_schema(ctx, schema)
    except lloyal.GrammarError:
        return  # refused with llguidance's reason: allowed
    with root.fork() as b:
        b.set_grammar(grammar)
        (text,) = _finish(ctx, [b])
    jsonschema.validate(json.loads(text), schema)
