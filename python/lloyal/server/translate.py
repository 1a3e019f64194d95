"""Request bodies to generation: token lists, sampling parameters, grammars and chat messages
checked and turned into the scheduler's :class:`~.scheduler.GenSpec`. Every refusal is an
:class:`~.protocol.ApiError` naming the field (``param``) at fault."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import lloyal

from ..scheduling.scheduler import GenSpec
from .config import ServerConfig
from .protocol import ApiError, ChatRequest, CompletionRequest

__all__ = ["check_model", "gen_spec", "message_dict", "request_grammar", "token_lists"]


def check_model(name: str | None, cfg: ServerConfig) -> None:
    """404 unless ``name`` is omitted or the model this server serves."""
    if name is not None and name != cfg.name:
        raise ApiError(
            f"the model `{name}` does not exist: this server serves `{cfg.name}` (see /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )


def token_lists(ctx: lloyal.Context, value: Any, *, add_special: bool, param: str) -> list[list[int]]:
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


def gen_spec(
    ctx: lloyal.Context,
    body: CompletionRequest | ChatRequest,
    prompt: list[int],
    best_of: int,
    max_tokens: int,
    logprobs: int | None,
    stop_tokens: Sequence[int],
    grammar: lloyal.Grammar | None,
) -> GenSpec:
    """One prompt of ``body`` as what the scheduler runs, refused if it does not fit the context."""
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
    params = _sampling_params(body)
    bias = _logit_bias(ctx, body.logit_bias)
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


def _sampling_params(body: CompletionRequest | ChatRequest) -> lloyal.SamplingParams:
    """The body's sampling fields (``top_k`` -1 is 0: off; the seed is taken mod 2**32)."""
    return lloyal.SamplingParams(
        temperature=body.temperature,
        top_k=max(0, body.top_k),
        top_p=body.top_p,
        min_p=body.min_p,
        repeat_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=None if body.seed is None else body.seed & 0xFFFFFFFF,
    )


def _logit_bias(ctx: lloyal.Context, logit_bias: dict[str, float] | None) -> dict[int, float]:
    """``logit_bias`` keyed by token id; -100 bans the token (-inf)."""
    bias: dict[int, float] = {}
    for key, value in (logit_bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise ApiError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= tok < ctx.n_vocab:
            raise ApiError(f"logit_bias token {tok} is outside [0, {ctx.n_vocab})", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise ApiError(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        bias[tok] = float("-inf") if value <= -100.0 else value
    return bias


def message_dict(m: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the chat template takes it: text content parts only, and tool calls'
    JSON ``arguments`` strings parsed."""
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


def request_grammar(
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
