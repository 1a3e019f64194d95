"""Running a request's specs on the scheduler: their events merged into one stream, the request
timeout (408), and the collected results of a request that is not streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from ..scheduling.scheduler import Done, GenSpec, PromptScores, TokenEvent
from .protocol import ApiError
from .state import ServerState

__all__ = ["merged", "run_all"]

_Item = tuple[int, TokenEvent | PromptScores | Done]


async def merged(st: ServerState, specs: Sequence[GenSpec]) -> AsyncIterator[_Item]:
    """Events of several specs run concurrently, tagged with the spec's index; the request is
    cancelled with a 408 when it runs past ``request_timeout`` (one deadline for the request,
    which the scheduler keeps)."""
    timeout = st.cfg.request_timeout
    deadline = asyncio.get_running_loop().time() + timeout if timeout else None
    try:
        if len(specs) == 1:
            events = st.scheduler.generate(specs[0], deadline=deadline)
            try:
                async for ev in events:
                    yield 0, ev
            finally:
                await events.aclose()
        else:
            async for item in _several(st, specs, deadline):
                yield item
    except asyncio.TimeoutError:  # the scheduler cancelled the request: its branches are pruned
        raise ApiError(
            f"the request did not finish within the server's timeout of {timeout:g} s "
            "(--request-timeout) and was cancelled: lower max_tokens or n, or retry later",
            status=408,
            type="timeout_error",
            code="request_timeout",
        ) from None


async def _several(
    st: ServerState, specs: Sequence[GenSpec], deadline: float | None
) -> AsyncGenerator[_Item, None]:
    """The specs' events as they come, each spec run in a task of its own."""
    queue: asyncio.Queue[_Item | BaseException] = asyncio.Queue()

    async def pump(k: int, spec: GenSpec) -> None:
        try:
            async for ev in st.scheduler.generate(spec, deadline=deadline):
                queue.put_nowait((k, ev))
        except BaseException as exc:
            queue.put_nowait(exc)
            raise

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(specs)]
    try:
        left = len(specs)
        while left:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item[1], Done):
                left -= 1
            yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_all(
    st: ServerState, specs: Sequence[GenSpec]
) -> tuple[list[Done], list[list[list[TokenEvent]]]]:
    """Run ``specs`` to the end: each spec's :class:`Done` (its prompt scored, when asked, in
    ``Done.prompt``), and each spec's choices' tokens."""
    dones: list[Done | None] = [None] * len(specs)
    tokens: list[list[list[TokenEvent]]] = [[[] for _ in range(s.best_of)] for s in specs]
    async for k, ev in merged(st, specs):
        if isinstance(ev, Done):
            dones[k] = ev
        elif isinstance(ev, TokenEvent) and ev.token >= 0:
            tokens[k][ev.index].append(ev)
    return [d for d in dones if d is not None], tokens
