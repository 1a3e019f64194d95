"""Grammars on the real model: JSON Schema conversion, Grammar handles, constrained branches."""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np
import pytest
from helpers import assert_grammar_refuses, context_fixture, flat_constrained, lockstep, person_schema

import lloyal

PERSON = person_schema()
YES_NO = 'root ::= "yes" | "no"'


ctx4 = context_fixture(n_ctx=2048, n_seq_max=4)


def _matches_person(doc: Any) -> bool:
    return (
        isinstance(doc, dict)
        and set(doc) == {"name", "age"}
        and isinstance(doc["name"], str)
        and len(doc["name"]) <= 12
        and isinstance(doc["age"], int)
        and 0 <= doc["age"] <= 150
    )


# --------------------------------------------------------------------------- conversion


def test_json_schema_to_grammar_accepts_dict_and_text() -> None:
    from_dict = lloyal.json_schema_to_grammar(PERSON)
    from_text = lloyal.json_schema_to_grammar(json.dumps(PERSON))
    assert from_dict == from_text
    assert "root ::=" in from_dict and '\\"age\\"' in from_dict


@pytest.mark.parametrize("schema", ["{not json", '{"type": "object", "properties": 5}'])
def test_invalid_schema_is_a_grammar_error(schema: str) -> None:
    with pytest.raises(lloyal.GrammarError, match="JSON schema"):
        lloyal.json_schema_to_grammar(schema)


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "foo"}, "Invalid type: foo"),
        ({"$ref": "#/nope"}, "Pointer '/nope' does not exist"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum \\(5\\) is greater than maximum \\(1\\)"),
    ],
)
def test_a_schema_the_converter_cannot_use_says_why(schema: dict[str, object], reason: str) -> None:
    """llama.cpp's converter fails without a reason on the first two and turns the third into
    rules that match nothing; the error gives llguidance's reading of the schema."""
    with pytest.raises(lloyal.GrammarError, match=reason):
        lloyal.json_schema_to_grammar(schema)


def test_keywords_the_converter_ignores_are_named_in_a_warning() -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "multipleOf": 5}, "x": {"type": "number", "maximum": 2.5}},
    }
    with pytest.warns(UserWarning, match=r"does not enforce maximum of a number, multipleOf"):
        lloyal.json_schema_to_grammar(schema)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lloyal.json_schema_to_grammar({"type": "integer", "minimum": 0, "maximum": 9})  # enforced


def test_unserialisable_schema_is_a_grammar_error() -> None:
    with pytest.raises(lloyal.GrammarError, match="JSON-serialisable"):
        lloyal.json_schema_to_grammar({"type": object()})


@pytest.mark.parametrize(
    "gbnf", ['root ::= ("a"', 'root ::= "open', "root ::= undefined-rule", "", 'x ::= "a"']
)
def test_invalid_gbnf_is_a_grammar_error(ctx: lloyal.Context, gbnf: str) -> None:
    with pytest.raises(lloyal.GrammarError):
        ctx.create_grammar(gbnf)


def test_invalid_gbnf_says_what_is_wrong(ctx: lloyal.Context) -> None:
    """llama.cpp prints its parse error rather than logging it: the error says it anyway."""
    with pytest.raises(lloyal.GrammarError, match="Undefined rule identifier 'missing'"):
        ctx.create_grammar('root ::= "a" missing')
    with pytest.raises(lloyal.GrammarError, match="Undefined rule identifier 'missing'"):
        lloyal.Grammar.from_gbnf(ctx, 'root ::= "a" missing', engine="llama.cpp")


def test_a_json_schema_is_read_as_llama_cpp_reads_it(ctx: lloyal.Context) -> None:
    """An object that lists its properties takes no others (as json_schema_to_grammar's GBNF);
    unimplemented keywords and formats are ignored and an overlapping oneOf is an anyOf; the
    schema's x-guidance entry says otherwise."""

    def accepts(schema: dict[str, object], text: str) -> bool:
        g = lloyal.Grammar.from_json_schema(ctx, schema)
        try:
            for t in ctx.tokenize(text, add_special=False):
                g.accept(t)
        except lloyal.GrammarError:
            return False
        return g.allows(ctx.eog_token)

    loose = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(loose, '{"a":1}') and not accepts(loose, '{"a":1,"b":2}')
    assert accepts({**loose, "x-guidance": {"whitespace_flexible": False}}, '{"a":1}')
    assert accepts({**loose, "additionalProperties": True}, '{"a":1,"b":2}')
    odd = {"type": "string", "format": "password", "uniqueItems": True}
    assert accepts(odd, '"x"')
    assert accepts({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "12")
    with pytest.raises(lloyal.GrammarError, match="Unimplemented keys"):
        lloyal.Grammar.from_json_schema(ctx, {**odd, "x-guidance": {"lenient": False}})


# --------------------------------------------------------------------------- handles


def test_apply_masks_exactly_the_forbidden_tokens(ctx: lloyal.Context) -> None:
    ctx.decode(ctx.tokenize("Answer yes or no:"), 0)
    g = ctx.create_grammar(YES_NO)
    logits = ctx.get_logits().copy()
    g.apply(logits)
    allowed = np.flatnonzero(np.isfinite(logits))
    texts = {ctx.token_to_text(int(t)) for t in allowed}
    assert 0 < len(allowed) < 100
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    yes = ctx.tokenize("yes", add_special=False)[0]
    assert yes in allowed and logits[yes] == ctx.get_logits()[yes]
    assert g.allows(yes) and not g.allows(ctx.tokenize(" maybe", add_special=False)[0])


def test_forbidden_accept_raises_and_keeps_state(ctx: lloyal.Context) -> None:
    g = ctx.create_grammar(YES_NO)
    yes = ctx.tokenize("yes", add_special=False)[0]
    bad = ctx.tokenize("maybe", add_special=False)[0]
    with pytest.raises(lloyal.GrammarError, match="not allowed"):
        g.accept(bad)
    assert g.allows(yes)
    with pytest.raises(lloyal.GrammarError):
        g.accept(ctx.eog_token)  # grammar not complete yet: EOG is forbidden, no abort
    g.accept(yes)
    assert g.allows(ctx.eog_token) and not g.allows(yes)
    for outside in (-1, ctx.n_vocab, 2**40):
        with pytest.raises(lloyal.InvalidTokenError):
            g.accept(outside)
        assert g.allows(ctx.eog_token), "state unchanged"


def test_clone_keeps_the_old_state_and_reset_restarts(ctx: lloyal.Context) -> None:
    g = ctx.create_grammar(YES_NO)
    yes = ctx.tokenize("yes", add_special=False)[0]
    snapshot = g.clone()
    g.accept(yes)
    assert snapshot.allows(yes) and not g.allows(yes)
    g.reset()
    assert g.allows(yes)
    assert g.root == "root" and g.gbnf == YES_NO


def test_apply_rejects_wrong_length(ctx: lloyal.Context) -> None:
    g = ctx.create_grammar(YES_NO)
    with pytest.raises(ValueError, match="n_vocab"):
        g.apply(np.zeros(10, dtype=np.float32))


# --------------------------------------------------------------------------- branches


def test_completed_grammar_ends_the_branch_cleanly(ctx: lloyal.Context) -> None:
    params = lloyal.SamplingParams(temperature=0.0)
    with lloyal.Branch.create(ctx, 0, params, grammar=YES_NO) as b:
        b.prefill(ctx.tokenize("Is the sky blue? Answer:"))
        out = [t.token for t in b.generate(10)]
        assert ctx.detokenize(out) in ("yes", "no")
        assert b.produce().is_stop


def test_forbidden_commit_raises_and_changes_nothing(ctx: lloyal.Context) -> None:
    with lloyal.Branch.create(ctx, 0, grammar=YES_NO) as b:
        b.prefill(ctx.tokenize("Answer:"))
        assert_grammar_refuses(b, ctx.tokenize(" maybe", add_special=False)[0])


def test_set_grammar_none_removes_the_constraint(ctx4: lloyal.Context) -> None:
    params = lloyal.SamplingParams(temperature=0.0)
    prompt = ctx4.tokenize("The capital of France is")
    with (
        lloyal.Branch.create(ctx4, 0, params) as free,
        lloyal.Branch.create(ctx4, 0, params, grammar=YES_NO) as b,
    ):
        free.prefill(prompt)
        b.prefill(prompt)
        constrained = b.produce().token
        assert ctx4.token_to_text(constrained) in ("y", "ye", "yes", "n", "no")
        assert ctx4.token_to_text(free.produce().token) not in ("y", "ye", "yes", "n", "no")
        b.set_grammar(None)
        assert b.produce().token == free.produce().token


def test_bad_grammar_argument_takes_no_lease(ctx4: lloyal.Context) -> None:
    store = lloyal.BranchStore(ctx4)
    with pytest.raises(lloyal.GrammarError):
        lloyal.Branch.create(ctx4, 0, grammar="root ::= (")
    with pytest.raises(TypeError, match="grammar"):
        lloyal.Branch.create(ctx4, 0, grammar=42)  # type: ignore[arg-type]
    assert store.available == 4


def test_json_schema_root_forked_into_three_reseeded_children(ctx4: lloyal.Context) -> None:
    gbnf = lloyal.json_schema_to_grammar(PERSON)
    params = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3)
    root = lloyal.Branch.create(ctx4, 0, params, grammar=gbnf)
    root.prefill(ctx4.tokenize("Describe a person as JSON with a name and an age:\n"))
    kids = [root.fork() for _ in range(3)]
    for i, k in enumerate(kids):
        k.reseed_sampler(100 + i)
    out, live = lockstep(kids, 80)
    texts = [ctx4.detokenize(o) for o in out]
    assert not live, f"every child finished its JSON document within 80 tokens: {texts}"
    docs = [json.loads(t) for t in texts]
    assert all(_matches_person(d) for d in docs), docs
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > 1, "reseeded children differ"
    root.prune_subtree()


def test_fork_mid_document_clones_the_grammar_state(ctx4: lloyal.Context) -> None:
    gbnf = lloyal.json_schema_to_grammar(PERSON)
    params = lloyal.SamplingParams(temperature=0.0)
    with lloyal.Branch.create(ctx4, 0, params, grammar=gbnf) as root:
        root.prefill(ctx4.tokenize("A person as JSON:\n"))
        head = [t.token for t in root.generate(3)]
        child = root.fork()
        child.set_sampler_params(temperature=0.9, seed=5)
        tails = [[t.token for t in b.generate(60)] for b in (root, child)]
        for tail in tails:
            assert _matches_person(json.loads(ctx4.detokenize(head + tail)))


# --------------------------------------------------------------------------- flat path


def _flat_constrained(ctx: lloyal.Context, grammar: lloyal.Grammar, *, via_logits: bool) -> list[int]:
    """The original project's flat grammar example, ported: decode, copy the logits, apply
    the grammar, sample from the masked copy, accept the token into the grammar, decode it."""
    ctx.kv_cache_clear()
    ctx.reset_sampler()

    def pick() -> int:
        if via_logits:
            logits = ctx.get_logits().copy()
            grammar.apply(logits)
            return ctx.sample(logits=logits, temperature=0)
        return ctx.sample(grammar=grammar, temperature=0)

    return flat_constrained(ctx, grammar, "A person as JSON:", 60, pick)[0]


def test_flat_path_constrained_sampling_ports_the_original_example(ctx: lloyal.Context) -> None:
    gbnf = lloyal.json_schema_to_grammar(PERSON)
    masked = _flat_constrained(ctx, ctx.create_grammar(gbnf), via_logits=True)
    assert _matches_person(json.loads(ctx.detokenize(masked)))
    # grammar= does the masking itself and picks exactly the same tokens.
    assert _flat_constrained(ctx, ctx.create_grammar(gbnf), via_logits=False) == masked


def test_flat_sample_from_caller_logits(ctx: lloyal.Context) -> None:
    logits = np.full(ctx.n_vocab, -np.inf, dtype=np.float32)
    logits[[7000, 7001]] = [1.0, 5.0]
    assert ctx.sample(logits=logits, temperature=0) == 7001  # no decode needed
    # The draw joins the penalty history like any flat sample.
    assert ctx.sample(logits=logits, temperature=0, repeat_penalty=100.0) == 7000
    with pytest.raises(ValueError, match="n_vocab"):
        ctx.sample(logits=np.zeros(10, dtype=np.float32))
    # nothing to sample from: refused, where llama.cpp's sampler aborted (NaN) or gave token 0
    with pytest.raises(ValueError, match="must not contain NaN"):
        ctx.sample(logits=np.full(ctx.n_vocab, np.nan, dtype=np.float32))
    with pytest.raises(ValueError, match="must not contain NaN"):
        ctx.sample(logits=np.full(ctx.n_vocab, np.nan, dtype=np.float32), temperature=0.8, seed=1)
    with pytest.raises(ValueError, match="every value of logits is -inf"):
        ctx.sample(logits=np.full(ctx.n_vocab, -np.inf, dtype=np.float32), temperature=0)
    with pytest.raises(lloyal.LloyalError, match="no logits"):
        ctx.sample(temperature=0)  # still nothing decoded


def test_flat_grammar_sample_does_not_advance_the_grammar(ctx: lloyal.Context) -> None:
    ctx.decode(ctx.tokenize("Is the sky blue? Answer:"), 0)
    g = ctx.create_grammar(YES_NO)
    best = int(np.argmax(ctx.get_logits()))
    assert not g.allows(best)  # the unconstrained choice is not "yes"/"no" ...
    first = ctx.sample(grammar=g, temperature=0)
    assert ctx.detokenize([first]) in ("yes", "no")  # ... the constrained one is
    assert ctx.sample(grammar=g, temperature=0) == first  # not advanced: same state, same draw
    g.accept(first)
    # The grammar is complete: only end-of-generation is allowed now; with a caller's logits
    # that ban it, the grammar allows no token.
    stop = ctx.sample(grammar=g, temperature=0)
    assert ctx.is_stop_token(stop)
    logits = ctx.get_logits().copy()
    logits[stop] = -np.inf
    for t in range(ctx.n_vocab):
        if ctx.is_stop_token(t):
            logits[t] = -np.inf
    with pytest.raises(lloyal.GrammarError, match="allows no token"):
        ctx.sample(grammar=g, logits=logits)
