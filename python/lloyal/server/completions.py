"""``POST /v1/completions`` and ``POST /v1/chat/completions``: a request checked, translated to
scheduler specs (:mod:`.translate`), run, and answered whole or streamed (:mod:`.streaming`).

Streamed requests are checked against the scheduler (:meth:`~.scheduler.Scheduler.check`) before
the stream starts, so a refusal gets its status rather than an error inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

import lloyal

from ..scheduling.scheduler import Done, TokenEvent
from .constraints import constraint_fields, output_grammar
from .content_stream import opens_reasoning
from .generation import run_all
from .protocol import ApiError, ChatRequest, CompletionRequest
from .replies import chat_logprobs, completion_logprobs, prompt_logprobs, usage
from .state import ServerState, StateGetter
from .streaming import chat_chunks, completion_chunks, sse
from .tools import ToolChoice, tool_choice
from .translate import chat_prompt, check_model, content_as_parts, gen_spec, message_dict, token_lists

__all__ = ["add_routes", "answer_chat", "answer_completion"]


def add_routes(app: FastAPI, state: StateGetter) -> None:
    """Register the two routes on ``app``; they answer from the running state ``state()`` returns."""

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Response | dict[str, Any]:
        return await answer_completion(state(), body)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest) -> Response | dict[str, Any]:
        return await answer_chat(state(), body)


async def answer_completion(st: ServerState, body: CompletionRequest) -> Response | dict[str, Any]:
    """``/v1/completions``: ``n`` of ``best_of`` choices per prompt (several prompts run at once)."""
    ctx = st.ctx
    check_model(body.model, st.cfg)
    best_of = _completion_best_of(body)
    _choices_fit(st, best_of, "best_of" if body.best_of else "n")
    prompts = token_lists(ctx, body.prompt, add_special=True, param="prompt")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    grammar = await asyncio.to_thread(output_grammar, ctx, body)
    specs = [
        gen_spec(ctx, body, p, best_of, max_tokens, body.logprobs, (), grammar, st.eog_tokens)
        for p in prompts
    ]
    scored = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    if scored:  # the prompt's logprobs too, each prompt written whole
        specs = [dataclasses.replace(s, prompt_logprobs=max(scored)) for s in specs]
    cid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    echoes = [ctx.detokenize(p, special=False) if body.echo else "" for p in prompts]
    if body.stream:
        for spec in specs:
            st.scheduler.check(spec)  # refused now with a status, not inside a 200 stream
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(completion_chunks(st, specs, cid, created, st.cfg.name, body.n, echoes, include_usage))
    dones, tokens = await run_all(st, specs)
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": st.cfg.name,
        "choices": _completion_choices(ctx, body, echoes, dones, tokens),
        "usage": usage(dones),
    }


def _completion_best_of(body: CompletionRequest) -> int:
    """``best_of`` (default ``n``), after refusing what this server does not do: ``suffix``,
    ``best_of`` < ``n``, streamed ``best_of`` > ``n``."""
    if body.suffix:
        raise ApiError("suffix (fill-in-the-middle) is not supported by this server", param="suffix")
    best_of = body.best_of or body.n
    if best_of < body.n:
        raise ApiError(f"best_of ({best_of}) must be >= n ({body.n})", param="best_of")
    if body.stream and best_of != body.n:
        raise ApiError("best_of > n cannot be streamed: set stream=false or best_of=n", param="best_of")
    if body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
        raise ApiError(
            "max_tokens 0 returns nothing: set echo=true (the prompt, scored with logprobs), "
            "prompt_logprobs, or max_tokens >= 1",
            param="max_tokens",
        )
    _unstreamed_prompt_logprobs(body)
    return best_of


def _choices_fit(st: ServerState, best_of: int, param: str) -> None:
    """A 400 naming ``param`` for more choices than decode at once here (``--parallel``)."""
    try:
        st.scheduler.book.check(best_of)
    except ValueError as exc:
        raise ApiError(str(exc), param=param) from None


def _unstreamed_prompt_logprobs(body: CompletionRequest | ChatRequest) -> None:
    """A 400 for vLLM's ``prompt_logprobs`` in a stream, which vLLM refuses too."""
    if body.stream and body.prompt_logprobs is not None:
        raise ApiError("prompt_logprobs cannot be streamed: set stream=false", param="prompt_logprobs")


def _completion_choices(
    ctx: lloyal.Context,
    body: CompletionRequest,
    echoes: Sequence[str],
    dones: Sequence[Done],
    tokens: Sequence[Sequence[Sequence[TokenEvent]]],
) -> list[dict[str, Any]]:
    """The finished choices, ``n`` per prompt in prompt order (index ``p * n + j``)."""
    choices = []
    for p, (done, evs) in enumerate(zip(dones, tokens, strict=True)):
        echoed = (
            [dataclasses.replace(e, top=e.top[: body.logprobs]) for e in done.prompt] if body.echo else []
        )
        scored = None if body.prompt_logprobs is None else prompt_logprobs(done.prompt, body.prompt_logprobs)
        for j, i in enumerate(done.choices):
            choice = {
                "index": p * body.n + j,
                "text": echoes[p] + done.texts[i],
                "logprobs": None if body.logprobs is None else completion_logprobs(ctx, [*echoed, *evs[i]]),
                "finish_reason": done.finish_reasons[i],
            }
            if scored is not None:  # every choice repeats its prompt's
                choice["prompt_logprobs"] = scored
            choices.append(choice)
    return choices


async def answer_chat(st: ServerState, body: ChatRequest) -> Response | dict[str, Any]:
    """``/v1/chat/completions``: the messages through the model's chat template, ``n`` choices,
    tool calls parsed from the output when the request offers tools, or generated under a grammar
    when it forces one (:mod:`.tools`)."""
    ctx = st.ctx
    check_model(body.model, st.cfg)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
    _unstreamed_prompt_logprobs(body)
    _choices_fit(st, body.n, "n")
    choice = tool_choice(body)
    parts = content_as_parts(ctx.model.chat_template)
    messages = [message_dict(m.model_dump(exclude_none=True), parts) for m in body.messages]
    fc = chat_prompt(ctx, body, messages, choice.tools)
    prompt = ctx.tokenize(fc.prompt, add_special=False, parse_special=True)
    grammar = await asyncio.to_thread(_chat_grammar, ctx, body, choice)
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, ctx.n_ctx - len(prompt))
    k = (body.top_logprobs or 0) if body.logprobs else None
    spec = gen_spec(ctx, body, prompt, body.n, max_tokens, k, fc.stop_tokens, grammar, st.eog_tokens)
    spec = dataclasses.replace(spec, prompt_logprobs=body.prompt_logprobs)
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        st.scheduler.check(spec)  # refused now with a status, not inside a 200 stream
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(
            chat_chunks(
                st, spec, cid, created, st.cfg.name, choice, include_usage, opens_reasoning(fc.prompt)
            )
        )
    dones, tokens = await run_all(st, [spec])
    reply = {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": st.cfg.name,
        "choices": _chat_choices(ctx, body, choice, dones[0], tokens[0]),
        "usage": usage(dones),
    }
    if body.prompt_logprobs is not None:  # vLLM's: the response's, not a choice's
        reply["prompt_logprobs"] = prompt_logprobs(dones[0].prompt, body.prompt_logprobs)
    return reply


def _chat_grammar(ctx: lloyal.Context, body: ChatRequest, choice: ToolChoice) -> lloyal.Grammar | None:
    """A forced tool call's grammar, or the request's output constraint (:mod:`.constraints`)."""
    if choice.forced is None:
        return output_grammar(ctx, body)
    given = constraint_fields(body)
    if given:
        raise ApiError(
            f"a forced tool_choice constrains the output itself: drop {given[0]}, "
            "or set tool_choice to 'auto'",
            param="tool_choice",
        )
    return choice.grammar(ctx)


def _chat_choices(
    ctx: lloyal.Context,
    body: ChatRequest,
    tools: ToolChoice,
    done: Done,
    evs: Sequence[Sequence[TokenEvent]],
) -> list[dict[str, Any]]:
    """The finished choices as assistant messages, with their logprobs when asked for."""
    choices = []
    for j, i in enumerate(done.choices):
        message, reason = tools.message(done.texts[i], done.finish_reasons[i])
        choice: dict[str, Any] = {"index": j, "message": message, "finish_reason": reason}
        choice["logprobs"] = {"content": chat_logprobs(ctx, evs[i])} if body.logprobs else None
        choices.append(choice)
    return choices
