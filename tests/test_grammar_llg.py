"""llguidance grammars (JSON schema, Lark, regex) on the real model: masks applied before
sampling, forks, saved states, verify, produce_all, the flat path, and errors."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jsonschema
import numpy as np
import pytest
from helpers import (
    assert_grammar_refuses,
    context_fixture,
    flat_constrained,
    lockstep,
    person_schema,
    prefilled,
)

import lloyal

PERSON = person_schema(cities=["Paris", "Rome", "Oslo"])
PERSON_PROMPT = "A person as JSON:\n"
GREEDY = lloyal.SamplingParams(temperature=0.0)
UNSATISFIABLE = {"type": "integer", "minimum": 5, "maximum": 1}


ctx4 = context_fixture(n_ctx=2048, n_seq_max=4)


def _person(text: str) -> dict[str, Any]:
    doc = json.loads(text)
    assert isinstance(doc, dict) and set(doc) == {"name", "age", "city"}, text
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 12, text
    assert isinstance(doc["age"], int) and 0 <= doc["age"] <= 150, text
    assert doc["city"] in ("Paris", "Rome", "Oslo"), text
    return doc


def _person_branch(ctx: lloyal.Context) -> lloyal.Branch:
    """A greedy branch under PERSON with PERSON_PROMPT prefilled."""
    return prefilled(ctx, PERSON_PROMPT, GREEDY, grammar=lloyal.Grammar.from_json_schema(ctx, PERSON))


def _run(b: lloyal.Branch, n: int = 64) -> list[int]:
    out = [t.token for t in b.generate(n)]
    assert b.produce().is_stop, "the document ended within the budget"
    return out


# --------------------------------------------------------------------------- handles


def test_kind_source_and_constructors_from_context_or_model(ctx: lloyal.Context) -> None:
    g = lloyal.Grammar.from_json_schema(ctx, PERSON)
    assert (g.kind, g.source, g.gbnf, g.root) == ("json_schema", json.dumps(PERSON), None, None)
    assert repr(g) == "Grammar(kind='json_schema')"
    same = lloyal.Grammar.from_json_schema(ctx.model, json.dumps(PERSON))
    assert same.source == g.source
    assert lloyal.Grammar.from_lark(ctx, 'start: "a"').kind == "lark"
    assert lloyal.Grammar.from_regex(ctx.model, "a+").source == "a+"
    gbnf = lloyal.Grammar.from_gbnf(ctx, 'top ::= "a"', root="top")
    assert (gbnf.kind, gbnf.gbnf, gbnf.root, gbnf.source) == ("gbnf", 'top ::= "a"', "top", 'top ::= "a"')
    with pytest.raises(TypeError, match="Context or a Model"):
        lloyal.Grammar.from_regex(42, "a")  # type: ignore[arg-type]


def test_apply_masks_to_compact_json_and_accept_advances(ctx: lloyal.Context) -> None:
    ctx.decode(ctx.tokenize("Once upon a time"), 0)
    g = lloyal.Grammar.from_json_schema(ctx, PERSON)
    logits = ctx.get_logits().copy()
    g.apply(logits)
    allowed = np.flatnonzero(np.isfinite(logits))
    texts = sorted(ctx.token_to_text(int(t)) for t in allowed)
    # Compact JSON: the document starts with '{' and then the first key, no whitespace.
    assert texts and all('{"name"'.startswith(t) or t.startswith("{") for t in texts), texts
    assert all(not t.startswith((" ", "\n")) for t in texts)
    brace = ctx.tokenize("{", add_special=False)[0]
    assert logits[brace] == ctx.get_logits()[brace]
    for tok in ctx.tokenize('{"name":"Al","age":7,"city":"Rome"}', add_special=False):
        g.accept(tok)
    assert g.allows(ctx.eog_token)
    assert not g.allows(brace)


def test_forbidden_accept_raises_and_keeps_state_reset_restarts(ctx: lloyal.Context) -> None:
    g = lloyal.Grammar.from_regex(ctx, "[0-9]{3}")
    seven = ctx.tokenize("7", add_special=False)[0]
    letter = ctx.tokenize("x", add_special=False)[0]
    with pytest.raises(lloyal.GrammarError, match="not allowed"):
        g.accept(letter)
    with pytest.raises(lloyal.GrammarError, match="not allowed"):
        g.accept(ctx.eog_token)  # incomplete: no end of generation yet
    snapshot = g.clone()
    for _ in range(3):
        g.accept(seven)
    assert not g.allows(seven) and g.allows(ctx.eog_token)
    assert snapshot.allows(seven) and not snapshot.allows(ctx.eog_token)
    g.reset()
    assert g.allows(seven) and not g.allows(ctx.eog_token)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda c: lloyal.Grammar.from_json_schema(c, "{not json"), "not valid JSON"),
        (lambda c: lloyal.Grammar.from_json_schema(c, {"type": "object", "properties": 5}), "json_schema"),
        (lambda c: lloyal.Grammar.from_json_schema(c, UNSATISFIABLE), "json_schema"),
        (lambda c: lloyal.Grammar.from_json_schema(c, {"type": object()}), "JSON-serialisable"),
        (lambda c: lloyal.Grammar.from_lark(c, "start: undefined_rule"), "lark"),
        (lambda c: lloyal.Grammar.from_lark(c, ""), "empty"),
        (lambda c: lloyal.Grammar.from_regex(c, "(unclosed"), "regex"),
    ],
    ids=["bad-json", "bad-schema", "unsatisfiable", "unserialisable", "bad-lark", "empty-lark", "bad-regex"],
)
def test_compile_errors_are_grammar_errors(
    ctx: lloyal.Context, make: Callable[[lloyal.Context], lloyal.Grammar], message: str
) -> None:
    with pytest.raises(lloyal.GrammarError, match=message):
        make(ctx)


def test_pathological_inputs_are_refused_in_bounded_time(ctx: lloyal.Context) -> None:
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    start = time.perf_counter()
    with pytest.raises(lloyal.GrammarError, match="nests too deeply"):
        lloyal.Grammar.from_json_schema(ctx, deep)
    huge_enum = {"enum": [f"value-{i}-" + "x" * 40 for i in range(150_000)]}
    with pytest.raises(lloyal.GrammarError, match="too big"):
        lloyal.Grammar.from_json_schema(ctx, huge_enum)
    # Measured under load: ~2 s for both (the 7 MB enum dominates); bounded by llguidance's
    # lexer fuel, never a hang.
    assert time.perf_counter() - start < 30.0


# --------------------------------------------------------------------------- branches


def test_adversarial_prompt_yields_the_schema_with_no_resampling(ctx: lloyal.Context) -> None:
    g = lloyal.Grammar.from_json_schema(ctx, PERSON)
    with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.7, seed=4), grammar=g) as b:
        b.prefill(ctx.tokenize("Once upon a time"))
        text = ctx.detokenize(_run(b))
        _person(text)
        assert b.grammar_resamples == 0
        assert text.startswith('{"name":"')
    assert g.allows(ctx.tokenize("{", add_special=False)[0]), "the branch took a copy of g"


def test_lark_and_regex_on_a_branch(ctx: lloyal.Context) -> None:
    lark = lloyal.Grammar.from_lark(ctx, 'start: answer "."\nanswer: "yes" | "no"')
    with lloyal.Branch.create(ctx, 0, GREEDY, grammar=lark) as b:
        b.prefill(ctx.tokenize("Is the sky blue?"))
        assert ctx.detokenize(_run(b, 8)) in ("yes.", "no.")
    rx = lloyal.Grammar.from_regex(ctx, r"[0-9]{3}-[0-9]{4}")
    with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=1.0, seed=2), grammar=rx) as b:
        b.prefill(ctx.tokenize("Call me at"))
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", ctx.detokenize(_run(b, 16)))


INT = {"type": "integer", "minimum": 0, "maximum": 99}  # short values: the documents end
STR = {"type": "string", "maxLength": 8}
SHARED_KEYS = {
    "properties-beside-allOf": {
        "type": "object",
        "properties": {"a": INT},
        "required": ["a"],
        "allOf": [{"properties": {"b": STR}, "required": ["b"]}],
    },
    "union-with-a-shared-field": {
        "type": "object",
        "properties": {"kind": {"enum": ["x", "y"]}},
        "required": ["kind"],
        "anyOf": [
            {"properties": {"x": INT}, "required": ["x"]},
            {"properties": {"y": {"type": "boolean"}}, "required": ["y"]},
        ],
    },
    "base-extended-by-allOf": {
        "$defs": {"base": {"type": "object", "properties": {"id": INT}, "required": ["id"]}},
        "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"name": STR}, "required": ["name"]}],
    },
}


def test_a_regex_or_lark_grammar_that_accepts_no_text_says_so(ctx: lloyal.Context) -> None:
    # the message was llguidance's parser state, ending "it cannot be used any more"
    for make in (
        lambda: lloyal.Grammar.from_regex(ctx, r"[^\s\S]"),
        lambda: lloyal.Grammar.from_lark(ctx, r"start: /[^\s\S]/"),
    ):
        with pytest.raises(lloyal.GrammarError, match="allows no first token: it accepts no text") as e:
            make()
        assert "any more" not in str(e.value) and len(str(e.value)) < 400


def test_min_tokens_past_a_grammars_end_names_min_tokens(ctx: lloyal.Context) -> None:
    g = lloyal.Grammar.from_gbnf(ctx, 'root ::= "yes" | "no"')
    with lloyal.Branch.create(ctx, 0, GREEDY, grammar=g) as b:
        b.prefill(ctx.tokenize("Answer:"))
        got = []
        with pytest.raises(lloyal.GrammarError, match="min_tokens"):
            got.extend(t.text for t in b.generate(20, min_tokens=5))
    assert "".join(got) in ("", "yes", "no")


@pytest.mark.parametrize("name", list(SHARED_KEYS))
def test_schemas_whose_keys_come_from_several_parts_compile(ctx: lloyal.Context, name: str) -> None:
    """These were refused as unsatisfiable when each part was closed to the others' keys: an
    allOf of plain objects is merged into one, and a union's shared field into each branch,
    then closed (so the documents end: no key the schema does not name)."""
    schema = SHARED_KEYS[name]
    g = lloyal.Grammar.from_json_schema(ctx, schema)
    for seed in range(3):
        with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=1.0, seed=seed), grammar=g) as b:
            b.prefill(ctx.tokenize("A JSON object:"))
            doc = json.loads(ctx.detokenize(_run(b, 96)))
            jsonschema.validate(doc, schema)
            assert set(doc) <= {"a", "b", "id", "name", "kind", "x", "y"}, doc  # merged and closed


@pytest.mark.parametrize("pattern", [" ", "\n", "\t", "  "], ids=["space", "newline", "tab", "two-spaces"])
def test_a_regex_of_whitespace_alone_is_a_grammar(ctx: lloyal.Context, pattern: str) -> None:
    rx = lloyal.Grammar.from_regex(ctx, pattern)
    assert rx.source == pattern
    with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=1.0, seed=3), grammar=rx) as b:
        b.prefill(ctx.tokenize("Some whitespace:"))
        assert ctx.detokenize(_run(b, 8)) == pattern
    with pytest.raises(lloyal.GrammarError, match="empty"):
        lloyal.Grammar.from_regex(ctx, "")


def test_fork_mid_document_copies_the_parse_state(ctx4: lloyal.Context) -> None:
    with _person_branch(ctx4) as root:
        head = [t.token for t in root.generate(4)]
        child = root.fork()
        child.set_sampler_params(temperature=1.0, seed=9)
        before = root.produce().token
        child_tail = _run(child)
        assert root.produce().token == before, "the child's tokens did not advance the root's grammar"
        root_tail = _run(root)
        docs = [_person(ctx4.detokenize(head + t)) for t in (root_tail, child_tail)]
        assert docs[0] != docs[1] or root_tail != child_tail


def test_save_and_load_mid_document_resumes_the_grammar(
    make_exact_context: Callable[..., lloyal.Context],
) -> None:
    # Batch-invariant (on the CPU on a GPU run too): a resumed grammar's tokens are compared by ==.
    exact_ctx4 = make_exact_context(n_ctx=2048, n_seq_max=4)
    with _person_branch(exact_ctx4) as b:
        head = [t.token for t in b.generate(5)]
        data = b.save_state()
        with lloyal.Branch.load_state(exact_ctx4, data) as restored:
            assert restored.position == b.position
            tails = [_run(x) for x in (b, restored)]
        assert tails[0] == tails[1]
        _person(exact_ctx4.detokenize(head + tails[0]))


def test_verify_keeps_allowed_drafts_and_replaces_a_forbidden_one(ctx4: lloyal.Context) -> None:
    with _person_branch(ctx4) as b:
        with b.fork() as probe:
            greedy = [t.token for t in probe.generate(6)]
        bad = ctx4.tokenize(" hello", add_special=False)[0]
        assert b.verify([*greedy[:3], bad]) == 3
        assert b.last_token == greedy[3]
        assert b.position == len(ctx4.tokenize(PERSON_PROMPT)) + 4
        _person(ctx4.detokenize(greedy[:4] + _run(b)))


def test_produce_all_over_reseeded_forks_gives_valid_distinct_documents(ctx4: lloyal.Context) -> None:
    g = lloyal.Grammar.from_json_schema(ctx4, PERSON)
    params = lloyal.SamplingParams(temperature=1.0, seed=1)
    with lloyal.Branch.create(ctx4, 0, params, grammar=g) as root:
        root.prefill(ctx4.tokenize("Once upon a time"))
        kids = [root.fork() for _ in range(3)]
        for i, k in enumerate(kids):
            k.reseed_sampler(50 + i)
        out, live = lockstep(kids, 64)
        assert not live
        docs = [_person(ctx4.detokenize(o)) for o in out]
        assert len({json.dumps(d) for d in docs}) > 1
        assert all(k.grammar_resamples == 0 for k in kids)


def test_flat_path_apply_accept_loop(ctx: lloyal.Context) -> None:
    g = lloyal.Grammar.from_json_schema(ctx, PERSON)

    def pick() -> int:
        logits = ctx.get_logits().copy()
        g.apply(logits)
        return int(np.argmax(logits))

    out, ended = flat_constrained(ctx, g, "Once upon a time", 64, pick)
    assert ended, "the document did not end within 64 tokens"
    _person(ctx.detokenize(out))


def test_commit_of_a_forbidden_token_changes_nothing(ctx: lloyal.Context) -> None:
    g = lloyal.Grammar.from_json_schema(ctx, PERSON)
    with lloyal.Branch.create(ctx, 0, grammar=g) as b:
        b.prefill(ctx.tokenize("Once upon a time"))
        pos = b.position
        assert_grammar_refuses(b, ctx.tokenize(" there", add_special=False)[0])
        b.commit(ctx.tokenize("{", add_special=False)[0])
        assert b.position == pos + 1


def test_every_allowed_token_banned_is_a_grammar_error(ctx: lloyal.Context) -> None:
    g = lloyal.Grammar.from_regex(ctx, "(yes|no)")
    with lloyal.Branch.create(ctx, 0, GREEDY, grammar=g) as b:
        b.prefill(ctx.tokenize("Answer:"))
        logits = b.logits
        probe = g.clone()
        probe.apply(logits)
        allowed = [int(t) for t in np.flatnonzero(np.isfinite(logits))]
        assert allowed
        b.set_logit_bias({t: float("-inf") for t in allowed})
        with pytest.raises(lloyal.GrammarError, match="allows no token"):
            b.produce()


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7),
        lloyal.SamplingParams(temperature=1.5, top_k=5, min_p=0.02, repeat_penalty=1.3, seed=3),
    ],
    ids=["greedy", "top-k-top-p", "top-k-penalty"],
)
def test_masked_draw_equals_a_draw_from_the_masked_row(
    ctx4: lloyal.Context, params: lloyal.SamplingParams
) -> None:
    """A constrained branch draws from the k best allowed tokens without building the masked row
    (from the allowed tokens when few, else from windows of the row's best): token for token
    what a grammar-free twin with the same seed draws from that masked row (``set_logits``),
    at places with a handful of allowed tokens and inside strings where most are allowed."""
    bias = {
        ctx4.tokenize('"', add_special=False)[0]: 1.5,
        ctx4.tokenize("Paris", add_special=False)[0]: -math.inf,
    }
    mask_state = lloyal.Grammar.from_json_schema(ctx4, PERSON)
    with (
        lloyal.Branch.create(ctx4, 0, params, grammar=mask_state.clone()) as a,
        lloyal.Branch.create(ctx4, 0, params) as twin,
    ):
        a.set_logit_bias(bias)
        twin.set_logit_bias(bias)
        a.prefill(ctx4.tokenize(PERSON_PROMPT))
        made = []
        for _ in range(40):
            masked = a.logits.copy()
            mask_state.apply(masked)
            twin.set_logits(masked)
            token = a.produce().token
            assert twin.produce().token == token, (len(made), ctx4.detokenize(made))
            if ctx4.is_stop_token(token):
                break
            made.append(token)
            mask_state.accept(token)
            twin.accept(token)
            a.commit(token)
    assert len(made) > 8
    assert made[0] == ctx4.tokenize("{", add_special=False)[0]
