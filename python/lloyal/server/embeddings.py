"""``POST /v1/embeddings``: normalized embeddings from the second context that ``--embeddings``
creates, one input at a time under a lock, as floats or base64 of little-endian float32."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI

import lloyal

from .protocol import ApiError, EmbeddingRequest
from .state import ServerState, StateGetter
from .translate import check_lora, check_model, token_lists

__all__ = ["add_routes", "answer_embeddings"]


def add_routes(app: FastAPI, state: StateGetter) -> None:
    """Register the route on ``app``; it answers from the running state ``state()`` returns."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        return await answer_embeddings(state(), body)


async def answer_embeddings(st: ServerState, body: EmbeddingRequest) -> dict[str, Any]:
    """One embedding per input (400 when the server runs without ``--embeddings``)."""
    ectx = st.embed_ctx
    if ectx is None:
        raise ApiError("embeddings are not enabled on this server: start it with --embeddings", status=400)
    check_model(body.model, st.cfg)
    check_lora(ectx, body)
    inputs = _inputs(ectx, body)
    async with st.embed_lock:
        vecs = await asyncio.to_thread(_embed, ectx, inputs)
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
        "model": st.cfg.name,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }


def _inputs(ectx: lloyal.Context, body: EmbeddingRequest) -> list[list[int]]:
    """The inputs as token lists, each non-empty and within the embedding context; ``dimensions``
    only as the model's own."""
    if body.dimensions is not None and body.dimensions != ectx.embedding_dimension:
        raise ApiError(
            f"dimensions={body.dimensions} is not supported: this model's embeddings have "
            f"{ectx.embedding_dimension} dimensions (omit the field)",
            param="dimensions",
        )
    inputs = token_lists(ectx, body.input, add_special=True, param="input")
    # each input is pooled from one decode: at most a batch (llama-server's limit too)
    limit = min(ectx.n_ctx, ectx.n_batch)
    for toks in inputs:
        if not toks:
            raise ApiError("input must not be empty", param="input")
        if len(toks) > limit:
            raise ApiError(
                f"an input has {len(toks)} tokens but the embedding context takes at most {limit} "
                "an input: shorten it or split it",
                param="input",
                code="context_length_exceeded",
            )
    return inputs


def _embed(ectx: lloyal.Context, inputs: Sequence[list[int]]) -> list[np.ndarray]:
    """Each input's normalized embedding (blocking: run it in a thread)."""
    out = []
    for toks in inputs:
        ectx.kv_cache_clear()
        ectx.encode(toks)
        out.append(ectx.get_embeddings(normalize=True))
    return out
