"""Hostile input, fuzzed with hypothesis: state blobs, JSON schemas, GBNF text, text and token
ids, model files. Every input either works or raises a documented ``lloyal`` error (or a
``ValueError`` that names the argument); nothing crashes, hangs or leaks a lease.

CI runs a few dozen examples per target (``LLOYAL_FUZZ_EXAMPLES``, default 25); ``make fuzz``
runs thousands and prints how many inputs each target saw (``LLOYAL_FUZZ_REPORT``). A hang is
turned into a failure with a traceback by ``faulthandler`` (``HANG_S`` per input).
"""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lloyal

EXAMPLES = int(os.environ.get("LLOYAL_FUZZ_EXAMPLES", "25"))
HANG_S = 60.0
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=os.environ.get("CI") == "true",  # CI: the same inputs every run
)
SEEN: Counter[str] = Counter()
OUTCOMES: Counter[str] = Counter()


@contextmanager
def no_hang(target: str) -> Iterator[None]:
    """Count one input for ``target``; abort with every thread's traceback if it hangs."""
    SEEN[target] += 1
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def outcome(target: str, call: Callable[[], object], *allowed: type[BaseException]) -> object:
    """Run ``call``; a documented error is fine (returned), anything else fails the test."""
    with no_hang(target):
        try:
            result = call()
        except allowed as e:
            OUTCOMES[f"{target}: {type(e).__name__}"] += 1
            return e
    OUTCOMES[f"{target}: ok"] += 1
    return result


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    path = os.environ.get("LLOYAL_FUZZ_REPORT")
    if path:
        Path(path).write_text(json.dumps({"inputs": SEEN, "outcomes": OUTCOMES}, indent=1, sort_keys=True))


@pytest.fixture(scope="module")
def fctx(model: lloyal.Model) -> Iterator[lloyal.Context]:
    with lloyal.Context(model, n_ctx=512, n_seq_max=4) as ctx:
        yield ctx


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None, tail: bytes) -> bytes:
    """``data`` with bytes overwritten at ``edits`` (position modulo length), cut and extended."""
    out = bytearray(data)
    for at, value in edits:
        out[at % len(out)] = value
    if cut is not None:
        del out[cut % (len(out) + 1) :]
    return bytes(out) + tail


EDITS = st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), max_size=4)
CUT = st.none() | st.integers(0, 1 << 30)
TAIL = st.binary(max_size=16)


# -- state blobs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kv_blob(fctx: lloyal.Context) -> bytes:
    fctx.decode(fctx.tokenize("The capital of France is"), 0, seq_id=3)
    blob = fctx.kv_cache_save(3)
    fctx.kv_cache_remove(3, 0)
    return blob


@FUZZ
@given(edits=EDITS, cut=CUT, tail=TAIL)
def test_kv_cache_load_of_mutated_blobs(fctx: lloyal.Context, kv_blob: bytes, edits, cut, tail) -> None:  # type: ignore[no-untyped-def]
    data = mutate(kv_blob, edits, cut, tail)
    result = outcome("kv_cache_load", lambda: fctx.kv_cache_load(2, data), lloyal.StateError)
    if isinstance(result, lloyal.StateError):
        assert fctx.kv_seq_pos_max(2) == -1  # nothing half-loaded
    else:
        assert data == kv_blob or fctx.kv_seq_pos_max(2) >= 0
    fctx.kv_cache_remove(2, 0)


@FUZZ
@given(data=st.binary(max_size=512))
def test_kv_cache_load_of_random_bytes(fctx: lloyal.Context, data: bytes) -> None:
    result = outcome("kv_cache_load", lambda: fctx.kv_cache_load(2, data), lloyal.StateError)
    assert isinstance(result, lloyal.StateError)
    assert fctx.kv_seq_pos_max(2) == -1


@pytest.fixture(scope="module")
def branch_blob(fctx: lloyal.Context) -> bytes:
    grammar = lloyal.json_schema_to_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    with lloyal.Branch.create(fctx, 0, lloyal.SamplingParams(temperature=0.7, seed=3), grammar=grammar) as b:
        b.prefill(fctx.tokenize("JSON:"))
        b.commit(b.produce().token)
        return b.save_state()


@FUZZ
@given(edits=EDITS, cut=CUT, tail=TAIL)
def test_branch_load_state_of_mutated_blobs(
    fctx: lloyal.Context, branch_blob: bytes, edits, cut, tail
) -> None:  # type: ignore[no-untyped-def]
    store = lloyal.BranchStore(fctx)
    available = store.available
    data = mutate(branch_blob, edits, cut, tail)
    result = outcome("Branch.load_state", lambda: lloyal.Branch.load_state(fctx, data), lloyal.StateError)
    if isinstance(result, lloyal.Branch):
        assert data == branch_blob
        assert result.position == fctx.kv_seq_pos_max(result.seq_id) + 1
        result.prune()
    assert store.available == available  # a refused blob takes no lease


# -- grammars ---------------------------------------------------------------------------------

SCHEMA_KEYS = st.sampled_from(
    ["type", "properties", "items", "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf",
     "pattern", "minLength", "maxLength", "minimum", "maximum", "required", "additionalProperties",
     "$ref", "$defs", "format", "prefixItems"]
)  # fmt: skip
SCHEMA_LEAVES = (
    st.sampled_from(["string", "integer", "number", "boolean", "object", "array", "null", "#", "#/$defs/a"])
    | st.integers(-(1 << 40), 1 << 40)
    | st.booleans()
    | st.text(max_size=12)
    | st.none()
)
SCHEMAS = st.recursive(
    SCHEMA_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(SCHEMA_KEYS | st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=25,
)


@FUZZ
@given(schema=SCHEMAS)
def test_json_schema_to_grammar_on_random_schemas(fctx: lloyal.Context, schema: object) -> None:
    text = json.dumps(schema)
    result = outcome(
        "json_schema_to_grammar", lambda: lloyal.json_schema_to_grammar(text), lloyal.GrammarError
    )
    if isinstance(result, str):
        outcome("create_grammar(from schema)", lambda: fctx.create_grammar(result), lloyal.GrammarError)


@FUZZ
@given(text=st.text(max_size=200))
def test_json_schema_to_grammar_on_random_text(text: str) -> None:
    outcome("json_schema_to_grammar", lambda: lloyal.json_schema_to_grammar(text), lloyal.GrammarError)


GBNF_ATOMS = st.sampled_from(
    ['root', ' ::= ', 'a', ' ', '"x"', '"', '[a-z]', '[^"]', '[', ']', '(', ')', '|', '*', '+', '?', '{', '}',
     '{2,5}', '{3,1}', '{,4}', '{7}', ',', '\\', '\n', '# c\n', '::=', 'rule', '-', '.', '\x00', '"\\u00e9"']
)  # fmt: skip
VALID_GBNF = (
    'root ::= "{" ws pair ("," ws pair)* "}"\n'
    'pair ::= [a-z]+ ":" ws ("yes" | "no" | [0-9]{1,3})\n'
    'ws ::= " "?\n'
)


def create_grammar(ctx: lloyal.Context, text: str) -> lloyal.Grammar:
    """``create_grammar``, where a fallback to llama.cpp's engine is an outcome too (GBNF that
    llguidance cannot run: the warning names why, ``Grammar.fallback`` keeps it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lloyal.GrammarEngineWarning)
        grammar = ctx.create_grammar(text)
    if grammar.fallback is not None:
        OUTCOMES[f"create_grammar: llama.cpp's engine ({grammar.fallback[:60]})"] += 1
    return grammar


@FUZZ
@given(parts=st.lists(GBNF_ATOMS, max_size=30), noise=st.text(max_size=20))
def test_create_grammar_on_gbnf_shaped_noise(fctx: lloyal.Context, parts: list[str], noise: str) -> None:
    text = "root ::= " + "".join(parts) + noise
    result = outcome("create_grammar", lambda: create_grammar(fctx, text), lloyal.GrammarError)
    if isinstance(result, lloyal.Grammar):
        with lloyal.Branch.create(fctx, 0, lloyal.SamplingParams(temperature=0.0), grammar=result) as b:
            b.prefill([2])
            produced = outcome("grammar produce", b.produce, lloyal.GrammarError)
            if isinstance(produced, lloyal.Produced):
                assert 0 <= produced.token < fctx.n_vocab


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 1 << 20), st.sampled_from(list('()[]{}"|*+?,:=\\ a0'))), max_size=4
    )
)
def test_create_grammar_on_mutated_valid_grammar(fctx: lloyal.Context, edits: list[tuple[int, str]]) -> None:
    chars = list(VALID_GBNF)
    for at, c in edits:
        chars[at % len(chars)] = c
    text = "".join(chars)
    result = outcome("create_grammar", lambda: create_grammar(fctx, text), lloyal.GrammarError)
    if not edits:
        assert isinstance(result, lloyal.Grammar)


# -- text and tokens --------------------------------------------------------------------------


@FUZZ
@given(text=st.text(max_size=300), add_special=st.booleans(), parse_special=st.booleans())
def test_tokenize_detokenize_any_text(
    fctx: lloyal.Context, text: str, add_special: bool, parse_special: bool
) -> None:
    def roundtrip() -> tuple[list[int], str]:
        tokens = fctx.tokenize(text, add_special=add_special, parse_special=parse_special)
        return tokens, fctx.detokenize(tokens, special=False)

    result = outcome("tokenize/detokenize", roundtrip, UnicodeEncodeError)  # lone surrogates
    if isinstance(result, tuple):
        tokens, back = result
        assert all(0 <= t < fctx.n_vocab for t in tokens)
        assert isinstance(back, str)


@FUZZ
@given(
    tokens=st.lists(st.integers(-(1 << 33), 1 << 33) | st.integers(0, 262_143), max_size=40),
    special=st.booleans(),
)
def test_detokenize_any_ids(fctx: lloyal.Context, tokens: list[int], special: bool) -> None:
    result = outcome(
        "detokenize", lambda: fctx.detokenize(tokens, special=special), lloyal.InvalidTokenError, ValueError
    )
    if all(0 <= t < fctx.n_vocab for t in tokens):
        assert isinstance(result, str)
    else:
        assert isinstance(result, ValueError)


@FUZZ
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=100))
def test_plain_text_round_trips(fctx: lloyal.Context, text: str) -> None:
    """Text without special-token syntax comes back exactly (NULs and controls included)."""
    with no_hang("tokenize round trip"):
        tokens = fctx.tokenize(text, add_special=False)
        assert fctx.detokenize(tokens) == text


# -- model files (in a child process: a crash there fails this test instead of killing it) ---

MODEL_FUZZ = """
import random, sys, lloyal
src, out, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
head = open(src, "rb").read(1 << 20)  # GGUF header, metadata and the start of the vocab
rng = random.Random(seed)
loaded = refused = 0
for i in range(n):
    data = bytearray(head[: rng.randrange(0, len(head))] if rng.random() < 0.5 else head)
    for _ in range(rng.randrange(1, 8)):
        at = rng.randrange(0, 4096) if rng.random() < 0.7 else rng.randrange(0, max(1, len(data)))
        if at < len(data):
            data[at] = rng.randrange(256)
    open(out, "wb").write(bytes(data))
    try:
        lloyal.Model(out)
        loaded += 1
    except lloyal.ModelLoadError:
        refused += 1
print(loaded, refused)
"""


def test_mutated_and_truncated_model_files_are_refused(tmp_path: Path, model_path: Path) -> None:
    n = max(8, EXAMPLES)
    with no_hang("model file"):
        proc = subprocess.run(
            [sys.executable, "-c", MODEL_FUZZ, str(model_path), str(tmp_path / "m.gguf"), str(n), "7"],
            capture_output=True,
            text=True,
            timeout=HANG_S * 4,
        )
    assert proc.returncode == 0, f"model loader crashed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
    loaded, refused = map(int, proc.stdout.split())
    assert (loaded, refused) == (0, n)  # a 1 MiB prefix never holds the tensors
    SEEN["model file"] += n - 1
    OUTCOMES["model file: ModelLoadError"] += refused
