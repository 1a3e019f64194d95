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


def opens_reasoning(prompt: str) -> bool:
    """Whether ``prompt`` (a rendered chat) ends inside an opened ``<think>``: the reply begins
    with reasoning."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


class ContentStream:
    """The content of one streamed reply, sent while it is plain (see the module)."""

    def __init__(self, reasoning_open: bool) -> None:
        self.text = ""
        self.sent = ""
        self.plain = not reasoning_open

    def feed(self, piece: str) -> str:
        """Take the reply's next ``piece``; the content to send now (empty: nothing yet)."""
        self.text += piece
        if not self.plain:
            return ""
        if any(m in self.text for m in _NOT_PLAIN):
            self.plain = False
            return ""
        text = self.text
        for m in _REMOVED:
            text = text.replace(m, "")
        text = text.lstrip()
        if text.startswith("{"):  # maybe a Llama 3 JSON call
            self.plain = False
            return ""
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


def _marker_start(text: str) -> int:
    """The length of the longest ending of ``text`` that begins a marker (0: none)."""
    longest = 0
    for m in _MARKERS:
        for k in range(min(len(m) - 1, len(text)), longest, -1):
            if m.startswith(text[-k:]):
                longest = k
                break
    return longest
