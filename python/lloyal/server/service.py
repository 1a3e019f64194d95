"""The routes around generation: ``GET /health``, ``GET /metrics`` (Prometheus),
``GET /v1/models``, and llama-server's ``POST /tokenize``, ``POST /detokenize`` and
``GET /lora-adapters``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from .protocol import DetokenizeRequest, TokenizeRequest
from .state import StateGetter
from .translate import check_ids

__all__ = ["add_routes"]


def add_routes(app: FastAPI, state: StateGetter) -> None:
    """Register the routes on ``app``; they answer from the running state ``state()`` returns
    (``/health`` from none)."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        text, ctype = state().metrics.render()
        return PlainTextResponse(text, media_type=ctype)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        st = state()
        card = {"id": st.cfg.name, "object": "model", "created": st.created, "owned_by": "lloyal"}
        card["max_model_len"] = st.ctx.n_ctx
        return {"object": "list", "data": [card]}

    @app.get("/lora-adapters")
    async def lora_adapters() -> list[dict[str, Any]]:
        """The adapters every request runs under, as llama-server lists them."""
        return [
            {"id": i, "path": str(adapter.path), "scale": scale}
            for i, (adapter, scale) in enumerate(state().lora)
        ]

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx = state().ctx
        toks = ctx.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": _piece(ctx.token_to_bytes(t, special=True))} for t in toks]}
        return {"tokens": toks}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx = state().ctx
        check_ids(ctx, body.tokens, "tokens")
        return {"content": ctx.detokenize(body.tokens, special=True)}


def _piece(raw: bytes) -> str | list[int]:
    """A token's piece as llama-server gives it: its text, or its bytes where they are not
    UTF-8 on their own (a byte-fallback token's part of a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
