"""Tokenizer: round trips, specials, streaming text, stop tokens, invalid ids."""

from __future__ import annotations

import pytest

import lloyal

N_VOCAB = 262144


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading and trailing spaces  ",
        "naïve café déjà vu, Ærøskøbing",
        "emoji 🦙🔥 ok 👩\u200d🚀",
        "漢字とかな、한국어",
        "a\nb\tc\r\n",
    ],
)
def test_round_trip(ctx: lloyal.Context, text: str) -> None:
    tokens = ctx.tokenize(text, add_special=False)
    assert tokens
    assert all(isinstance(t, int) and 0 <= t < N_VOCAB for t in tokens)
    assert ctx.detokenize(tokens) == text


def test_empty_text(ctx: lloyal.Context) -> None:
    assert ctx.tokenize("", add_special=False) == []
    assert ctx.tokenize("", add_special=True) == [ctx.bos_token]
    assert ctx.detokenize([]) == ""


def test_add_special_prepends_bos(ctx: lloyal.Context) -> None:
    with_bos = ctx.tokenize("Hi there", add_special=True)
    without = ctx.tokenize("Hi there", add_special=False)
    assert ctx.bos_token == 2  # <bos> for Gemma 3
    assert with_bos[0] == ctx.bos_token
    assert with_bos[1:] == without
    assert ctx.bos_token not in without
    assert ctx.tokenize("Hi there") == with_bos  # add_special defaults to True
    assert ctx.detokenize(with_bos) == "Hi there"  # control tokens are not rendered by default
    assert ctx.detokenize(with_bos, special=True) == "<bos>Hi there"


def test_parse_special(ctx: lloyal.Context) -> None:
    parsed = ctx.tokenize("<start_of_turn>", add_special=False, parse_special=True)
    literal = ctx.tokenize("<start_of_turn>", add_special=False, parse_special=False)
    default = ctx.tokenize("<start_of_turn>", add_special=False)
    assert parsed == [105]
    assert len(literal) > 1
    assert 105 not in literal
    assert default == literal  # parse_special defaults to False
    assert ctx.detokenize(literal) == "<start_of_turn>"  # plain text survives as text
    assert ctx.detokenize(parsed, special=True) == "<start_of_turn>"
    assert ctx.detokenize(parsed) == ""
    turn = ctx.tokenize("<start_of_turn>user\nHi<end_of_turn>\n", add_special=False, parse_special=True)
    assert turn[0] == 105 and 106 in turn


def test_token_to_text(ctx: lloyal.Context) -> None:
    (tok,) = ctx.tokenize(" Paris", add_special=False)
    assert ctx.token_to_text(tok) == " Paris"
    assert ctx.token_to_text(ctx.eog_token) == ""
    assert ctx.token_to_text(ctx.eog_token, special=True) == "<end_of_turn>"
    tokens = ctx.tokenize("The quick brown fox", add_special=False)
    assert "".join(ctx.token_to_text(t) for t in tokens) == "The quick brown fox"


def test_token_to_bytes_keeps_what_token_to_text_cannot_show(ctx: lloyal.Context) -> None:
    """A byte-fallback token's byte, which ``token_to_text`` shows as U+FFFD: the bytes of a
    text's tokens joined are the text's UTF-8."""
    tokens = ctx.tokenize("héllo 🦙 ☃", add_special=False)
    assert b"".join(ctx.token_to_bytes(t) for t in tokens) == "héllo 🦙 ☃".encode()
    llama = ctx.tokenize("🦙", add_special=False)
    assert [ctx.token_to_bytes(t) for t in llama] == [bytes([b]) for b in "🦙".encode()]
    assert ctx.token_to_bytes(ctx.eog_token) == b""
    assert ctx.token_to_bytes(ctx.eog_token, special=True) == b"<end_of_turn>"
    with pytest.raises(lloyal.InvalidTokenError):
        ctx.token_to_bytes(ctx.n_vocab)


def test_text_stream_yields_a_split_emoji_whole(ctx: lloyal.Context) -> None:
    """🦙 (4 UTF-8 bytes) is four byte-fallback tokens: the stream yields nothing for the
    first three and the whole character on the last."""
    tokens = ctx.tokenize("🦙", add_special=False)
    assert len(tokens) == 4
    assert all(ctx.token_to_text(t) == "\ufffd" for t in tokens)  # each alone is a partial character
    stream = ctx.text_stream()
    assert [stream.push(t) for t in tokens] == ["", "", "", "🦙"]
    assert stream.flush() == ""


@pytest.mark.parametrize("text", ["llama 🦙 and goose 🪿!", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok", "𓀀 hieroglyph, 🀄 tile"])
def test_text_stream_concatenation_equals_text(ctx: lloyal.Context, text: str) -> None:
    tokens = ctx.tokenize(text, add_special=False)
    stream = ctx.text_stream()
    pieces = [stream.push(t) for t in tokens]
    assert "".join(pieces) + stream.flush() == text
    assert "" in pieces, "some token carries only part of a character"
    assert all("\ufffd" not in p for p in pieces)
    # Naive per-token text would corrupt the split characters.
    assert "".join(ctx.token_to_text(t) for t in tokens) != text


def test_text_stream_flush_releases_an_incomplete_tail(ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize("🦙", add_special=False)
    stream = ctx.text_stream()
    assert stream.push(tokens[0]) == ""
    assert stream.push(tokens[1]) == ""
    assert "\ufffd" in stream.flush()
    # After a flush the stream starts clean.
    assert [stream.push(t) for t in tokens] == ["", "", "", "🦙"]


def test_stop_tokens(ctx: lloyal.Context) -> None:
    assert ctx.eog_token == 106  # <end_of_turn> (EOT) for Gemma 3
    assert ctx.is_stop_token(ctx.eog_token) is True
    assert ctx.is_stop_token(1) is True  # <eos>
    assert ctx.is_stop_token(ctx.bos_token) is False
    assert ctx.is_stop_token(ctx.tokenize("the", add_special=False)[0]) is False
    # every one of them, as the engine's min_tokens ban and the server's ignore_eos take them
    assert ctx.eog_tokens == [t for t in range(ctx.n_vocab) if ctx.is_stop_token(t)]
    assert {1, 106} <= set(ctx.eog_tokens)


def test_turn_separator(ctx: lloyal.Context) -> None:
    sep = ctx.turn_separator
    assert isinstance(sep, list) and sep
    assert all(isinstance(t, int) and 0 <= t < N_VOCAB for t in sep)
    assert sep[0] == ctx.eog_token
    assert ctx.detokenize(sep, special=True) == "<end_of_turn>\n"


@pytest.mark.parametrize("bad", [-1, N_VOCAB, N_VOCAB + 1, 2**40])
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
        assert isinstance(exc.value, lloyal.LloyalError)
        assert str(bad) in str(exc.value) and str(N_VOCAB) in str(exc.value)
    assert ctx.detokenize([5]) == ctx.token_to_text(5)  # the context still works


@pytest.mark.parametrize("bad", [2**64, -(2**70)])
def test_token_ids_past_64_bits_are_invalid_tokens(ctx: lloyal.Context, bad: int) -> None:
    """Not a bare OverflowError (pyo3's), as API.md says of any id outside the vocabulary."""
    for call in (
        lambda: ctx.detokenize([5, bad]),
        lambda: ctx.token_to_text(bad),
        lambda: ctx.is_stop_token(bad),
        lambda: ctx.text_stream().push(bad),
        lambda: ctx.decode([2, bad], 0),
        lambda: ctx.create_grammar('root ::= "a"').accept(bad),
    ):
        with pytest.raises(lloyal.InvalidTokenError):
            call()
