"""Chat results: :class:`FormattedChat` (from ``Context.format_chat``) and :func:`parse_chat_output`.

A rendered prompt already holds the BOS text (when the template writes ``{{ bos_token }}``, as
the model's own templates and the built-in Gemma/Llama 3 ones do) and its turn markers as
text, so tokenize it with ``add_special=False, parse_special=True``.

Example:
    >>> import lloyal
    >>> with lloyal.create_context(n_ctx=512) as ctx:
    ...     chat = ctx.format_chat([{"role": "user", "content": "Hi"}])
    ...     tokens = ctx.tokenize(chat.prompt, add_special=False, parse_special=True)
    ...     chat.template_source, tokens[0] == ctx.bos_token, 106 in chat.stop_tokens
    ('builtin:gemma', True, True)
    >>> out = lloyal.parse_chat_output('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    >>> out.tool_calls[0]
    ToolCall(name='f', arguments={'x': 1})
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lloyal._lloyal import _parse_chat_output

__all__ = ["ChatOutput", "FormattedChat", "ToolCall", "parse_chat_output"]


@dataclass(frozen=True)
class FormattedChat:
    """A chat prompt rendered by ``Context.format_chat`` / ``Context.format_chat_turn``.

    Attributes:
        prompt: The prompt text; tokenize with ``add_special=False, parse_special=True``.
        stop_tokens: Tokens that end the assistant's turn (the family's end-of-turn token,
            e.g. ``<end_of_turn>`` = 106 on Gemma, then EOG/EOS).
        template_source: ``"override"`` (``template=``), ``"model"`` (the GGUF's own) or
            ``"builtin:<family>"``: ``gemma``, ``chatml``, ``llama3``, ``phi3`` or ``mistral``.
    """

    prompt: str
    stop_tokens: tuple[int, ...]
    template_source: str


@dataclass(frozen=True)
class ToolCall:
    """One function call found in model output.

    Attributes:
        name: The function name.
        arguments: Its arguments (a JSON object as a dict).
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_message_dict(self) -> dict[str, Any]:
        """This call as an entry of an assistant message's ``tool_calls`` for
        ``Context.format_chat``: ``arguments`` an object, as chat templates take it (the OpenAI
        API sends it as a JSON string, which the server parses before rendering)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ChatOutput:
    """Generated text split by :func:`parse_chat_output`.

    Attributes:
        content: The answer text, without reasoning, tool calls or end-of-turn markers.
        reasoning_content: The text inside ``<think>...</think>``, or None.
        tool_calls: Tool calls in order of appearance.
    """

    content: str
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


def parse_chat_output(text: str) -> ChatOutput:
    """Split generated ``text`` into content, ``<think>`` reasoning and tool calls.

    Understands Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks (any number) and a Llama 3 JSON call (``<|python_tag|>`` optional, then
    ``{"name": ..., "parameters": {...}}``). End-of-turn markers are removed. A tool call
    whose JSON is invalid stays in ``content``; this function never raises on model output.

    Args:
        text: Generated text (special tokens rendered or not).

    Returns:
        The parsed :class:`ChatOutput`.
    """
    content, reasoning, calls = _parse_chat_output(text)
    tool_calls = tuple(ToolCall(name, json.loads(args)) for name, args in calls)
    return ChatOutput(content, reasoning, tool_calls)
