"""A forced ``"required"`` reply read as it is generated: each call's name, then its arguments.

Under ``tool_choice="required"`` the model writes a JSON array of calls,
``[{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]`` (the grammar of
:mod:`.tools`). :class:`CallScanner` reads that text piece by piece, as a stream's tokens come,
and says what is new in each call: its name once the name's string is closed, then the raw text
of its ``parameters`` value as it grows. The arguments a stream sends for a call are exactly
that raw text, and so is the whole reply's ``arguments`` (:func:`required_calls`): a streamed and
an unstreamed reply agree character for character.

    >>> s = CallScanner()
    >>> s.feed('[{"name": "f", "param')
    [(0, 'f', '')]
    >>> s.feed('eters": {"x": 1')
    [(0, None, '{"x": 1')]
    >>> s.feed('}}]')
    [(0, None, '}')]

Chosen over a partial-JSON parser (vLLM's ``partial_json_parser``): the grammar already
guarantees the shape, so tracking strings, escapes and nesting is all the reading needed, and the
arguments stay the model's own text rather than a re-serialisation that changes as it grows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

__all__ = ["CallScanner", "required_calls"]

_WHITESPACE = " \t\n\r"


@dataclass
class _Call:
    name: str | None = None
    chars: list[str] = field(default_factory=list)  # its ``parameters`` text, one item a character
    sent_name: bool = False
    sent: int = 0  # characters of ``arguments`` already reported

    @property
    def arguments(self) -> str:
        """The text of its ``parameters`` value read so far."""
        return "".join(self.chars)


class CallScanner:
    """The calls of a ``"required"`` reply, read incrementally (see the module)."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._after_colon = False  # in a call object: reading a value rather than a key
        self._key: str | None = None  # the call object's key whose value is being read
        self._literal: list[str] = []  # a string literal in a call object, as read so far
        self._capturing = False  # inside the ``parameters`` value
        self._capture_depth = 0  # the depth the ``parameters`` value opened (0: a scalar)

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        """Read ``text``, the reply's next piece; for each call with something new,
        ``(index, name, arguments)``: ``name`` the first time it is known (else ``None``),
        ``arguments`` the text of its ``parameters`` added since (a call's text waits until its
        name is known)."""
        for ch in text:
            self._read(ch)
        out: list[tuple[int, str | None, str]] = []
        for i, call in enumerate(self.calls):
            if call.name is None or (call.sent_name and call.sent == len(call.chars)):
                continue
            name = None if call.sent_name else call.name
            out.append((i, name, "".join(call.chars[call.sent :])))
            call.sent_name, call.sent = True, len(call.chars)
        return out

    def _read(self, ch: str) -> None:
        call = self.calls[-1] if self.calls else None
        if self._capturing and call is not None:
            call.chars.append(ch)
        if self._in_string:
            self._read_in_string(ch, call)
            return
        if ch == '"':
            self._in_string = True
            if self._depth == 2:
                self._literal = [ch]
                if self._after_colon and self._key == "parameters" and not self._capturing:
                    self._start_capture(ch, call, depth=0)
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2 and ch == "{":
                self.calls.append(_Call())
                self._after_colon, self._key = False, None
            elif self._depth == 3 and self._after_colon and self._key == "parameters" and not self._capturing:
                self._start_capture(ch, call, depth=3)
        elif ch in "}]":
            if self._capturing and self._capture_depth == 0 and self._depth == 2 and call is not None:
                call.chars.pop()  # a scalar ends at the call's closing brace
                self._capturing = False
            if self._capturing and self._depth == self._capture_depth:
                self._capturing = False
            self._depth -= 1
        elif self._depth == 2:
            if ch == ":":
                self._after_colon = True
            elif ch == ",":
                if self._capturing and call is not None:
                    call.chars.pop()
                    self._capturing = False
                self._after_colon, self._key = False, None
            elif ch not in _WHITESPACE and self._after_colon and self._key == "parameters":
                if not self._capturing:
                    self._start_capture(ch, call, depth=0)
            elif ch in _WHITESPACE and self._capturing and self._capture_depth == 0 and call is not None:
                call.chars.pop()
                self._capturing = False

    def _start_capture(self, ch: str, call: _Call | None, depth: int) -> None:
        if call is not None and not call.chars:
            call.chars.append(ch)
            self._capturing, self._capture_depth = True, depth

    def _read_in_string(self, ch: str, call: _Call | None) -> None:
        if self._depth == 2:
            self._literal.append(ch)
        if self._escaped:
            self._escaped = False
            return
        if ch == "\\":
            self._escaped = True
            return
        if ch != '"':
            return
        self._in_string = False
        if self._depth != 2:
            return
        if self._capturing and self._capture_depth == 0:
            self._capturing = False  # a string ``parameters`` value ends with its quote
        value = json.loads("".join(self._literal))
        if not self._after_colon:
            self._key = value
        elif self._key == "name" and call is not None and call.name is None:
            call.name = value


def required_calls(text: str) -> list[tuple[str, str]] | None:
    """The ``(name, arguments)`` of a whole ``"required"`` reply (``arguments``: its
    ``parameters`` value's own text), or ``None`` when ``text`` is not a finished array of calls
    (cut by ``max_tokens``)."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    scanner = CallScanner()
    scanner.feed(text)
    return [(c.name or "", c.arguments) for c in scanner.calls]
