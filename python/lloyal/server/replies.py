"""The response pieces completions and chat completions share, streamed or not: the assistant
message (tool calls parsed), usage, and logprobs in the completions and chat shapes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import lloyal

from ..scheduling.scheduler import Done, TokenEvent

__all__ = ["assistant_message", "chat_logprobs", "completion_logprobs", "tool_call", "usage"]


def assistant_message(text: str, reason: str, with_tools: bool) -> tuple[dict[str, Any], str]:
    """A choice's text as the assistant message and its finish reason (``tool_calls`` when the
    request offered tools and the text calls one)."""
    out = lloyal.parse_chat_output(text)
    msg: dict[str, Any] = {"role": "assistant", "content": out.content if with_tools else text}
    if out.reasoning_content is not None and with_tools:
        msg["reasoning_content"] = out.reasoning_content
    if with_tools and out.tool_calls:
        msg["tool_calls"] = [tool_call(c.name, json.dumps(c.arguments)) for c in out.tool_calls]
        msg["content"] = out.content or None
        return msg, "tool_calls"
    return msg, reason


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of an assistant message's ``tool_calls``: ``arguments`` is JSON text."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def usage(dones: Sequence[Done]) -> dict[str, Any]:
    """Token counts over a request's prompts (cached prompt tokens included)."""
    p = sum(d.prompt_tokens for d in dones)
    c = sum(d.completion_tokens for d in dones)
    cached = sum(d.cached_tokens for d in dones)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(ctx: lloyal.Context, evs: Sequence[TokenEvent], start: int = 0) -> dict[str, Any]:
    """``/v1/completions`` logprobs: tokens, their logprobs, the top alternatives (None where the
    logprob is: a prompt's first token), text offsets (the first at ``start``: in a stream, the
    length of the choice's tokens sent before)."""
    pieces = [ctx.token_to_text(e.token) for e in evs]
    offsets, at = [], start
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {
        "tokens": pieces,
        "token_logprobs": [e.logprob for e in evs],
        "top_logprobs": [None if e.logprob is None else {t.text: t.logprob for t in e.top} for e in evs],
        "text_offset": offsets,
    }


def prompt_logprobs(evs: Sequence[TokenEvent], k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first, which nothing comes
    before), the token itself with its rank, then the ``k`` most likely tokens there (ranks 1 to
    ``k``), keyed by token id."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in evs:
        if e.logprob is None:
            out.append(None)
            continue
        entry = {str(e.token): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.text}}
        for rank, t in enumerate(e.top[:k], start=1):
            entry.setdefault(str(t.token), {"logprob": t.logprob, "rank": rank, "decoded_token": t.text})
        out.append(entry)
    return out


def chat_logprobs(ctx: lloyal.Context, evs: Sequence[TokenEvent]) -> list[dict[str, Any]]:
    """``/v1/chat/completions`` logprobs content: one entry per token, with bytes and the top."""
    out = []
    for e in evs:
        piece = ctx.token_to_text(e.token)
        top = [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())} for t in e.top]
        out.append({"token": piece, "logprob": e.logprob, "bytes": list(piece.encode()), "top_logprobs": top})
    return out
