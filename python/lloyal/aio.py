"""asyncio helpers: await native (GIL-releasing) work without blocking the event loop.

The ``a*`` methods of :class:`Branch` and :class:`BranchStore` and ``async for tok in branch``
are built on :func:`engine_call`, :func:`engine_value` and :func:`stream_next`: the context's
engine settles their futures, with no worker thread; the event loop keeps running while
llama.cpp decodes. :func:`run_in_thread` and :func:`next_in_thread` run any other blocking
call in the loop's executor.

Example:
    >>> import asyncio
    >>> asyncio.run(run_in_thread(sum, [1, 2, 3]))
    6
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from . import _lloyal

T = TypeVar("T")

__all__ = ["engine_call", "engine_start", "next_in_thread", "run_in_thread", "stream_next"]

_DONE = object()


async def run_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Await ``fn(*args)`` run in the loop's default executor."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, functools.partial(fn, *args))


async def next_in_thread(iterator: Iterator[T]) -> T:
    """Await ``next(iterator)`` in a worker thread; ``StopAsyncIteration`` at the end."""
    loop = asyncio.get_running_loop()
    item = await loop.run_in_executor(None, next, iterator, _DONE)
    if item is _DONE:
        raise StopAsyncIteration
    return item  # type: ignore[return-value]


async def engine_call(submit: Callable[..., Callable[[], None]], *args: Any) -> None:
    """Await an operation of a context's engine (the ``a*`` methods use it).

    ``submit(loop, future, *args)`` validates and queues the operation (its argument errors
    raise here) and returns a canceller; the engine thread settles ``future`` through
    ``loop.call_soon_threadsafe``. Cancelling the awaiting task cancels the operation unless
    the engine has decoded it: a commit already in a decode is applied, a prefill still in
    flight is rolled back; the task is cancelled either way, once the engine has answered (at
    once for an operation still queued, else as the tick running it ends), so the branches are
    as that answer leaves them when the cancellation reaches the caller.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    cancel = submit(loop, future, *args)
    await _settled(future, cancel)


async def _settled(future: asyncio.Future[None], cancel: Callable[[], Any]) -> None:
    """Await ``future``; cancelled meanwhile, cancel the operation and wait for the engine's
    answer to it before raising ``CancelledError`` (every operation is answered: one withdrawn
    from the queue at once, one in a tick as that tick ends). A second cancellation stops the
    wait."""
    try:
        await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel()  # (also when it was answered in the same instant: a lease granted then goes)
        await asyncio.wait([future])  # the answer: Interrupted, the result or its error
        if not future.cancelled():
            future.exception()  # retrieved: the caller gets the cancellation
        raise


def engine_start(submit: Callable[..., Callable[[], None]], *args: Any) -> asyncio.Future[None]:
    """Queue an operation of a context's engine now; the future it returns settles when the
    engine has run it.

    Unlike :func:`engine_call` (a coroutine: nothing is queued until it is first awaited), the
    operation is on the engine's queue when this returns, so the caller can do other work on
    the event loop while it decodes. Argument errors raise here; cancelling the future
    cancels the operation. The server's decode loop submits each step's commit this way.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    cancel = submit(loop, future, *args)

    def cancelled(f: asyncio.Future[None]) -> None:
        if f.cancelled():
            cancel()

    future.add_done_callback(cancelled)
    return future


async def engine_value(
    submit: Callable[..., tuple[Callable[[], None], Callable[[], Any]]], *args: Any
) -> Any:
    """Await an engine call that makes a value: a lease request (``Branch.afork(timeout=...)``)
    or a score (``Branch.ascore``).

    ``submit(loop, future, *args)`` queues the call and returns ``(cancel, take)``; the engine
    thread settles ``future`` once it is done, and ``take()`` is the value. Cancelling the
    awaiting task withdraws the call (a branch granted in the same instant is pruned), and the
    cancellation reaches the caller once the engine has answered, as :func:`engine_call`'s.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    cancel, take = submit(loop, future, *args)
    await _settled(future, cancel)
    return take()


async def stream_next(iterator: Any) -> Any:
    """Await the next token of a ``TokenIterator`` (``async for tok in branch`` uses it).

    ``iterator._poll(loop, future)`` returns a token that is ready, raises
    ``StopAsyncIteration`` at the end, or returns None after arranging for the engine thread
    to settle ``future`` when the next token arrives. Cancelling the awaiting task closes the
    iterator: the engine frees the request at its next tick.
    """
    key = id(iterator)
    if key in _awaited:
        # as an async generator refuses a second anext() while one runs (the engine keeps one
        # waiter an iterator: the first task would wait for good)
        raise RuntimeError(
            "this TokenIterator is already awaited by another task: await its tokens from one task "
            "at a time (or give each task a branch of its own)"
        )
    _awaited.add(key)
    try:
        loop = asyncio.get_running_loop()
        waker = _waker(loop)
        while True:
            future: asyncio.Future[None] = loop.create_future()
            item = iterator._poll(waker, future)
            if item is not None:
                return item
            try:
                await future
            except asyncio.CancelledError:
                iterator.close()
                raise
    finally:
        _awaited.discard(key)


# The ids of the TokenIterators a task awaits now (one task at a time each).
_awaited: set[int] = set()


# Each running loop's LoopWaker, or None where the loop cannot watch a socket.
_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()


def _waker(loop: asyncio.AbstractEventLoop) -> Any:
    """What the engine thread wakes ``loop`` through: the loop's ``LoopWaker`` (a socket the
    loop watches; the engine never waits for the GIL), made on first use, or the loop itself
    (``call_soon_threadsafe``) where there is none (Windows) or the loop cannot watch a socket."""
    try:
        if loop in _wakers:
            return _wakers[loop] or loop
    except TypeError:  # a loop that takes no weak references
        return loop
    waker = None
    make = getattr(_lloyal, "LoopWaker", None)
    if make is not None:
        waker = make()
        try:
            loop.add_reader(waker.fileno(), waker.drain)
        except (NotImplementedError, RuntimeError):
            waker = None
    _wakers[loop] = waker
    return waker or loop


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    """Set ``future``'s result (``None``) or exception, unless it is already done."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
