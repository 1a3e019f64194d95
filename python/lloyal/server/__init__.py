"""``lloyal serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on one lloyal context.

Needs the extra: ``pip install 'lloyal[server]'``. Requests share decode steps (one
``llama_decode`` per step for every running completion), ``n``/``best_of`` completions are forks
of one prefill, and finished requests' KV stays in a radix prefix cache that later requests
fork from. Endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/v1/embeddings``, ``/tokenize``, ``/detokenize``, ``/health``, ``/metrics``. See docs/server.md.

Example (serving until Ctrl-C)::

    from lloyal.server import ServerConfig, serve
    serve(ServerConfig(model=lloyal.default_model_path()), port=8000)
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"lloyal.server needs the server extra ({exc.name} is missing): pip install 'lloyal[server]'"
    ) from exc

import asyncio
import signal
import socket
from types import FrameType

from fastapi import FastAPI

from .app import ServerConfig, begin_shutdown, create_app

__all__ = ["GracefulServer", "ServerConfig", "begin_shutdown", "create_app", "serve"]


class GracefulServer(uvicorn.Server):
    """uvicorn's server with lloyal's shutdown: on SIGTERM/SIGINT it stops accepting connections,
    answers 503 on the ones still open, lets running requests finish for ``cfg.shutdown_grace``
    seconds, cancels the rest, and returns normally (exit status 0). A second SIGINT forces exit."""

    def __init__(self, app: FastAPI, config: uvicorn.Config, grace: float) -> None:
        super().__init__(config)
        self.app, self.grace = app, grace

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises the captured signal after shutting down, which would end the process
        # with -SIGTERM; a drained server exits with status 0 instead (not recording the signal).
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            drain = asyncio.wrap_future(begin_shutdown(self.app, self.grace))
        except RuntimeError:  # stopped before the app started: nothing runs yet
            drain = None
        await super().shutdown(sockets)  # stops accepting; waits for open connections to finish
        if drain is not None:
            await drain


def serve(cfg: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the app for ``cfg`` with uvicorn until SIGTERM/SIGINT, then shut down gracefully."""
    # uvicorn's own deadline is a backstop: the drain cancels what is left at cfg.shutdown_grace
    app = create_app(cfg)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(cfg.shutdown_grace) + 10,
    )
    GracefulServer(app, config, cfg.shutdown_grace).run()
