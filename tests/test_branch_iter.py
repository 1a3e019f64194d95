"""`for tok in branch`, `branch.generate(max_tokens)`, Token text UTF-8 safety (docs/api.md, "Branch")."""

from __future__ import annotations

import pytest
from helpers import context_fixture, prefilled, produce_commit

import lloyal
from lloyal import Branch, BranchStore

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
# A character the default tokenizer spells with four byte-fallback tokens.
SPLIT_CHAR = "\U0001d518"  # MATHEMATICAL FRAKTUR CAPITAL U


ctx = context_fixture(n_ctx=512, n_seq_max=4)


@pytest.fixture
def root(ctx):
    return prefilled(ctx, PROMPT)


def reference_greedy(branch: Branch, n: int) -> list[int]:
    return produce_commit(branch, n)


def test_generate_max_tokens_yields_exactly_n(ctx, root):
    twin = root.fork()
    pos = root.position
    cells = BranchStore(ctx).kv_pressure.cells_used
    toks = list(root.generate(max_tokens=5))
    assert len(toks) == 5
    assert all(isinstance(t, lloyal.Token) for t in toks)
    assert root.position == pos + 5
    assert BranchStore(ctx).kv_pressure.cells_used == cells + 5
    assert ctx.kv_seq_pos_max(root.seq_id) == pos + 4
    ids = [t.token for t in toks]
    assert not any(ctx.is_stop_token(t) for t in ids)
    assert ids == reference_greedy(twin, 5)
    assert "".join(t.text for t in toks) == ctx.detokenize(ids)
    assert 1.0 <= root.perplexity < 1000.0


def test_generate_zero_and_exhausted_iterators(root):
    pos = root.position
    assert list(root.generate(max_tokens=0)) == []
    assert root.position == pos
    it = root.generate(max_tokens=2)
    assert iter(it) is it
    assert len(list(it)) == 2
    with pytest.raises(StopIteration):
        next(it)
    assert root.position == pos + 2


def test_for_loop_stops_at_stop_token_without_yielding_it(ctx, root):
    eog = ctx.eog_token
    pos = root.position
    got = []
    for tok in root:
        got.append(tok)
        if len(got) == 3:
            # from now on the branch can only produce the end-of-generation token
            root.set_logit_bias({eog: 1000.0})
        assert len(got) <= 3, "iteration did not stop at the stop token"
    ids = [t.token for t in got]
    assert len(ids) == 3 and eog not in ids
    assert root.position == pos + 3  # the stop token is not committed
    assert ctx.kv_seq_pos_max(root.seq_id) == pos + 2
    assert root.produce().is_stop
    assert "".join(t.text for t in got) == ctx.detokenize(ids)
    # a stopped branch yields nothing and stays put
    assert list(root) == []
    assert list(root.generate(max_tokens=4)) == []
    assert root.position == pos + 3


def test_iteration_stops_immediately_when_first_token_is_stop(ctx, root):
    root.steer({ctx.eog_token: 1000.0})
    pos = root.position
    assert root.produce().is_stop
    assert list(root) == []
    assert root.position == pos
    root.clear_steer()
    assert len(list(root.generate(max_tokens=1))) == 1
    assert root.position == pos + 1


def test_token_text_is_utf8_safe_across_byte_tokens(ctx, root):
    pieces = ctx.tokenize(SPLIT_CHAR, add_special=False)
    assert len(pieces) > 1, "test needs a character split over several tokens"
    it = iter(root)
    got = []
    for p in pieces:
        root.steer({p: 1000.0})  # force the next byte token
        got.append(next(it))
    root.clear_steer()
    got.extend(next(it) for _ in range(3))
    ids = [t.token for t in got]
    assert ids[: len(pieces)] == pieces
    # partial characters yield empty text, the last byte yields the whole character
    assert [t.text for t in got[: len(pieces) - 1]] == [""] * (len(pieces) - 1)
    assert got[len(pieces) - 1].text == SPLIT_CHAR
    text = "".join(t.text for t in got)
    assert "\ufffd" not in text
    assert text == ctx.detokenize(ids)
    assert text.startswith(SPLIT_CHAR)


def test_token_value_semantics(ctx, root):
    (tok,) = list(root.generate(max_tokens=1))
    assert isinstance(tok.token, int) and isinstance(tok.text, str)
    assert tok.text == ctx.token_to_text(tok.token)
    assert tok == tok
    assert "Token(" in repr(tok)


def test_iterators_of_forks_are_independent(ctx, root):
    a, b = root.fork(), root.fork()
    ta = [t.token for t in a.generate(max_tokens=3)]
    tb = [t.token for t in b.generate(max_tokens=2)]
    assert tb == ta[:2]
    assert a.position == root.position + 3
    assert b.position == root.position + 2
