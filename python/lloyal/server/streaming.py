"""Streamed responses (``stream=true``): server-sent events of completion and chat chunks.

An error after the stream started (the status is already 200) is sent as one more event in
OpenAI's error shape, before the closing ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

import lloyal

from ..scheduling.scheduler import Done, GenSpec, PromptScores, QueueFull, ShuttingDown
from .errors import scheduler_error
from .generation import merged
from .protocol import ApiError, error_body
from .replies import chat_logprobs, completion_logprobs, tool_call, usage
from .state import ServerState
from .tools import ToolChoice

__all__ = ["chat_chunks", "completion_chunks", "sse"]

# one encoder for every chunk (json.dumps with a non-default option builds one per call)
_encode = json.JSONEncoder(ensure_ascii=False).encode


def sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """``chunks`` as ``text/event-stream``, ended by ``data: [DONE]``."""

    async def body() -> AsyncIterator[str]:
        try:
            async for c in chunks:
                yield f"data: {_encode(c)}\n\n"
        except (ApiError, QueueFull, ShuttingDown) as exc:
            e = exc if isinstance(exc, ApiError) else scheduler_error(exc)
            yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.code))}\n\n"
        except (lloyal.LloyalError, ValueError) as exc:
            yield f"data: {json.dumps(error_body(str(exc), 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def completion_chunks(
    st: ServerState,
    specs: Sequence[GenSpec],
    cid: str,
    created: int,
    model: str,
    n: int,
    echoes: Sequence[str],
    include_usage: bool,
) -> AsyncIterator[dict[str, Any]]:
    """``text_completion`` chunks: the echoed prompts, then each token's text as it comes (choice
    ``p * n + j`` for prompt ``p``), each choice's finish reason, and optionally the usage."""
    ctx = st.ctx

    def chunk(index: int, text: str, logprobs: Any, reason: str | None) -> dict[str, Any]:
        c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [c]}

    scored = any(s.prompt_logprobs is not None for s in specs)
    for p, e in enumerate(echoes):
        if e and not scored:  # else with its logprobs, once the prompt is scored
            for j in range(n):
                yield chunk(p * n + j, e, None, None)
    dones: list[Done] = []
    async for k, ev in merged(st, specs):
        if isinstance(ev, PromptScores):
            for j in range(n):
                yield chunk(k * n + j, echoes[k], completion_logprobs(ctx, ev.tokens), None)
        elif isinstance(ev, Done):
            dones.append(ev)
            for j, i in enumerate(ev.choices):
                yield chunk(k * n + j, "", None, ev.finish_reasons[i])
        elif ev.text or ev.token >= 0:
            lp = completion_logprobs(ctx, [ev]) if ev.logprob is not None else None
            yield chunk(k * n + ev.index, ev.text, lp, None)
    if include_usage:
        yield {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": []} | {
            "usage": usage(dones)
        }


async def chat_chunks(
    st: ServerState,
    spec: GenSpec,
    cid: str,
    created: int,
    model: str,
    tools: ToolChoice,
    include_usage: bool,
) -> AsyncIterator[dict[str, Any]]:
    """``chat.completion.chunk`` chunks: the assistant role, content deltas as they come (a named
    forced call: its arguments' deltas; other tool requests: the whole parsed message at the end),
    each choice's finish reason, and optionally the usage."""
    ctx = st.ctx
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    named = tools.named
    at_end = tools.tools is not None and named is None  # tool calls parsed from the whole text

    def chunk(index: int, delta: dict[str, Any], reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        return head | {
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]
        }

    for j in range(spec.n):
        if named is None:
            yield chunk(j, {"role": "assistant", "content": ""}, None)
        else:
            call = tool_call(named, "") | {"index": 0}
            yield chunk(j, {"role": "assistant", "content": None, "tool_calls": [call]}, None)
    done: Done | None = None
    async for _, ev in merged(st, [spec]):
        if isinstance(ev, Done):
            done = ev
            break
        if at_end or isinstance(ev, PromptScores):
            continue
        lp = {"content": chat_logprobs(ctx, [ev])} if ev.logprob is not None else None
        if ev.text or lp:
            piece = {"content": ev.text} if named is None else _arguments_delta(ev.text)
            yield chunk(ev.index, piece, None, lp)
    assert done is not None
    for j, i in enumerate(done.choices):
        if at_end:
            msg, reason = tools.message(done.texts[i], done.finish_reasons[i])
            delta = {k: v for k, v in msg.items() if k != "role"}
            if "tool_calls" in delta:
                delta["tool_calls"] = [c | {"index": x} for x, c in enumerate(delta["tool_calls"])]
            yield chunk(j, delta, None)
        else:
            reason = done.finish_reasons[i]
        yield chunk(j, {}, reason)
    if include_usage:
        yield head | {"choices": [], "usage": usage([done])}


def _arguments_delta(text: str) -> dict[str, Any]:
    """A piece of a named forced call's arguments as a chunk's delta."""
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
