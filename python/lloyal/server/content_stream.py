"""A streamed chat reply that may call a tool (``tools`` with ``tool_choice="auto"``): its
content sent as it comes for as long as it is plain text.

Whether a reply calls a tool is only known from its whole text (:func:`lloyal.parse_chat_output`:
Hermes ``<tool_call>`` blocks, a Llama 3 JSON call, ``<think>`` reasoning, end-of-turn markers).
:class:`ContentStream` sends the text as content while it cannot become anything else: none of
those markers in it, not beginning with ``{``, and holding back leading and trailing whitespace
(the parsed content is trimmed) and an ending that may be a marker's beginning. From the first
marker on it sends nothing more; the end of the reply then brings the parsed message's content
after what was sent, with its reasoning and calls (:meth:`ContentStream.rest`). Joined, the
content sent is the unstreamed reply's ``content``.

    >>> s = ContentStream(reasoning_open=False)
    >>> [s.feed(p) for p in [" Hello", " there.", " <tool", "_call>"]]
    ['Hello', ' there.', '', '']
    >>> s.rest("Hello there.")
    ''

As vLLM does with a tool parser, but for the formats ``parse_chat_output`` reads rather than one
chosen per server; a reply of a model whose chat template opened ``<think>`` in the prompt
(``reasoning_open``) is reasoning until ``</think>`` and is held whole.
"""

from __future__ import annotations

from lloyal._lloyal import _chat_markers

__all__ = ["ContentStream", "opens_reasoning"]

# What parse_chat_output removes from the text wherever it is (end-of-turn markers), and what makes
# the text something other than plain content from there on (its own lists, from the core).
_REMOVED, _NOT_PLAIN = (tuple(m) for m in _chat_markers())
_MARKERS = _REMOVED + _NOT_PLAIN
# A character in no marker can be inside no marker, nor inside one that removing others forms: the
# removal of the text before it is final whatever follows.
_IN_MARKERS = frozenset("".join(_MARKERS))
_LONGEST = max(len(m) for m in _MARKERS)


def opens_reasoning(prompt: str) -> bool:
    """Whether ``prompt`` (a rendered chat) ends inside an opened ``<think>``: the reply begins
    with reasoning."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


class ContentStream:
    """The content of one streamed reply, sent while it is plain (see the module)."""

    def __init__(self, reasoning_open: bool) -> None:
        self.sent = ""
        self.plain = not reasoning_open
        # The reply so far is ``raw_tail`` after text whose markers removed are ``clean_head``
        # (up to a character in no marker); ``recent``: its last characters, where a marker that
        # ends in the next piece begins. A piece's markers are looked for once, not the whole
        # reply's on every piece (which took ~0.3 ms a piece at 18,000 characters).
        self.clean_head = ""
        self.raw_tail = ""
        self.recent = ""

    def feed(self, piece: str) -> str:
        """Take the reply's next ``piece``; the content to send now (empty: nothing yet)."""
        if not self.plain:
            return ""
        window = self.recent + piece
        if any(m in window for m in _NOT_PLAIN):
            self.plain = False
            return ""
        self.recent = window[-(_LONGEST - 1) :]
        # The tail held no such character: the last one, if any, is in this piece.
        tail = self.raw_tail + piece
        at = next((i for i in range(len(piece) - 1, -1, -1) if piece[i] not in _IN_MARKERS), -1)
        if at >= 0:
            cut = len(self.raw_tail) + at + 1
            self.clean_head += _remove_end_markers(tail[:cut])
            tail = tail[cut:]
        self.raw_tail = tail
        text = (self.clean_head + _remove_end_markers(tail)).lstrip()
        if text.startswith("{") or (text[:1] == "[" and text[1:].lstrip()[:1] == "{"):
            self.plain = False  # maybe a Llama 3 JSON call, or Mistral's list of calls
            return ""
        if text[:1] == "[" and not text[1:].strip():
            return ""  # a list of calls or text: the next piece tells
        ready = text[: len(text) - _marker_start(text)].rstrip()
        if not ready.startswith(self.sent):  # a marker's beginning turned out to be text: resend nothing
            return ""
        new = ready[len(self.sent) :]
        self.sent = ready
        return new

    def rest(self, content: str) -> str:
        """The parsed reply's ``content`` after what was sent (all of it in the rare reply whose
        parse does not begin with it: a ``</think>`` with no ``<think>`` after plain text)."""
        return content[len(self.sent) :] if content.startswith(self.sent) else content


def _remove_end_markers(text: str) -> str:
    """``text`` with the end-of-turn markers removed, as ``parse_chat_output`` removes them."""
    for m in _REMOVED:
        text = text.replace(m, "")
    return text


def _marker_start(text: str) -> int:
    """The length of the longest ending of ``text`` that begins a marker (0: none). Every marker
    begins with ``<``: only the endings from a ``<`` among the last characters are looked at."""
    at = text.find("<", max(0, len(text) - (_LONGEST - 1)))
    while at >= 0:
        end = text[at:]
        if any(len(end) < len(m) and m.startswith(end) for m in _MARKERS):
            return len(end)
        at = text.find("<", at + 1)
    return 0
