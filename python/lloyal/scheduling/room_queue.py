"""The requests waiting for room to start, tried again in arrival order when room may have
changed, without waking each of them.

A request joins the queue and is tried by a pass, at once when none waits before it; one that
finds no room (no free slot, a prompt it forks not written yet, or leases and cells the prefix
cache cannot free) waits there. When room may have changed (a request ended, a prompt was
written, an admission ended) one pass tries the waiting requests in order. It stops at the
first that needs more slots than are free (untried: the slots that free up are kept for it),
and at the first short of leases or cells while requests run or are being admitted (what it
lacks is theirs, and their end starts the next pass); one waiting for a prompt to be written
lets the next ones go first. So a request's end costs a few tries, not one per waiting
request: with 250 requests queued behind 8 slots, waking every one of them (each planning, and
awaiting the engine to learn that the cache could not make room) took as long as the decodes.

A request short while nothing runs lacks what no request's end will give back (the branch of
a cancelled request, which the engine lets go of at its next tick; branches held outside the
queue): the queue tries again by itself after a delay, from :data:`RETRY_FIRST` doubling up to
:data:`RETRY_MAX`, until a pass starts a request.

Example:
    >>> import asyncio
    >>> async def demo() -> list[str]:
    ...     free = {"slots": 0}
    ...     async def attempt(name: str) -> str | Short | None:
    ...         if free["slots"] == 0:
    ...             return None
    ...         free["slots"] -= 1
    ...         return name
    ...     q = RoomQueue(attempt, slots=lambda: free["slots"], busy=lambda: True, release=print)
    ...     waiting = [asyncio.create_task(q.admit(n, 1)) for n in ("a", "b")]
    ...     await asyncio.sleep(0)
    ...     free["slots"] = 2
    ...     q.wake()
    ...     return list(await asyncio.gather(*waiting))
    >>> asyncio.run(demo())
    ['a', 'b']
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["RETRY_FIRST", "RETRY_MAX", "SHORT", "RoomQueue", "Short"]

RETRY_FIRST = 0.01
"""Seconds before the first retry of a queue whose request was short while nothing ran."""

RETRY_MAX = 1.0
"""The longest delay between such retries (each one doubles the last)."""

S = TypeVar("S")  # what a request asks for
P = TypeVar("P")  # what an attempt that found room returns (its reservation)


class Short:
    """An attempt's answer when the request was planned but the leases or cells it needs could
    not be freed (nothing is held for it)."""


SHORT = Short()


@dataclass
class _Waiter(Generic[S, P]):
    spec: S
    slots: int
    future: asyncio.Future[P]
    attempt: asyncio.Future[P | Short | None] | None = None  # a pass's attempt for it, running


class RoomQueue(Generic[S, P]):
    """Requests waiting for room, tried in arrival order by :meth:`wake`.

    ``attempt(spec)`` tries to start a request now: its reservation, ``None`` (no slot, or what
    it forks is not written yet) or :data:`SHORT`; one pass runs at a time, so attempts do too.
    ``slots()`` is how many slots are free, ``busy()`` whether requests run or are being
    admitted (so a later :meth:`wake` is certain), and ``release(p)`` gives back a reservation
    whose request left before taking it.
    """

    def __init__(
        self,
        attempt: Callable[[S], Awaitable[P | Short | None]],
        *,
        slots: Callable[[], int],
        busy: Callable[[], bool],
        release: Callable[[P], object],
    ) -> None:
        self._attempt, self._slots, self._busy, self._release = attempt, slots, busy, release
        self._waiters: deque[_Waiter[S, P]] = deque()
        self._passing: asyncio.Task[None] | None = None
        self._again = False
        self._closed: Callable[[], BaseException] | None = None
        self._stranded = False  # the last pass left a request short while nothing ran
        self._retry: asyncio.TimerHandle | None = None
        self._delay = RETRY_FIRST
        self.tries = 0  # attempts made, at once or in passes (for tests and benches)

    def __len__(self) -> int:
        return len(self._waiters)

    async def admit(self, spec: S, slots: int) -> P:
        """Start a request that takes ``slots`` slots, after the requests that came before it:
        at once when none waits and there is room, else once a pass finds room for it
        (cancelling the caller withdraws it; a reservation made for it meanwhile is released)."""
        if self._closed is not None:
            raise self._closed()
        waiter: _Waiter[S, P] = _Waiter(spec, slots, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self.wake()
        try:
            return await waiter.future
        except BaseException:
            self._withdraw(waiter)
            raise

    def wake(self) -> None:
        """Room may have changed: try the waiting requests again (in a task of its own; a pass
        running now makes one more)."""
        if not self._waiters:
            return
        if self._passing is None or self._passing.done():
            self._passing = asyncio.get_running_loop().create_task(self._run())
        else:
            self._again = True

    def close(self, error: Callable[[], BaseException]) -> None:
        """Fail every waiting request, and every later attempt, with ``error()``."""
        self._closed = error
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._fail_all(error)

    def _fail_all(self, error: Callable[[], BaseException] | None) -> None:
        """Every waiting request leaves the queue failing with ``error()`` (cancelled: None)."""
        while self._waiters:
            f = self._waiters.popleft().future
            if f.done():
                continue
            if error is None:
                f.cancel()
            else:
                f.set_exception(error())

    async def _try(self, spec: S) -> P | Short | None:
        if self._closed is not None:
            raise self._closed()
        self.tries += 1
        return await self._attempt(spec)

    async def _run(self) -> None:
        try:
            self._again = True
            while self._again:
                self._again, self._stranded = False, False
                await self._pass()
            if self._stranded and self._waiters and self._closed is None:
                self._retry_later()
        except BaseException as e:  # a bug (or the loop closing): no waiter is left hanging
            failure = e
            self._fail_all(None if isinstance(e, asyncio.CancelledError) else lambda: failure)
            raise

    async def _pass(self) -> None:
        for w in list(self._waiters):
            if w.future.done():  # withdrawn
                continue
            if w.slots > self._slots():
                # none free (a request takes one at least), or fewer than it needs: those freed
                # are kept for it (a later request taking each one as it frees would keep a
                # best_of request waiting as long as small ones come)
                break
            # its own task: a caller that leaves meanwhile cancels it (what it pinned goes)
            attempt = w.attempt = asyncio.ensure_future(self._try(w.spec))
            try:
                await asyncio.wait([attempt])
            finally:
                w.attempt = None
            if attempt.cancelled():  # withdrawn
                continue
            error = attempt.exception()
            if error is not None:  # closed meanwhile, or a bug: the waiter hears it
                self._remove(w)
                if not w.future.done():
                    w.future.set_exception(error)
                continue
            found = attempt.result()
            if isinstance(found, Short) or found is None:
                if isinstance(found, Short):
                    if self._busy():
                        break  # what it lacks is held by requests whose end wakes the queue
                    self._stranded = True
                continue
            self._remove(w)
            if w.future.done():  # withdrawn as its attempt ended
                self._release(found)
                self._again = True
            else:
                w.future.set_result(found)
                self._delay = RETRY_FIRST

    def _retry_later(self) -> None:
        """Wake the queue after the retry delay (doubled for the next one), unless a retry is
        already due."""
        if self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(self._delay, self._retry_now)
            self._delay = min(RETRY_MAX, self._delay * 2)

    def _retry_now(self) -> None:
        self._retry = None
        self.wake()

    def _remove(self, w: _Waiter[S, P]) -> None:
        with contextlib.suppress(ValueError):  # withdrawn, or already taken by a pass
            self._waiters.remove(w)

    def _withdraw(self, w: _Waiter[S, P]) -> None:
        """``w``'s caller left: it goes from the queue, and a reservation handed to it is released."""
        self._remove(w)
        if w.attempt is not None:
            w.attempt.cancel()
        f = w.future
        if f.done() and not f.cancelled() and f.exception() is None:
            self._release(f.result())
            self.wake()
        elif not f.done():
            f.cancel()
