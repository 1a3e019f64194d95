"""The checks every request passes before its route, and the request counter.

A pure ASGI middleware rather than ``@app.middleware("http")`` (Starlette's
``BaseHTTPMiddleware``): that one copies every streamed chunk through an extra task and a memory
stream, and a completion streams one chunk per token. Here the response's messages go straight
to the server; only the status is read as it passes.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .protocol import error_body


class Gate:
    """Refuses, in this order: any request while the server shuts down (503), a declared body
    over ``max_body_bytes`` (413), a missing or wrong ``Bearer`` key when ``api_key`` is set
    (401, every path but ``/health``). Then ``count(route, status)`` when the response starts
    (the matched route's path, or ``"other"``).
    Refusals are not counted."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        closing: Callable[[], bool],
        count: Callable[[str, int], None],
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.closing = closing
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                # the route the router matched (FastAPI puts it in the scope), not the path
                # asked for: a client's made-up paths add no series; those are "other"
                self.count(getattr(scope.get("route"), "path", "other"), message["status"])
            await send(message)

        await self.app(scope, receive, counted)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        if self.closing():
            body = error_body(
                "the server is shutting down and accepts no new requests: retry later",
                "unavailable_error",
                code="shutting_down",
            )
            return JSONResponse(body, status_code=503)
        headers = Headers(scope=scope)
        size = headers.get("content-length", "")
        if size.isdigit() and int(size) > self.max_body_bytes:
            body = error_body(
                f"request body of {size} bytes exceeds the server's limit of {self.max_body_bytes} bytes",
                "invalid_request_error",
                code="request_too_large",
            )
            return JSONResponse(body, status_code=413)
        key = self.api_key
        if key and scope["path"] != "/health" and headers.get("authorization", "") != f"Bearer {key}":
            body = error_body(
                "invalid or missing API key: send 'Authorization: Bearer <key>' with the key the "
                "server was started with (--api-key)",
                "invalid_request_error",
                code="invalid_api_key",
            )
            return JSONResponse(body, status_code=401)
        return None
