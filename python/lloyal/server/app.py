"""The FastAPI application: OpenAI-compatible routes over one context and its scheduler.

:func:`create_app` builds the app; the context, the scheduler (:mod:`.scheduler`) and, with
``embeddings=True``, a second context for ``/v1/embeddings`` are created when the app starts
(its lifespan) and closed when it stops. Every error is answered in OpenAI's JSON shape.

Shutdown: :func:`begin_shutdown` (called by :func:`lloyal.server.serve` on SIGTERM/SIGINT) makes
every route answer 503, lets running and queued requests finish for ``shutdown_grace`` seconds,
then cancels the rest and prunes their branches.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

import lloyal

from . import metrics
from .gate import Gate
from .protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    error_body,
)
from .scheduler import Done, GenSpec, QueueFull, Scheduler, ShuttingDown, TokenEvent

__all__ = ["ServerConfig", "begin_shutdown", "create_app"]


@dataclass
class ServerConfig:
    """What ``lloyal serve`` starts: the model, context sizes, concurrency and access."""

    model: Path
    n_ctx: int = 4096
    parallel: int = 8  # choices decoding at once (the sum of n/best_of over running requests)
    n_threads: int | None = None
    api_key: str | None = None
    embeddings: bool = False
    model_name: str | None = None  # the id /v1/models reports (default: the file's stem)
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    request_timeout: float | None = 600.0  # seconds from admission to the last token; then 408
    max_queue: int | None = 512  # requests waiting for a slot beyond this get 429
    shutdown_grace: float = 30.0  # seconds running requests get to finish after SIGTERM/SIGINT
    batch_invariant: bool = False  # per-row kernels: a choice's tokens do not depend on its batch
    prefill_chunk: int | None = None  # Context.engine_prefill_chunk: None paced, 0 the batch, N a cap
    cache_cells: int | None = None  # most KV cells the prefix cache keeps (None: see Scheduler)
    context_options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.model_name or self.model.stem


class _State:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        options = dict(cfg.context_options)
        if cfg.batch_invariant:
            options["batch_invariant"] = True
        self.model = lloyal.Model(cfg.model, repack=options.get("batch_invariant") is not True)
        # Per running choice: its own sequence, its request's prompt root, and the cached prefix
        # the root forked from (pinned while the request runs); +2 spare for admissions.
        n_seq_max = min(256, max(4, 3 * cfg.parallel + 2))
        self.ctx = lloyal.Context(
            self.model, n_ctx=cfg.n_ctx, n_seq_max=n_seq_max, n_threads=cfg.n_threads, **options
        )
        self.ctx.engine_prefill_chunk = cfg.prefill_chunk
        self.scheduler = Scheduler(
            self.ctx, max_running=cfg.parallel, max_queue=cfg.max_queue, cache_cells=cfg.cache_cells
        )
        self.embed_ctx = (
            lloyal.Context(self.model, n_ctx=min(cfg.n_ctx, 2048), embeddings=True, n_seq_max=4)
            if cfg.embeddings
            else None
        )
        self.embed_lock = asyncio.Lock()
        self.metrics = metrics.Metrics(self)
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None  # the app's event loop, set at startup

    def close(self) -> None:
        self.ctx.close()
        if self.embed_ctx is not None:
            self.embed_ctx.close()


def create_app(cfg: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app for ``cfg`` (serve it with uvicorn)."""
    holder: dict[str, _State] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        st = await asyncio.to_thread(_State, cfg)
        st.loop = asyncio.get_running_loop()
        st.scheduler.start()
        holder["s"] = st
        try:
            yield
        finally:
            await st.scheduler.stop()
            st.close()

    app = FastAPI(title="lloyal", lifespan=lifespan)
    app.state.lloyal = holder  # begin_shutdown() finds the running state here

    def state() -> _State:
        return holder["s"]

    def count_request(path: str, status: int) -> None:
        if "s" in holder:
            holder["s"].metrics.count_request(path, status)

    app.add_middleware(
        Gate,
        api_key=cfg.api_key,
        max_body_bytes=cfg.max_body_bytes,
        closing=lambda: "s" in holder and holder["s"].scheduler.closing,
        count=count_request,
    )

    @app.exception_handler(ApiError)
    async def api_error(_r: Request, exc: ApiError) -> JSONResponse:
        body = error_body(exc.message, exc.type, exc.param, exc.code)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(QueueFull)
    async def queue_full(r: Request, exc: QueueFull) -> JSONResponse:
        return await api_error(r, _api_error(exc))

    @app.exception_handler(ShuttingDown)
    async def shutting_down(r: Request, exc: ShuttingDown) -> JSONResponse:
        return await api_error(r, _api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_r: Request, exc: RequestValidationError) -> JSONResponse:
        """Malformed JSON is a 400; a body that parses but breaks the schema is a 422."""
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else str(first.get("msg", "invalid"))
        if first.get("type") == "json_invalid":
            body = error_body(
                f"the body is not valid JSON ({msg})", "invalid_request_error", code="json_invalid"
            )
            return JSONResponse(body, status_code=400)
        return JSONResponse(
            error_body(msg, "invalid_request_error", loc or None, code="invalid_schema"), status_code=422
        )

    @app.exception_handler(lloyal.LloyalError)
    async def lloyal_error(_r: Request, exc: lloyal.LloyalError) -> JSONResponse:
        user = isinstance(exc, lloyal.InvalidTokenError | lloyal.GrammarError | lloyal.ChatTemplateError)
        status, kind = (400, "invalid_request_error") if user else (500, "server_error")
        return JSONResponse(error_body(str(exc), kind, code=type(exc).__name__), status_code=status)

    @app.exception_handler(ValueError)
    async def value_error(_r: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        text, ctype = state().metrics.render()
        return PlainTextResponse(text, media_type=ctype)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        st = state()
        card = {"id": cfg.name, "object": "model", "created": st.created, "owned_by": "lloyal"}
        card["max_model_len"] = st.ctx.n_ctx
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx = state().ctx
        toks = ctx.tokenize(body.content, add_special=body.add_special, parse_special=True)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": ctx.token_to_text(t, special=True)} for t in toks]}
        return {"tokens": toks}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return {"content": state().ctx.detokenize(body.tokens, special=True)}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        st = state()
        ectx = st.embed_ctx
        if ectx is None:
            raise ApiError(
                "embeddings are not enabled on this server: start it with --embeddings", status=400
            )
        _check_model(body.model, cfg)
        if body.dimensions is not None and body.dimensions != ectx.embedding_dimension:
            raise ApiError(
                f"dimensions={body.dimensions} is not supported: this model's embeddings have "
                f"{ectx.embedding_dimension} dimensions (omit the field)",
                param="dimensions",
            )
        inputs = _token_lists(ectx, body.input, add_special=True, param="input")
        for toks in inputs:
            if not toks:
                raise ApiError("input must not be empty", param="input")
            if len(toks) > ectx.n_ctx:
                raise ApiError(
                    f"an input has {len(toks)} tokens but the embedding context holds {ectx.n_ctx}: "
                    "shorten it",
                    param="input",
                    code="context_length_exceeded",
                )

        def run() -> list[np.ndarray]:
            out = []
            for toks in inputs:
                ectx.kv_cache_clear()
                ectx.encode(toks)
                out.append(ectx.get_embeddings(normalize=True))
            return out

        async with st.embed_lock:
            vecs = await asyncio.to_thread(run)
        data = []
        for i, v in enumerate(vecs):
            emb: Any = (
                base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
                if body.encoding_format == "base64"
                else [float(x) for x in v]
            )
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(t) for t in inputs)
        return {
            "object": "list",
            "data": data,
            "model": cfg.name,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Response | dict[str, Any]:
        st = state()
        ctx = st.ctx
        _check_model(body.model, cfg)
        if body.suffix:
            raise ApiError("suffix (fill-in-the-middle) is not supported by this server", param="suffix")
        best_of = body.best_of or body.n
        if best_of < body.n:
            raise ApiError(f"best_of ({best_of}) must be >= n ({body.n})", param="best_of")
        if body.stream and best_of != body.n:
            raise ApiError("best_of > n cannot be streamed: set stream=false or best_of=n", param="best_of")
        if body.echo and body.logprobs is not None:
            raise ApiError(
                "echo with logprobs (prompt logprobs) is not supported: drop one of them", param="echo"
            )
        prompts = _token_lists(ctx, body.prompt, add_special=True, param="prompt")
        max_tokens = body.max_tokens or 16
        grammar = await asyncio.to_thread(_request_grammar, ctx, None, body.grammar)
        specs = [_spec(ctx, body, p, best_of, max_tokens, body.logprobs, (), grammar) for p in prompts]
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        echoes = [ctx.detokenize(p, special=False) if body.echo else "" for p in prompts]
        if body.stream:
            for spec in specs:
                st.scheduler.check(spec)  # refused now with a status, not inside a 200 stream
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_completion_chunks(st, specs, cid, created, cfg.name, body.n, echoes, include_usage))
        dones, tokens = await _run_all(st, specs)
        choices = []
        for p, (done, evs) in enumerate(zip(dones, tokens, strict=True)):
            for j, i in enumerate(done.choices):
                choices.append(
                    {
                        "index": p * body.n + j,
                        "text": echoes[p] + done.texts[i],
                        "logprobs": _completion_logprobs(ctx, evs[i]) if body.logprobs is not None else None,
                        "finish_reason": done.finish_reasons[i],
                    }
                )
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": cfg.name,
            "choices": choices,
            "usage": _usage(dones),
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest) -> Response | dict[str, Any]:
        st = state()
        ctx = st.ctx
        _check_model(body.model, cfg)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        tools = body.tools
        if body.tool_choice not in (None, "auto", "none"):
            raise ApiError(
                "tool_choice must be 'auto' or 'none' on this server (forced tool calls are not supported)",
                param="tool_choice",
            )
        if body.tool_choice == "none":
            tools = None
        messages = [_message_dict(m.model_dump(exclude_none=True)) for m in body.messages]
        fc = ctx.format_chat(messages, add_generation_prompt=True, tools=tools)
        prompt = ctx.tokenize(fc.prompt, add_special=False, parse_special=True)
        grammar = await asyncio.to_thread(_request_grammar, ctx, body.response_format, body.grammar)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, ctx.n_ctx - len(prompt))
        k = (body.top_logprobs or 0) if body.logprobs else None
        spec = _spec(ctx, body, prompt, body.n, max_tokens, k, fc.stop_tokens, grammar)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            st.scheduler.check(spec)  # refused now with a status, not inside a 200 stream
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = _chat_chunks(st, spec, cid, created, cfg.name, tools is not None, include_usage)
            return _sse(chunks)
        dones, tokens = await _run_all(st, [spec])
        done, evs = dones[0], tokens[0]
        choices = []
        for j, i in enumerate(done.choices):
            message, reason = _assistant_message(done.texts[i], done.finish_reasons[i], tools is not None)
            choice: dict[str, Any] = {"index": j, "message": message, "finish_reason": reason}
            choice["logprobs"] = {"content": _chat_logprobs(ctx, evs[i])} if body.logprobs else None
            choices.append(choice)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": cfg.name,
            "choices": choices,
            "usage": _usage(dones),
        }

    return app


def begin_shutdown(app: FastAPI, grace: float) -> concurrent.futures.Future[int]:
    """Start draining ``app`` (thread-safe): every route answers 503 from now on, running and
    queued requests get ``grace`` seconds to finish, then the rest are cancelled and their branches
    pruned. The future resolves to the number of requests cancelled."""
    st: _State | None = app.state.lloyal.get("s")
    if st is None or st.loop is None:
        raise RuntimeError("the app is not running: there is nothing to shut down")
    return asyncio.run_coroutine_threadsafe(st.scheduler.drain(grace), st.loop)


# -- request helpers -------------------------------------------------------------------------


def _check_model(name: str | None, cfg: ServerConfig) -> None:
    if name is not None and name != cfg.name:
        raise ApiError(
            f"the model `{name}` does not exist: this server serves `{cfg.name}` (see /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )


def _token_lists(ctx: lloyal.Context, value: Any, *, add_special: bool, param: str) -> list[list[int]]:
    """A prompt/input field (text, texts, token ids, lists of token ids) as token lists."""
    if isinstance(value, str):
        out = [ctx.tokenize(value, add_special=add_special)]
    elif value and all(isinstance(x, int) for x in value):
        out = [list(value)]
    elif value and all(isinstance(x, str) for x in value):
        out = [ctx.tokenize(x, add_special=add_special) for x in value]
    elif value and all(isinstance(x, list) for x in value):
        out = [list(x) for x in value]
    else:
        raise ApiError(f"{param} must be a string, a list of strings, or token ids", param=param)
    for toks in out:
        bad = [t for t in toks if not 0 <= t < ctx.n_vocab]
        if bad:
            raise ApiError(
                f"{param} holds token id {bad[0]}, outside the vocabulary [0, {ctx.n_vocab})", param=param
            )
    return out


def _spec(
    ctx: lloyal.Context,
    body: CompletionRequest | ChatRequest,
    prompt: list[int],
    best_of: int,
    max_tokens: int,
    logprobs: int | None,
    stop_tokens: Sequence[int],
    grammar: lloyal.Grammar | None,
) -> GenSpec:
    if not prompt:
        raise ApiError("the prompt is empty", param="prompt")
    if len(prompt) + max_tokens > ctx.n_ctx:
        raise ApiError(
            f"this model's maximum context length is {ctx.n_ctx} tokens, but you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for the "
            "completion): shorten the prompt or lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    params = lloyal.SamplingParams(
        temperature=body.temperature,
        top_k=max(0, body.top_k),
        top_p=body.top_p,
        min_p=body.min_p,
        repeat_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=None if body.seed is None else body.seed & 0xFFFFFFFF,
    )
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise ApiError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= tok < ctx.n_vocab:
            raise ApiError(f"logit_bias token {tok} is outside [0, {ctx.n_vocab})", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise ApiError(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        bias[tok] = float("-inf") if value <= -100.0 else value
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError("stop takes at most 4 non-empty strings", param="stop")
    return GenSpec(
        prompt=prompt,
        params=params,
        max_tokens=max_tokens,
        n=body.n,
        best_of=best_of,
        stop=stop,
        stop_tokens=list(stop_tokens),
        grammar=grammar,
        logit_bias=bias,
        logprobs=logprobs,
        seed=body.seed,
    )


def _message_dict(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.get("type") != "text":
                raise ApiError(
                    f"message content part of type {part.get('type')!r} is not supported: only text",
                    param="messages",
                )
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        m["content"] = parts
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                raise ApiError("tool_calls[].function.arguments must be JSON", param="messages") from None
    return m


def _request_grammar(
    ctx: lloyal.Context, fmt: dict[str, Any] | None, gbnf: str | None
) -> lloyal.Grammar | None:
    """``response_format`` or llama-server's ``grammar`` (GBNF) as a grammar on llguidance, the
    engine of every grammar kind (the token mask is applied before sampling)."""
    if gbnf is not None:
        if fmt and fmt.get("type") not in (None, "text"):
            raise ApiError("give either grammar or response_format, not both", param="grammar")
        try:
            return lloyal.Grammar.from_gbnf(ctx, gbnf)
        except lloyal.GrammarError as exc:
            raise ApiError(f"grammar: {exc}", param="grammar") from None
    return _response_grammar(ctx, fmt)


def _response_grammar(ctx: lloyal.Context, fmt: dict[str, Any] | None) -> lloyal.Grammar | None:
    """``response_format`` as a grammar."""
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return lloyal.Grammar.from_json_schema(ctx, {"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ApiError(
                "response_format.json_schema.schema must be a JSON schema object", param="response_format"
            )
        try:
            return lloyal.Grammar.from_json_schema(ctx, schema)
        except lloyal.GrammarError as exc:
            raise ApiError(f"response_format schema: {exc}", param="response_format") from None
    raise ApiError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")


def _assistant_message(text: str, reason: str, with_tools: bool) -> tuple[dict[str, Any], str]:
    out = lloyal.parse_chat_output(text)
    msg: dict[str, Any] = {"role": "assistant", "content": out.content if with_tools else text}
    if out.reasoning_content is not None and with_tools:
        msg["reasoning_content"] = out.reasoning_content
    if with_tools and out.tool_calls:
        msg["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in out.tool_calls
        ]
        msg["content"] = out.content or None
        return msg, "tool_calls"
    return msg, reason


def _usage(dones: Sequence[Done]) -> dict[str, Any]:
    p = sum(d.prompt_tokens for d in dones)
    c = sum(d.completion_tokens for d in dones)
    cached = sum(d.cached_tokens for d in dones)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _api_error(exc: QueueFull | ShuttingDown) -> ApiError:
    if isinstance(exc, QueueFull):
        return ApiError(str(exc), status=429, type="rate_limit_error", code="queue_full", headers=RETRY_AFTER)
    return ApiError(str(exc), status=503, type="unavailable_error", code="shutting_down")


RETRY_AFTER = {"Retry-After": "1"}


async def _merged(st: _State, specs: Sequence[GenSpec]) -> AsyncIterator[tuple[int, TokenEvent | Done]]:
    """Events of several specs run concurrently, tagged with the spec's index; the request is
    cancelled with a 408 when it runs past ``request_timeout``."""
    timeout = st.cfg.request_timeout
    events = _merged_events(st, specs)
    if not timeout:
        async for item in events:
            yield item
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    try:
        while True:
            try:
                item = await _next_by(events, end)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:  # wait_for cancelled the request: its branches are pruned
                raise ApiError(
                    f"the request did not finish within the server's timeout of {timeout:g} s "
                    "(--request-timeout) and was cancelled: lower max_tokens or n, or retry later",
                    status=408,
                    type="timeout_error",
                    code="request_timeout",
                ) from None
            yield item
    finally:
        await events.aclose()


_Item = tuple[int, TokenEvent | Done]


async def _next_by(events: AsyncIterator[_Item], end: float) -> _Item:
    """The next of ``events``, or ``asyncio.TimeoutError`` at loop time ``end`` (the wait is
    cancelled). On 3.11+ a timer on the current task per item; ``wait_for`` would run each
    item in a task of its own (one per streamed token)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout_at(end):
            return await anext(events)
    return await asyncio.wait_for(anext(events), max(0.0, end - asyncio.get_running_loop().time()))


async def _merged_events(
    st: _State, specs: Sequence[GenSpec]
) -> AsyncGenerator[tuple[int, TokenEvent | Done], None]:
    if len(specs) == 1:
        async for ev in st.scheduler.generate(specs[0]):
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | Done] | BaseException] = asyncio.Queue()

    async def pump(k: int, spec: GenSpec) -> None:
        try:
            async for ev in st.scheduler.generate(spec):
                queue.put_nowait((k, ev))
        except BaseException as exc:
            queue.put_nowait(exc)
            raise

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(specs)]
    try:
        left = len(specs)
        while left:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item[1], Done):
                left -= 1
            yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_all(st: _State, specs: Sequence[GenSpec]) -> tuple[list[Done], list[list[list[TokenEvent]]]]:
    dones: list[Done | None] = [None] * len(specs)
    tokens: list[list[list[TokenEvent]]] = [[[] for _ in range(s.best_of)] for s in specs]
    async for k, ev in _merged(st, specs):
        if isinstance(ev, Done):
            dones[k] = ev
        elif ev.token >= 0:
            tokens[k][ev.index].append(ev)
    return [d for d in dones if d is not None], tokens


def _completion_logprobs(ctx: lloyal.Context, evs: Sequence[TokenEvent]) -> dict[str, Any]:
    pieces = [ctx.token_to_text(e.token) for e in evs]
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {
        "tokens": pieces,
        "token_logprobs": [e.logprob for e in evs],
        "top_logprobs": [{t.text: t.logprob for t in e.top} for e in evs],
        "text_offset": offsets,
    }


def _chat_logprobs(ctx: lloyal.Context, evs: Sequence[TokenEvent]) -> list[dict[str, Any]]:
    out = []
    for e in evs:
        piece = ctx.token_to_text(e.token)
        top = [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())} for t in e.top]
        out.append({"token": piece, "logprob": e.logprob, "bytes": list(piece.encode()), "top_logprobs": top})
    return out


# -- streaming -------------------------------------------------------------------------------


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for c in chunks:
                yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
        except (ApiError, QueueFull, ShuttingDown) as exc:
            e = exc if isinstance(exc, ApiError) else _api_error(exc)
            yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.code))}\n\n"
        except (lloyal.LloyalError, ValueError) as exc:
            yield f"data: {json.dumps(error_body(str(exc), 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _completion_chunks(
    st: _State,
    specs: Sequence[GenSpec],
    cid: str,
    created: int,
    model: str,
    n: int,
    echoes: Sequence[str],
    include_usage: bool,
) -> AsyncIterator[dict[str, Any]]:
    ctx = st.ctx

    def chunk(index: int, text: str, logprobs: Any, reason: str | None) -> dict[str, Any]:
        c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [c]}

    for p, e in enumerate(echoes):
        if e:
            for j in range(n):
                yield chunk(p * n + j, e, None, None)
    dones: list[Done] = []
    async for k, ev in _merged(st, specs):
        if isinstance(ev, Done):
            dones.append(ev)
            for j, i in enumerate(ev.choices):
                yield chunk(k * n + j, "", None, ev.finish_reasons[i])
        elif ev.text or ev.token >= 0:
            lp = _completion_logprobs(ctx, [ev]) if ev.logprob is not None else None
            yield chunk(k * n + ev.index, ev.text, lp, None)
    if include_usage:
        yield {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": []} | {
            "usage": _usage(dones)
        }


async def _chat_chunks(
    st: _State,
    spec: GenSpec,
    cid: str,
    created: int,
    model: str,
    with_tools: bool,
    include_usage: bool,
) -> AsyncIterator[dict[str, Any]]:
    ctx = st.ctx
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(index: int, delta: dict[str, Any], reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        return head | {
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]
        }

    for j in range(spec.n):
        yield chunk(j, {"role": "assistant", "content": ""}, None)
    texts = [""] * spec.best_of
    done: Done | None = None
    async for _, ev in _merged(st, [spec]):
        if isinstance(ev, Done):
            done = ev
            break
        texts[ev.index] += ev.text
        if with_tools:
            continue  # tool calls are parsed from the whole text at the end
        lp = {"content": _chat_logprobs(ctx, [ev])} if ev.logprob is not None else None
        if ev.text or lp:
            yield chunk(ev.index, {"content": ev.text}, None, lp)
    assert done is not None
    for j, i in enumerate(done.choices):
        if with_tools:
            msg, reason = _assistant_message(done.texts[i], done.finish_reasons[i], True)
            delta = {k: v for k, v in msg.items() if k != "role"}
            if "tool_calls" in delta:
                delta["tool_calls"] = [c | {"index": x} for x, c in enumerate(delta["tool_calls"])]
            yield chunk(j, delta, None)
        else:
            reason = done.finish_reasons[i]
        yield chunk(j, {}, reason)
    if include_usage:
        yield head | {"choices": [], "usage": _usage([done])}
