"""The server's streamed content of a reply that may call a tool
(``lloyal.server.content_stream``): plain text is sent as it comes, nothing that
``parse_chat_output`` could turn into a call or reasoning is, and what was sent plus the rest at
the end is the parsed reply's content, whatever the pieces."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("fastapi", reason="the server extra: pip install 'lloyal[server]'")
from hypothesis import given, settings
from hypothesis import strategies as st

import lloyal
from lloyal._lloyal import _chat_markers
from lloyal.server.content_stream import ContentStream, opens_reasoning

FRAGMENTS = [
    "Hello",
    " ",
    "\n",
    "world.",
    "{",
    '"name": "f"',
    "}",
    "<",
    "tool_call>",
    "<tool_call>",
    '{"name": "f", "arguments": {"x": 1}}',
    "</tool_call>",
    "<think>",
    "</think>",
    "<end_of_turn>",
    "<eos>",
    "<|python_tag|>",
    "</s",
    "a < b",
    "[",
    " [",
    "[1, 2]",
    '[{"name": "f", "arguments": {}}]',
]


def streamed(text: str, cuts: list[int], reasoning_open: bool = False) -> tuple[list[str], str]:
    """The content pieces sent for ``text`` fed in the pieces ``cuts`` make, and the rest at the end."""
    s = ContentStream(reasoning_open)
    bounds = [0, *sorted(cuts), len(text)]
    sent = [s.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    return [p for p in sent if p], s.rest(lloyal.parse_chat_output(text).content)


def test_plain_text_is_sent_as_it_comes_and_nothing_is_left_for_the_end() -> None:
    text = "  The weather in Paris is mild.\nTake a coat. "
    sent, rest = streamed(text, list(range(len(text))))
    assert "".join(sent) == "The weather in Paris is mild.\nTake a coat." and rest == ""
    assert len(sent) > 20  # character by character, not at the end


def test_a_tool_call_stops_the_content_and_the_text_after_it_comes_at_the_end() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    text = f"Let me check. {call} Done."
    sent, rest = streamed(text, list(range(len(text))))
    assert "".join(sent) == "Let me check." and rest == "  Done."
    out = lloyal.parse_chat_output(text)
    assert out.content == "Let me check.  Done." and out.tool_calls[0].name == "get_weather"


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "f", "parameters": {}}',
        ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]',  # Mistral's list of calls
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}',
        "<think>hmm</think>Paris is mild.",
        "<tool",
    ],
)
def test_what_may_be_a_call_or_reasoning_is_held(text: str) -> None:
    sent, rest = streamed(text, list(range(len(text))))
    assert sent == [] and rest == lloyal.parse_chat_output(text).content


def test_a_reply_that_begins_with_reasoning_is_held_until_the_end() -> None:
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<start_of_turn>model\n")
    text = "the user wants the weather</think>It is mild."
    sent, rest = streamed(text, [5, 10, 30], reasoning_open=True)
    assert sent == [] and rest == "It is mild."


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=10),
    st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_what_was_sent_and_the_rest_are_the_parsed_content(fragments: list[str], cuts: list[int]) -> None:
    text = "".join(fragments)
    sent, rest = streamed(text, [c for c in cuts if c <= len(text)])
    content = lloyal.parse_chat_output(text).content
    joined = "".join(sent)
    if content.startswith(joined):
        assert joined + rest == content
    else:  # only plain text sent before a lone </think>, which made it reasoning
        close, open_ = text.find("</think>"), text.find("<think>")
        assert close >= 0 and (open_ < 0 or close < open_)
        assert rest == content


END_MARKERS, STRUCTURE_MARKERS = _chat_markers()


def whole_text_feed(text: str, sent: str) -> tuple[str, bool]:
    """What the stream sends after ``text`` (the reply so far) when ``sent`` went out before,
    worked out over the whole text, and whether the text is still plain: the rule
    ``ContentStream`` keeps while it works on each piece alone."""
    if any(m in text for m in STRUCTURE_MARKERS):
        return "", False
    for m in END_MARKERS:
        text = text.replace(m, "")
    text = text.lstrip()
    if text.startswith("{"):
        return "", False
    held = max(
        [
            0,
            *(
                k
                for m in END_MARKERS + STRUCTURE_MARKERS
                for k in range(1, min(len(m), len(text) + 1))
                if m.startswith(text[-k:])
            ),
        ]
    )
    ready = text[: len(text) - held].rstrip()
    return (ready[len(sent) :] if ready.startswith(sent) else ""), True


TRICKY = [
    "<e",
    "os>",
    "<eos>",
    "<end_",
    "of_turn>",
    "<end_of_turn>",
    "<|im",
    "_end|>",
    "</",
    "s>",
    "<thi",
    "nk>",
]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from([*TRICKY, "a", "b", " ", "\n", "{", "_", "|", "<", ">", "é"]), max_size=14))
def test_each_piece_sends_what_the_whole_text_would(pieces: list[str]) -> None:
    """Markers split across pieces, and markers that appear only once others are removed
    (``<e<end_of_turn>os>``): the stream, which works on each piece, sends what the rule over
    the whole text sends."""
    assert all(m.startswith("<") for m in END_MARKERS + STRUCTURE_MARKERS), "what the stream looks for"
    s = ContentStream(reasoning_open=False)
    text, sent, plain = "", "", True
    for p in pieces:
        text += p
        want = ""
        if plain:
            want, plain = whole_text_feed(text, sent)
            sent += want
        assert s.feed(p) == want
