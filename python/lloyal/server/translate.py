"""Request bodies to generation: token lists, sampling parameters, grammars and chat messages
checked and turned into the scheduler's :class:`~.scheduler.GenSpec`. Every refusal is an
:class:`~.protocol.ApiError` naming the field (``param``) at fault."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

import lloyal

from ..scheduling.scheduler import GenSpec
from .config import ServerConfig
from .protocol import ApiError, ChatRequest, CompletionRequest, EmbeddingRequest

#: Most stop strings a request gives: OpenAI takes 4, vLLM and llama-server any number; each is
#: looked for at every token, so the list is bounded.
MAX_STOP = 64

__all__ = [
    "chat_prompt",
    "check_ids",
    "check_lora",
    "check_model",
    "content_as_parts",
    "gen_spec",
    "message_dict",
    "token_lists",
]


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
    """A prompt/input field (text, texts, token ids, lists of token ids) as token lists. Text
    is read with its special tokens (``<start_of_turn>``, ``<|im_start|>``...) as those tokens,
    as llama-server and vLLM read a prompt a client rendered with the chat template itself."""
    if isinstance(value, str):
        out = [ctx.tokenize(value, add_special=add_special, parse_special=True)]
    elif value and all(isinstance(x, int) for x in value):
        out = [list(value)]
    elif value and all(isinstance(x, str) for x in value):
        out = [ctx.tokenize(x, add_special=add_special, parse_special=True) for x in value]
    elif value and all(isinstance(x, list) for x in value):
        out = [list(x) for x in value]
    else:
        raise ApiError(f"{param} must be a string, a list of strings, or token ids", param=param)
    for toks in out:
        check_ids(ctx, toks, param)
    return out


def check_ids(ctx: lloyal.Context, tokens: Sequence[int], param: str) -> None:
    """A 400 naming ``param`` for the first of ``tokens`` outside the vocabulary."""
    bad = next((t for t in tokens if not 0 <= t < ctx.n_vocab), None)
    if bad is not None:
        raise ApiError(
            f"{param} holds token id {bad}, outside the vocabulary [0, {ctx.n_vocab})", param=param
        )


def gen_spec(
    ctx: lloyal.Context,
    body: CompletionRequest | ChatRequest,
    prompt: list[int],
    best_of: int,
    max_tokens: int,
    logprobs: int | None,
    stop_tokens: Sequence[int],
    grammar: lloyal.Grammar | None,
    eog: Sequence[int] = (),
) -> GenSpec:
    """One prompt of ``body`` as what the scheduler runs, refused if it does not fit the context.
    ``eog``: the model's end-of-generation tokens, banned when ``body.ignore_eos``."""
    _refuse_unimplemented(body)
    check_lora(ctx, body)
    if body.stream_options is not None and not body.stream:
        raise ApiError("stream_options is only allowed with stream=true", param="stream_options")
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
    if body.ignore_eos:
        if grammar is not None:
            raise ApiError(
                "ignore_eos cannot go with an output constraint, which ends with the end-of-generation token",
                param="ignore_eos",
            )
        bias |= dict.fromkeys(eog, float("-inf"))
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise ApiError(f"stop takes at most {MAX_STOP} non-empty strings", param="stop")
    if body.min_tokens > max_tokens:
        raise ApiError(
            f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})", param="min_tokens"
        )
    if body.min_tokens and grammar is not None:
        raise ApiError(
            "min_tokens cannot go with an output constraint, which may end before it",
            param="min_tokens",
        )
    stop_ids = body.stop_token_ids or []
    check_ids(ctx, stop_ids, "stop_token_ids")
    return GenSpec(
        prompt=prompt,
        params=params,
        max_tokens=max_tokens,
        n=body.n,
        best_of=best_of,
        stop=stop,
        stop_tokens=[*stop_tokens, *stop_ids],
        min_tokens=body.min_tokens,
        include_stop_str=body.include_stop_str_in_output,
        grammar=grammar,
        logit_bias=bias,
        logprobs=logprobs,
        seed=body.seed,
    )


_F32_MAX = float(np.finfo(np.float32).max)


def check_lora(ctx: lloyal.Context, body: CompletionRequest | ChatRequest | EmbeddingRequest) -> None:
    """A 400 unless the body's ``lora`` (llama-server's ``[{"id", "scale"}]``; an adapter left
    out has scale 0) asks for the adapters every request runs under: one context decodes every
    request, and its adapters are fixed."""
    if body.lora is None:
        return
    ours = [scale for _, scale in ctx.lora]
    asked = [0.0] * len(ours)
    for item in body.lora:
        if item.id >= len(ours):
            raise ApiError(
                f"lora id {item.id} does not exist: this server has {len(ours)} adapter(s) "
                "(GET /lora-adapters)",
                param="lora",
            )
        # as the context holds its scales (beyond float32's range: none of the server's)
        asked[item.id] = float(np.float32(item.scale)) if abs(item.scale) <= _F32_MAX else math.inf
    if asked != ours:
        raise ApiError(
            f"per-request LoRA scales are not supported: every request runs under the server's "
            f"adapters at their scales [{', '.join(f'{x:g}' for x in ours)}] (GET /lora-adapters); "
            "leave lora out, or start the "
            "server with the scales you want (--lora-scaled FNAME:SCALE)",
            param="lora",
        )


def _refuse_unimplemented(body: CompletionRequest | ChatRequest) -> None:
    """A 400 for a vLLM extension this server does not implement, when it asks for something."""
    asked = {
        "skip_special_tokens": not body.skip_special_tokens,
        "use_beam_search": body.use_beam_search,
        "truncate_prompt_tokens": body.truncate_prompt_tokens is not None,
        "chat_template": isinstance(body, ChatRequest) and body.chat_template is not None,
    }
    for name, given in asked.items():
        if given:
            raise ApiError(f"{name} is not supported by this server: leave it out", param=name)


def _sampling_params(body: CompletionRequest | ChatRequest) -> lloyal.SamplingParams:
    """The body's sampling fields (``top_k`` -1 is 0: off; the seed is taken mod 2**32), with
    llama-server's typical-p, penalty window, mirostat, DRY and XTC."""
    mirostat = dry = xtc = None
    if body.mirostat:
        mirostat = lloyal.Mirostat(version=body.mirostat, tau=body.mirostat_tau, eta=body.mirostat_eta)
    if body.dry_multiplier > 0:
        dry = lloyal.Dry(
            multiplier=body.dry_multiplier,
            base=body.dry_base,
            allowed_length=body.dry_allowed_length,
            penalty_last_n=body.dry_penalty_last_n,
            sequence_breakers=tuple(body.dry_sequence_breakers),
        )
    if body.xtc_probability > 0:
        xtc = lloyal.Xtc(probability=body.xtc_probability, threshold=body.xtc_threshold)
    return lloyal.SamplingParams(
        temperature=body.temperature,
        top_k=max(0, body.top_k),
        top_p=body.top_p,
        min_p=body.min_p,
        typical_p=body.typical_p,
        repeat_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        penalty_last_n=body.repeat_last_n,
        seed=None if body.seed is None else body.seed & 0xFFFFFFFF,
        mirostat=mirostat,
        dry=dry,
        xtc=xtc,
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


# a template that loops over a message's content reads it as a list of parts (vLLM's "openai"
# content format); any other reads it as a string
_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(?:\.content\b|\[\s*['\"]content['\"]\s*\])")


def content_as_parts(template: str | None) -> bool:
    """Whether the chat ``template`` reads a message's content as a list of parts (it loops over
    it); otherwise :func:`message_dict` joins text parts into one string, as vLLM detects it."""
    return template is not None and _ITERATES_CONTENT.search(template) is not None


def message_dict(m: dict[str, Any], parts: bool = True) -> dict[str, Any]:
    """A chat message as the chat template takes it: OpenAI's ``developer`` role as
    ``system``, text content parts only (joined by
    newlines into one string unless the template reads ``parts``, as vLLM gives a string-content
    template), ``content`` kept when null (templates test ``content is none`` on a turn that
    only calls tools), and tool calls' JSON ``arguments`` strings parsed (empty: ``{}``)."""
    m.setdefault("content", None)
    if m.get("role") == "developer":
        m["role"] = "system"  # OpenAI's name for system instructions; chat templates know "system"
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise ApiError(
                    f"message content part of type {part.get('type')!r} is not supported: only text",
                    param="messages",
                )
            texts.append(str(part.get("text", "")))
        m["content"] = [{"type": "text", "text": t} for t in texts] if parts else "\n".join(texts)
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        arguments = fn.get("arguments")
        if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            fn["arguments"] = {}  # as vLLM reads a call without arguments
        elif isinstance(arguments, str):
            try:
                fn["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                raise ApiError("tool_calls[].function.arguments must be JSON", param="messages") from None
    return m


# format_chat's own parameters, which chat_template_kwargs cannot set
_TEMPLATE_RESERVED = ("messages", "add_generation_prompt", "template", "tools")


def chat_prompt(
    ctx: lloyal.Context, body: ChatRequest, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> lloyal.FormattedChat:
    """``messages`` through the model's chat template, with ``body``'s ``chat_template_kwargs``
    as template variables; ``add_generation_prompt`` opens an assistant turn, and
    ``continue_final_message`` leaves the last message open for the model to go on with (the
    prompt ends with its text, as vLLM renders it)."""
    kwargs = body.chat_template_kwargs or {}
    reserved = [k for k in _TEMPLATE_RESERVED if k in kwargs]
    if reserved:
        raise ApiError(f"chat_template_kwargs cannot set {reserved[0]!r}", param="chat_template_kwargs")
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(
            "continue_final_message continues the last message: set add_generation_prompt to false",
            param="continue_final_message",
        )
    fc = ctx.format_chat(messages, add_generation_prompt=body.add_generation_prompt, tools=tools, **kwargs)
    if not body.continue_final_message:
        return fc
    # as transformers' apply_chat_template (vLLM's) cuts it: after the last occurrence of the
    # message's text (its last text part), stripped
    content = messages[-1].get("content")
    if isinstance(content, list):
        content = next((p["text"] for p in reversed(content) if "text" in p), "")
    text = str(content or "").strip()
    at = fc.prompt.rfind(text) if text else -1
    if at < 0:
        raise ApiError(
            "continue_final_message needs a last message with text that the chat template keeps as it is",
            param="continue_final_message",
        )
    return dataclasses.replace(fc, prompt=fc.prompt[: at + len(text)])
