"""The FastAPI application: OpenAI-compatible routes over one context and its scheduler.

:func:`create_app` assembles the app: the checks every request passes (:mod:`.gate`), the error
handlers (:mod:`.errors`; every error is answered in OpenAI's JSON shape) and the routes
(:mod:`.service`, :mod:`.embeddings`, :mod:`.completions`). The running state (:mod:`.state`: the
context, the scheduler (:mod:`.scheduler`) and, with ``embeddings=True``, a second context for
``/v1/embeddings``) is created when the app starts (its lifespan) and closed when it stops.

Shutdown: :func:`begin_shutdown` (called by :func:`lloyal.server.serve` on SIGTERM/SIGINT) makes
every route answer 503, lets running and queued requests finish for ``shutdown_grace`` seconds,
then cancels the rest and prunes their branches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from . import completions, embeddings, service
from .config import ServerConfig
from .errors import add_error_handlers, document_errors
from .gate import Gate
from .state import ServerState, StateHolder

__all__ = ["ServerConfig", "begin_shutdown", "create_app"]


def create_app(cfg: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app for ``cfg`` (serve it with uvicorn)."""
    holder: StateHolder = {}
    app = FastAPI(title="lloyal", lifespan=_lifespan(cfg, holder))
    app.state.lloyal = holder  # begin_shutdown() finds the running state here

    def state() -> ServerState:
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
    if cfg.allowed_origins:  # outside the gate: a browser's preflight carries no API key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cfg.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    add_error_handlers(app)
    document_errors(app)
    for routes in (service, embeddings, completions):
        routes.add_routes(app, state)
    return app


def _lifespan(
    cfg: ServerConfig, holder: StateHolder
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the state built (in a thread) and its scheduler started at startup,
    kept in ``holder["s"]``; the scheduler stopped and the contexts closed at shutdown."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        st = await asyncio.to_thread(ServerState, cfg)
        st.loop = asyncio.get_running_loop()
        st.scheduler.start()
        holder["s"] = st
        try:
            yield
        finally:
            await st.scheduler.stop()
            st.close()

    return lifespan


def begin_shutdown(app: FastAPI, grace: float) -> concurrent.futures.Future[int]:
    """Start draining ``app`` (thread-safe): every route answers 503 from now on, running and
    queued requests get ``grace`` seconds to finish, then the rest are cancelled and their branches
    pruned. The future resolves to the number of requests cancelled."""
    st: ServerState | None = app.state.lloyal.get("s")
    if st is None or st.loop is None:
        raise RuntimeError("the app is not running: there is nothing to shut down")
    return asyncio.run_coroutine_threadsafe(st.scheduler.drain(grace), st.loop)
