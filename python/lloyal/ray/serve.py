"""``lloyal serve`` on Ray Serve: N replicas, each with its own model and engine, behind a router
that sends requests sharing a prompt prefix to the same replica (:mod:`lloyal.ray.routing`).

Layout: one single-replica deployment per engine (``lloyal-0`` … ``lloyal-{N-1}``; Ray restarts
a replica that dies) and a ``LloyalRouter`` ingress deployment that owns the HTTP routes. The
router reads the request body, picks the replica with :class:`~lloyal.ray.routing.HashRing`,
and streams the replica's response back with an ``x-lloyal-replica`` header. Each replica runs
the same FastAPI app as ``lloyal serve`` in-process (:mod:`lloyal.ray.asgi`), so every
endpoint, parameter, error shape and metric is the same.

Why separate deployments rather than one deployment with N replicas: a ``DeploymentHandle``
picks a replica by its own policy (power of two choices); Ray Serve's pluggable request router
is still marked alpha in Ray 2.60. One deployment per engine lets the router address a replica
by name with the stable handle API.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime
# through Serve's class-based ingress, which needs real annotation objects.
import asyncio
import inspect
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from lloyal.server.app import ServerConfig, create_app
from lloyal.server.protocol import error_body

from .asgi import Lifespan, call
from .routing import HashRing, prefix_key

__all__ = ["LloyalReplica", "LloyalRouter", "app_from_config", "ongoing_limits", "run_on_ray", "serve_app"]

ACCEPT_TIMEOUT_S = 10.0  # a replica that does not take a request this fast is treated as down
SPARE_ONGOING = 16  # requests a replica takes beyond parallel + max_queue (/metrics, /health, ...)
UNBOUNDED_QUEUE = 100_000  # what max_queue=None counts as in Serve's limits
# Starts of an engine replica Serve tries before it fails the deployment (its default, 20, takes
# a minute to report a model that cannot load); an option of Serve's since after Ray 2.40.
START_RETRIES = 3
_SERVE_RETRIES_OPTION = "max_constructor_retry_count" in inspect.signature(serve.deployment).parameters
DOWN_FOR_S = 15.0  # how long a replica that failed is skipped


@serve.deployment
class LloyalReplica:
    """One engine: the ``lloyal serve`` app, started (model loaded) as the replica starts, so a
    model that cannot load fails the deployment with its reason."""

    async def __init__(self, cfg: ServerConfig, replica_id: str) -> None:  # type: ignore[misc]  # Serve awaits it
        self.id = replica_id
        self.app = create_app(cfg)
        self._lifespan = Lifespan(self.app)
        await self._lifespan.start()

    async def handle(
        self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes
    ) -> AsyncIterator[dict[str, Any] | bytes]:
        """Yield ``{"accepted": id}``, then the response start, then its body chunks."""
        yield {"accepted": self.id}
        async for part in call(self.app, method, path, query, headers, body):
            yield part

    async def __del__(self) -> None:
        await self._lifespan.stop()


# Every path goes to a replica: the router has no docs or schema of its own (the replicas' are
# the server's, behind its API key).
router_app = FastAPI(title="lloyal router", docs_url=None, redoc_url=None, openapi_url=None)

# Every method too: a browser's CORS preflight (OPTIONS) and HEAD get the server's answers.
METHODS = ["GET", "POST", "DELETE", "OPTIONS", "HEAD", "PUT", "PATCH"]


@serve.deployment
@serve.ingress(router_app)
class LloyalRouter:
    """HTTP ingress: prefix-affinity routing over the engine replicas, with fail-over."""

    def __init__(self, names: list[str], overload: int, *replicas: DeploymentHandle[Any]) -> None:
        self.handles = dict(zip(names, replicas, strict=True))
        self.ring = HashRing(names)
        self.overload = overload
        self.in_flight = dict.fromkeys(names, 0)
        self.down_until: dict[str, float] = {}

    def _down(self) -> set[str]:
        now = time.monotonic()
        return {r for r, t in self.down_until.items() if t > now}

    @router_app.api_route("/{path:path}", methods=METHODS)
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        path = "/" + path
        key = None
        if request.method == "POST" and body:
            try:
                key = prefix_key(path, json.loads(body))
            except ValueError:
                key = None  # the replica answers malformed JSON with a 400
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        headers.append(("content-length", str(len(body))))  # the replica's size limit reads it
        query = request.url.query
        tried: set[str] = set()
        while len(tried) < len(self.handles):
            name = self.ring.choose(key, self.in_flight, self.overload, self._down() | tried)
            if name in tried:
                break
            tried.add(name)
            stream: Any = (
                self.handles[name]
                .options(stream=True)
                .handle.remote(request.method, path, query, headers, body)
            )
            try:
                await asyncio.wait_for(stream.__anext__(), timeout=ACCEPT_TIMEOUT_S)
            except (ray.exceptions.RayError, asyncio.TimeoutError, StopAsyncIteration):
                self.down_until[name] = time.monotonic() + DOWN_FOR_S
                stream.cancel()
                continue
            self.down_until.pop(name, None)
            return await self._relay(name, stream)
        body_json = error_body(
            "no lloyal replica could take the request; retry shortly", "server_error", code="unavailable"
        )
        return JSONResponse(body_json, status_code=503, headers={"retry-after": "1"})

    async def _relay(self, name: str, stream: Any) -> Response:
        self.in_flight[name] += 1
        try:
            start = await stream.__anext__()
        except BaseException:
            self.in_flight[name] -= 1
            raise
        headers = {k: v for k, v in start["headers"] if k.lower() != "content-length"}
        headers["x-lloyal-replica"] = name

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                self.in_flight[name] -= 1
                stream.cancel()

        return StreamingResponse(chunks(), status_code=start["status"], headers=headers)


def serve_app(
    model: str | Path,
    replicas: int = 2,
    *,
    ray_actor_options: dict[str, Any] | None = None,
    n_ctx: int = 4096,
    parallel: int = 8,
    n_threads: int | None = None,
    api_key: str | None = None,
    embeddings: bool = False,
    model_name: str | None = None,
    overload: int | None = None,
    **context_options: Any,
) -> serve.Application:
    """A Ray Serve application of ``lloyal serve`` with ``replicas`` engines.

    Args:
        model: GGUF path (each replica loads it; it must exist on every node).
        replicas: Number of engines (each its own single-replica deployment).
        ray_actor_options: Resources per engine, e.g. ``{"num_cpus": 8}`` or ``{"num_gpus": 1}``
            (default ``{"num_cpus": 1}``).
        n_ctx, parallel, n_threads, api_key, embeddings, model_name: As ``lloyal serve``'s flags.
        overload: In-flight requests at which a replica stops getting its own prefixes and the
            next replica on the ring takes them (default ``2 * parallel``).
        **context_options: Passed to each engine's :class:`lloyal.Context`.

    Returns:
        The application: ``ray.serve.run(app, route_prefix="/")`` serves it on Serve's HTTP proxy.
    """
    cfg = ServerConfig(
        model=Path(model),
        n_ctx=n_ctx,
        parallel=parallel,
        n_threads=n_threads,
        api_key=api_key,
        embeddings=embeddings,
        model_name=model_name,
        context_options=dict(context_options),
    )
    return app_from_config(cfg, replicas, ray_actor_options=ray_actor_options, overload=overload)


def app_from_config(
    cfg: ServerConfig,
    replicas: int,
    *,
    ray_actor_options: dict[str, Any] | None = None,
    overload: int | None = None,
) -> serve.Application:
    """:func:`serve_app` from a ``lloyal serve`` :class:`~lloyal.server.ServerConfig`."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    names = [f"lloyal-{i}" for i in range(replicas)]
    opts = dict(ray_actor_options or {"num_cpus": 1})
    engine_limit, router_limit = ongoing_limits(cfg, replicas)
    retries = {"max_constructor_retry_count": START_RETRIES} if _SERVE_RETRIES_OPTION else {}
    engines = [
        cast(Any, LloyalReplica)
        .options(
            name=n,
            num_replicas=1,
            ray_actor_options=opts,
            max_ongoing_requests=engine_limit,
            # a replica being stopped lets its running requests finish for --shutdown-grace
            graceful_shutdown_timeout_s=cfg.shutdown_grace,
            **retries,
        )
        .bind(cfg, n)
        for n in names
    ]
    router = cast(Any, LloyalRouter).options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=router_limit
    )
    return cast(serve.Application, router.bind(names, overload or 2 * cfg.parallel, *engines))


def ongoing_limits(cfg: ServerConfig, replicas: int) -> tuple[int, int]:
    """Serve's ``max_ongoing_requests`` for each engine and for the router: above what lloyal
    itself runs and queues (``parallel + max_queue``, and a few more for ``/metrics`` and the
    like), so lloyal's scheduler does the queueing and answers 429 past ``max_queue``; Serve's
    default (5) would hold every request beyond the fifth in its proxy, whatever ``parallel``.

    >>> from lloyal.server import ServerConfig
    >>> ongoing_limits(ServerConfig(model="m.gguf", parallel=8, max_queue=512), 2)
    (536, 1072)
    """
    queue = UNBOUNDED_QUEUE if cfg.max_queue is None else cfg.max_queue
    engine = cfg.parallel + queue + SPARE_ONGOING
    return engine, engine * replicas


def run_on_ray(cfg: ServerConfig, replicas: int, host: str, port: int, num_cpus: float = 1.0) -> None:
    """``lloyal serve --ray``: join the cluster named by ``RAY_ADDRESS`` (else start a local one),
    serve :func:`app_from_config` on ``host:port`` and block until Ctrl-C."""
    ray.init(address=os.environ.get("RAY_ADDRESS"))
    serve.start(http_options={"host": host, "port": port})
    app = app_from_config(cfg, replicas, ray_actor_options={"num_cpus": num_cpus})
    serve.run(app, name="lloyal", route_prefix="/")
    print(f"lloyal on Ray Serve: {replicas} replicas of {cfg.name} at http://{host}:{port}/v1", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
