"""GBNF on llguidance (lloyal's translation, crates/lloyal-core/src/grammar/gbnf_lark.rs) against
llama.cpp's grammar engine, the differential test: llama.cpp's own grammars (its ``grammars/``
folder), the GBNF ``json_schema_to_grammar`` makes for every schema of the suite's corpus, and
hand-written grammars at the places where llguidance's maximal-munch lexer could cut the input
differently from GBNF's characters.

- Every one of them runs on llguidance (no fallback, no warning).
- Along random walks (each step a token the grammars allow, drawn with a fixed seed) both engines
  give the same mask over every text token at every step. Left out:
  - control tokens (``<unused0>``...): llama.cpp's engine matches them by their text, llguidance
    only by ``<[id]>``, and no string tokenizes to them;
  - tokens that leave a character unfinished (Gemma's byte tokens 0x80-0xFF, rendered as U+FFFD)
    and the NUL byte token, where llama.cpp's engine has its own rules: it allows bytes that can
    never start valid UTF-8 (0xF5-0xFF), refuses a lead byte when any character it could start is
    excluded (``[^\x85]`` refuses every 0xC2 token although U+00A0 is allowed), and never allows a
    token starting with NUL. llguidance follows UTF-8 exactly (docs/performance.md).
- Hand-written strings, and mutations of generated ones (a character inserted, deleted or
  replaced), end the same way under both: completed, unfinished, or rejected at the same token.
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
from json_schema_corpus import CORPUS
from llama_grammars import grammars as llama_cpp_grammars

import lloyal

# Hand-written grammars where a lexer that takes the longest match would go wrong.
EDGES: dict[str, tuple[str, list[str]]] = {
    "suffix": (
        'root ::= [a-z]+ "s" tail\ntail ::= "." | "," root\n',
        ["cats.", "cat.", "cats,dogs.", "css."],
    ),
    "space-then-newline": (
        'root ::= (word ws "\\n")+\nword ::= [a-z]+ tail\ntail ::= "" | "(" root ")"\nws ::= [ \\t\\n]*\n',
        ["a\n", "a \n", "a\n\n", "ab  \nc\n", "a(b\n)\n", "a"],
    ),
    "competing": (
        'root ::= x | "abc"\nx ::= "a" y\ny ::= "bd" | "bd" x\n',
        ["abd", "abc", "abdabd", "ab", "abcd"],
    ),
    "keyword-or-name": (
        'root ::= (stmt ";")+\nstmt ::= "int" ws name ws "=" ws num | name ws "=" ws num | "{" root "}"\n'
        "name ::= [a-z] [a-z0-9]*\nnum ::= [0-9]+\nws ::= [ ]*\n",
        ["int x = 1;", "int = 1;", "integer=2;", "intx = 3;", "{int a=1;}b=2;", "int  =1;"],
    ),
    "nullable": (
        'root ::= "(" ws body ws ")"\nbody ::= | "x" ws body\nws ::= | " " ws\n',
        ["()", "( )", "(x x)", "(xx )"],
    ),
    "any-and-ranges": (
        'root ::= "<" [^>]* ">" (. | "\\u00e9")? end\nend ::= "" | root\n',
        ["<a>", "<ab>é", "<>x<y>", "<a"],
    ),
    "bounded": ('root ::= ("a"{2,3} "b"?){1,2} "!"\n', ["aa!", "aaab!", "aaaaa!", "ab!", "aaaaaaa!"]),
}


@pytest.fixture(scope="module")
def ctx(model: lloyal.Model) -> Iterator[lloyal.Context]:
    with lloyal.Context(model, n_ctx=512) as c:
        yield c


@pytest.fixture(scope="module")
def text_tokens(ctx: lloyal.Context) -> np.ndarray:
    """Tokens that stand for whole characters of text: not control tokens (those render only with
    ``special=True``), not an unfinished UTF-8 sequence (U+FFFD), not NUL."""
    texts = [(ctx.token_to_text(t), ctx.token_to_text(t, special=True)) for t in range(ctx.n_vocab)]
    keep = np.array(
        [
            plain == special and "\ufffd" not in plain and not plain.startswith("\0")
            for plain, special in texts
        ]
    )
    unfinished = sum("\ufffd" in plain for plain, _ in texts)
    assert 0 < unfinished < ctx.n_vocab // 100, unfinished  # byte tokens 0x80-0xFF and a few more
    return keep


def _cases() -> dict[str, str]:
    cases = {f"llama.cpp/{n}": text for n, text in llama_cpp_grammars().items()}
    cases.update({f"edge/{n}": text for n, (text, _) in EDGES.items()})
    for n, schema in CORPUS.items():
        try:
            cases[f"schema/{n}"] = lloyal.json_schema_to_grammar(schema)
        except lloyal.GrammarError:
            continue  # a schema llama.cpp's converter refuses has no GBNF to compare
    return cases


CASES = _cases()
# The walks compare whole masks, ~0.1 s a step on llama.cpp's engine: llama.cpp's grammars, the
# edge cases and every fourth schema.
WALKED = [n for i, n in enumerate(sorted(CASES)) if not n.startswith("schema/") or i % 4 == 0]


def _pair(ctx: lloyal.Context, text: str) -> tuple[lloyal.Grammar, lloyal.Grammar]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", lloyal.GrammarEngineWarning)
        ours = lloyal.Grammar.from_gbnf(ctx, text)
    return ours, lloyal.Grammar.from_gbnf(ctx, text, engine="llama.cpp")


def _verdict(g: lloyal.Grammar, tokens: list[int], eog: int) -> str:
    g = g.clone()
    for i, t in enumerate(tokens):
        if not g.allows(t):
            return f"rejected at {i}"
        g.accept(t)
    return "complete" if g.allows(eog) else "unfinished"


def _mask(ctx: lloyal.Context, g: lloyal.Grammar) -> np.ndarray:
    logits = np.zeros(ctx.n_vocab, dtype=np.float32)
    g.apply(logits)
    return logits == 0.0


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_grammar_runs_on_llguidance(ctx: lloyal.Context, name: str) -> None:
    ours, theirs = _pair(ctx, CASES[name])
    assert (ours.engine, ours.fallback, theirs.engine) == ("llguidance", None, "llama.cpp")
    assert ours.kind == "gbnf" and ours.gbnf == CASES[name]


@pytest.mark.parametrize("name", WALKED)
def test_random_walks_see_the_same_masks(ctx: lloyal.Context, text_tokens: np.ndarray, name: str) -> None:
    ours, theirs = _pair(ctx, CASES[name])
    rng = random.Random(name)
    for _walk in range(2):
        a, b = ours.clone(), theirs.clone()
        for step in range(6):
            mine, ref = _mask(ctx, a) & text_tokens, _mask(ctx, b) & text_tokens
            diff = np.flatnonzero(mine != ref)
            assert diff.size == 0, (
                f"step {step}: {diff.size} tokens differ, e.g. "
                f"{[(int(t), ctx.detokenize([int(t)]), bool(mine[t])) for t in diff[:5]]}"
            )
            allowed = [int(t) for t in np.flatnonzero(mine) if int(t) != ctx.eog_token]
            if not allowed:
                break
            token = rng.choice(allowed)
            a.accept(token)
            b.accept(token)


def _mutations(text: str, rng: random.Random) -> list[str]:
    alphabet = 'ab "{}[],:0123456789-=+*/().\n\tétrue'
    out = []
    for _ in range(4):
        if not text:
            break
        i = rng.randrange(len(text) + 1)
        kind = rng.randrange(3)
        c = rng.choice(alphabet)
        inserted, deleted, replaced = (
            text[:i] + c + text[i:],
            text[:i] + text[i + 1 :],
            text[:i] + c + text[i + 1 :],
        )
        out.append((inserted, deleted, replaced)[kind])
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_strings_end_the_same_way(ctx: lloyal.Context, text_tokens: np.ndarray, name: str) -> None:
    ours, theirs = _pair(ctx, CASES[name])
    rng = random.Random(name)
    strings = list(EDGES[name[5:]][1]) if name.startswith("edge/") else []
    # A document walked under the grammar, then its mutations.
    g, made = ours.clone(), []
    for _ in range(24):
        allowed = [int(t) for t in np.flatnonzero(_mask(ctx, g) & text_tokens) if int(t) != ctx.eog_token]
        if not allowed:
            break
        made.append(rng.choice(allowed))
        g.accept(made[-1])
    text = ctx.detokenize(made)
    strings += [text, *_mutations(text, rng)]
    eog = ctx.eog_token
    for s in strings:
        tokens = ctx.tokenize(s, add_special=False)
        assert _verdict(ours, tokens, eog) == _verdict(theirs, tokens, eog), repr(s)
    assert _verdict(ours, made, eog) == _verdict(theirs, made, eog) != "rejected at 0"


def test_a_grammar_that_matches_nothing_is_refused(ctx: lloyal.Context) -> None:
    """A start rule that can match no text (here through a backwards range) is a GrammarError
    naming the rules, not a fallback, whichever engine is asked for: llama.cpp's used to take
    it, get stuck after ``{`` and fail at that token blaming a logit bias."""
    text = 'root ::= "{" pair "}"\npair ::= [a-(]+ ":"\n'
    with pytest.raises(lloyal.GrammarError, match=r"accepts no text: rule \"root\".*pair.*backwards range"):
        lloyal.Grammar.from_gbnf(ctx, text)
    for engine in ("llguidance", "llama.cpp"):
        with pytest.raises(lloyal.GrammarError, match="accepts no text"):
            lloyal.Grammar.from_gbnf(ctx, text, engine=engine)
        with pytest.raises(lloyal.GrammarError, match="accepts no text"):
            lloyal.Grammar.from_gbnf(ctx, "root ::= [z-a]", engine=engine)


@pytest.mark.parametrize("engine", ["auto", "llguidance", "llama.cpp"])
def test_groups_nested_too_deep_are_refused_on_every_engine(ctx: lloyal.Context, engine: str) -> None:
    """200,000 nested groups would overflow a recursive parser's stack (lloyal's reader as
    llama.cpp's): a GrammarError from the pre-flight check on every engine, not a crash."""
    deep = "root ::= " + "(" * 200_000 + '"a"' + ")" * 200_000
    with pytest.raises(lloyal.GrammarError, match="nests groups more than"):
        lloyal.Grammar.from_gbnf(ctx, deep, engine=engine)  # type: ignore[arg-type]


def test_a_long_chain_of_plain_rules_stays_on_llguidance(ctx: lloyal.Context) -> None:
    """Plain rules are inlined into one lexeme regex, at most 32 deep: a chain of 150 rules each
    referring to the next used to nest past what llguidance's regex parser takes (from 82 rules),
    and fell back to llama.cpp's engine ('cannot express')."""
    n = 150
    text = "\n".join(f"r{i} ::= r{i + 1} [a-c]?" for i in range(n)) + f'\nr{n} ::= "c"\nroot ::= r0 "c"'
    g = lloyal.Grammar.from_gbnf(ctx, text, engine="llguidance")
    assert g.engine == "llguidance"
    params = lloyal.SamplingParams(temperature=1.0, seed=4)
    with lloyal.Branch.create(ctx, 0, params, grammar=g) as b:
        b.prefill(ctx.tokenize("Letters:"))
        out = "".join(t.text for t in b.generate(200))
    assert re.fullmatch(r"c[a-c]{0,150}c", out), out
