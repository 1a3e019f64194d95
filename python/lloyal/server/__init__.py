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

from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app", "serve"]


def serve(cfg: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the app for ``cfg`` with uvicorn until interrupted."""
    uvicorn.run(create_app(cfg), host=host, port=port, log_level=log_level)
