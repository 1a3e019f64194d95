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
from .call_scanner import CallScanner
from .content_stream import ContentStream
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
    offset: dict[int, int] = {}  # per choice, the text offset of its next token (its logprobs)
    async for k, ev in merged(st, specs):
        if isinstance(ev, PromptScores):
            lp = completion_logprobs(ctx, ev.tokens)
            prompt_end = sum(map(len, lp["tokens"]))
            for j in range(n):
                offset[k * n + j] = prompt_end
                yield chunk(k * n + j, echoes[k], lp, None)
        elif isinstance(ev, Done):
            dones.append(ev)
            for j, i in enumerate(ev.choices):
                yield chunk(k * n + j, "", None, ev.finish_reasons[i])
        elif ev.text or ev.token >= 0:
            lp = None
            if ev.logprob is not None:
                lp = completion_logprobs(ctx, [ev], offset.get(k * n + ev.index, 0))
                offset[k * n + ev.index] = lp["text_offset"][0] + len(lp["tokens"][0])
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
    reasoning_open: bool = False,
) -> AsyncIterator[dict[str, Any]]:
    """``chat.completion.chunk`` chunks: the assistant role, content deltas as they come (a forced
    call: its name, then its arguments' deltas, for each call of a ``"required"`` reply too; tools
    the model may call: content while it is plain text, :mod:`.content_stream`, then the rest of
    the parsed message at the end), each choice's finish reason, and optionally the usage.
    ``reasoning_open``: the prompt opened ``<think>`` (the reply begins with reasoning)."""
    ctx = st.ctx
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    named = tools.named
    required = tools.forced == "required"
    at_end = tools.tools is not None and tools.forced is None  # tool calls parsed from the whole text
    scanners: dict[int, CallScanner] = {}
    contents: dict[int, ContentStream] = {}

    def chunk(index: int, delta: dict[str, Any], reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        return head | {
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]
        }

    for j in range(spec.n):
        if named is not None:
            call = tool_call(named, "") | {"index": 0}
            yield chunk(j, {"role": "assistant", "content": None, "tool_calls": [call]}, None)
        else:
            yield chunk(j, {"role": "assistant", "content": None if required else ""}, None)
    done: Done | None = None
    async for _, ev in merged(st, [spec]):
        if isinstance(ev, Done):
            done = ev
            break
        if isinstance(ev, PromptScores):
            continue
        lp = {"content": chat_logprobs(ctx, [ev])} if ev.logprob is not None else None
        if at_end:
            text = contents.setdefault(ev.index, ContentStream(reasoning_open)).feed(ev.text)
            if text or lp:
                yield chunk(ev.index, {"content": text} if text else {}, None, lp)
        elif required:
            calls = _calls_delta(scanners.setdefault(ev.index, CallScanner()), ev.text)
            if calls or lp:
                yield chunk(ev.index, calls, None, lp)
        elif ev.text or lp:
            piece = {"content": ev.text} if named is None else _arguments_delta(ev.text)
            yield chunk(ev.index, piece, None, lp)
    assert done is not None
    for j, i in enumerate(done.choices):
        reason = done.finish_reasons[i]
        if at_end:
            msg, reason = tools.message(done.texts[i], reason)
            delta = {k: v for k, v in msg.items() if k != "role"}
            rest = contents[j].rest(msg["content"] or "") if j in contents else msg["content"]
            delta.pop("content")
            if rest:
                delta["content"] = rest
            if "tool_calls" in delta:
                delta["tool_calls"] = [c | {"index": x} for x, c in enumerate(delta["tool_calls"])]
            if delta:
                yield chunk(j, delta, None)
        elif required:
            reason = tools.message(done.texts[i], reason)[1]
        yield chunk(j, {}, reason)
    if include_usage:
        yield head | {"choices": [], "usage": usage([done])}


def _calls_delta(scanner: CallScanner, text: str) -> dict[str, Any]:
    """What ``text`` adds to a ``"required"`` reply's calls as a chunk's delta (empty: nothing
    yet): a call's id and name when its name is known, then pieces of its arguments."""
    calls = []
    for index, name, arguments in scanner.feed(text):
        calls.append(
            tool_call(name, arguments) | {"index": index}
            if name is not None
            else {"index": index, "function": {"arguments": arguments}}
        )
    return {"tool_calls": calls} if calls else {}


def _arguments_delta(text: str) -> dict[str, Any]:
    """A piece of a named forced call's arguments as a chunk's delta."""
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
