"""Tokenizer: round trips, specials, streaming text, stop tokens, invalid ids."""

from __future__ import annotations

import pytest

import lloyal


@pytest.mark.parametrize(
    "text", ["Hello, world!", "naïve café déjà vu", "emoji 🦙🔥 ok", "漢字とかな", "a\nb\tc"]
)
def test_round_trip(ctx: lloyal.Context, text: str) -> None:
    tokens = ctx.tokenize(text, add_special=False)
    assert tokens
    assert ctx.detokenize(tokens) == text


def test_add_special_prepends_bos(ctx: lloyal.Context) -> None:
    with_bos = ctx.tokenize("Hi", add_special=True)
    without = ctx.tokenize("Hi", add_special=False)
    assert with_bos[0] == ctx.bos_token == 2
    assert with_bos[1:] == without


def test_parse_special(ctx: lloyal.Context) -> None:
    parsed = ctx.tokenize("<start_of_turn>", add_special=False, parse_special=True)
    literal = ctx.tokenize("<start_of_turn>", add_special=False, parse_special=False)
    assert parsed == [105]
    assert len(literal) > 1
    assert ctx.detokenize(parsed, special=True) == "<start_of_turn>"
    assert ctx.detokenize(parsed) == ""


def test_token_to_text(ctx: lloyal.Context) -> None:
    (tok,) = ctx.tokenize(" Paris", add_special=False)
    assert ctx.token_to_text(tok) == " Paris"


def test_text_stream_joins_split_characters(ctx: lloyal.Context) -> None:
    text = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok"
    tokens = ctx.tokenize(text, add_special=False)
    stream = ctx.text_stream()
    pieces = [stream.push(t) for t in tokens]
    assert "".join(pieces) + stream.flush() == text
    assert "" in pieces, "some token carries only part of a character"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_tokens(ctx: lloyal.Context) -> None:
    assert ctx.eog_token == 106  # <end_of_turn> (EOT) for Gemma 3
    assert ctx.is_stop_token(ctx.eog_token)
    assert ctx.is_stop_token(1)  # <eos>
    assert not ctx.is_stop_token(ctx.tokenize("the", add_special=False)[0])


@pytest.mark.parametrize("bad", [-1, 262144, 2**40])
def test_invalid_token_ids(ctx: lloyal.Context, bad: int) -> None:
    for call in (
        lambda: ctx.detokenize([5, bad]),
        lambda: ctx.token_to_text(bad),
        lambda: ctx.is_stop_token(bad),
        lambda: ctx.text_stream().push(bad),
    ):
        with pytest.raises(lloyal.InvalidTokenError) as exc:
            call()
        assert isinstance(exc.value, ValueError)
        assert str(bad) in str(exc.value) and "262144" in str(exc.value)
