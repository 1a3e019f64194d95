"""Call an ASGI app in-process and stream its response: how a Serve replica runs the
``lloyal serve`` app without a socket of its own.

:func:`call` yields the response start (status and headers) first, then each body chunk as the
app sends it, so server-sent events stream through a Ray ``DeploymentHandle`` unbuffered.
The app's lifespan (model load, scheduler start) runs once, through :class:`Lifespan`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["Lifespan", "call"]

Message = dict[str, Any]


class Lifespan:
    """Run an ASGI app's lifespan startup once and its shutdown on :meth:`stop`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async def receive() -> Message:
            return await self._inbox.get()

        async def send(message: Message) -> None:
            await self._outbox.put(message)

        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._task = asyncio.get_running_loop().create_task(self.app(scope, receive, send))
        await self._inbox.put({"type": "lifespan.startup"})
        reply = await self._outbox.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app failed to start: {reply.get('message', reply['type'])}")

    async def stop(self) -> None:
        if self._task is None:
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._outbox.get(), timeout=30)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._task = None


async def call(
    app: Any, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes
) -> AsyncIterator[Message | bytes]:
    """Run one HTTP request through ``app``: yields ``{"status", "headers"}``, then body chunks.

    Closing the iterator early (the client went away) disconnects the request inside the app,
    which cancels its generation and frees its branches.
    """
    out: asyncio.Queue[Message | None] = asyncio.Queue()
    sent_body = False
    disconnected = asyncio.Event()

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await out.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.get_running_loop().create_task(run())
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield {
                    "status": int(message["status"]),
                    "headers": [
                        (k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])
                    ],
                }
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    yield bytes(chunk)
                if not message.get("more_body", False):
                    break
    finally:
        disconnected.set()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, timeout=30)
