"""The scheduler's queue of requests waiting for room (lloyal.scheduling.room_queue): arrival
order, first fit, a pass that stops where no later request can start, withdrawal and closing.
The room is a counter here; the scheduler's use of it runs on the model in test_scheduler.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from lloyal.scheduling.room_queue import RETRY_FIRST, RETRY_MAX, SHORT, RoomQueue, Short


@dataclass
class Room:
    """Slots; requests named in ``short`` are planned but lack cells, those in ``unwritten``
    wait for a prompt; every attempt is logged."""

    slots: int = 0
    running: int = 0
    short: set[str] = field(default_factory=set)
    unwritten: set[str] = field(default_factory=set)
    slow: set[str] = field(default_factory=set)  # their attempts await ``gate``
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    tried: list[str] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    async def attempt(self, spec: tuple[str, int]) -> str | Short | None:
        name, need = spec
        self.tried.append(name)
        found: str | Short | None = None
        if need <= self.slots and name not in self.unwritten:
            found = SHORT if name in self.short else name
        if found == name:
            self.slots -= need
            self.running += need
        try:
            await asyncio.sleep(0)  # an attempt may await the engine: room may change meanwhile
            if name in self.slow:
                await self.gate.wait()
        except asyncio.CancelledError:  # its caller left: what it took goes back
            if found == name:
                self.release(name)
            raise
        self.answered.append(name)
        return found

    def release(self, name: str) -> None:
        self.slots += 1
        self.running -= 1
        self.released.append(name)

    def queue(self) -> RoomQueue[tuple[str, int], str]:
        return RoomQueue(
            self.attempt,
            slots=lambda: self.slots,
            busy=lambda: self.running > 0,
            release=self.release,
        )


async def queued(q: RoomQueue[tuple[str, int], str], *specs: tuple[str, int]) -> list[asyncio.Task[str]]:
    tasks = [asyncio.create_task(q.admit(s, s[1])) for s in specs]
    for _ in range(10 * len(specs)):  # their first attempts, one at a time
        await asyncio.sleep(0)
    assert len(q) == len(specs), "each found no room and waits"
    return tasks


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def until(done: Callable[[], bool]) -> bool:
    """Step the loop until ``done()`` (at most 20 steps); whether it is."""
    for _ in range(20):
        if done():
            return True
        await asyncio.sleep(0)
    return done()


async def woken(q: RoomQueue[tuple[str, int], str]) -> None:
    """Room may have changed: ``q``'s pass runs, and what it started runs on."""
    q.wake()
    await settle()


def test_a_request_that_finds_room_starts_at_once_without_queueing() -> None:
    async def main() -> None:
        room = Room(slots=1)
        q = room.queue()
        assert await q.admit(("a", 1), 1) == "a"
        assert len(q) == 0 and room.tried == ["a"]

    asyncio.run(main())


def test_waiting_requests_start_in_arrival_order_and_a_big_one_keeps_the_slots_freed() -> None:
    async def main() -> None:
        room = Room(running=8)
        q = room.queue()
        names = ["big", *(f"s{i}" for i in range(6))]
        tasks = dict(zip(names, await queued(q, ("big", 4), *[(n, 1) for n in names[1:]]), strict=True))
        started: list[str] = []
        for _ in range(8):  # running requests end one by one
            room.slots, room.running = room.slots + 1, room.running - 1
            await woken(q)
            started += [n for n, t in tasks.items() if t.done() and n not in started]
        # the small ones did not take the slots as they freed: "big" started with the fourth
        assert started == ["big", "s0", "s1", "s2", "s3"]
        assert room.tried == started, "nobody was tried before it could start"
        q.close(lambda: RuntimeError("closed"))
        await asyncio.gather(*tasks.values(), return_exceptions=True)

    asyncio.run(main())


def test_a_pass_stops_when_no_slot_is_left_so_a_freed_slot_costs_one_attempt() -> None:
    async def main() -> None:
        room = Room(running=8)
        q = room.queue()
        tasks = await queued(q, *[(f"r{i}", 1) for i in range(100)])
        for i in range(3):
            room.tried.clear()
            room.slots = 1  # a request ended
            await woken(q)
            assert room.tried == [f"r{i}"], "one attempt, not one per waiting request"
        assert sum(t.done() for t in tasks) == 3 and len(q) == 97
        q.close(lambda: RuntimeError("closed"))
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_a_request_short_of_room_stops_the_pass_only_while_others_hold_what_it_lacks() -> None:
    async def main() -> None:
        room = Room(running=1, short={"a"})
        q = room.queue()
        tasks = await queued(q, ("a", 1), ("b", 1))
        room.tried.clear()
        room.slots = 2
        await woken(q)
        assert room.tried == ["a"], "what 'a' lacks is held by the running request: its end wakes the queue"
        room.running, room.tried = 0, []  # nothing runs: no later wake is certain, so go on
        await woken(q)
        assert room.tried == ["a", "b"] and tasks[1].result() == "b" and not tasks[0].done()
        room.short.clear()
        await woken(q)
        assert tasks[0].result() == "a"

    asyncio.run(main())


def test_a_request_short_while_nothing_runs_is_tried_again_by_the_queue_itself() -> None:
    """What it lacks is held outside the queue's requests (a cancelled request the engine lets
    go of at its next tick): no request's end will wake the queue, so it tries again after a
    delay that doubles from RETRY_FIRST, and the request starts once the room is there."""

    async def main() -> None:
        room = Room(short={"a"})
        q = room.queue()
        [task] = await queued(q, ("a", 1))
        room.slots = 1
        await woken(q)
        assert room.tried == ["a"] and not task.done()
        await asyncio.sleep(RETRY_FIRST * 30)
        # retries at 1, 3, 7, 15 x RETRY_FIRST (doubling), not every RETRY_FIRST
        assert 3 <= room.tried.count("a") - 1 <= 5 and not task.done()
        room.short.clear()  # freed, and nobody wakes the queue
        assert await asyncio.wait_for(task, RETRY_MAX * 3) == "a"

    asyncio.run(main())


def test_a_request_waiting_for_a_prompt_does_not_stop_the_pass() -> None:
    async def main() -> None:
        room = Room(running=1, unwritten={"a"})
        q = room.queue()
        tasks = await queued(q, ("a", 1), ("b", 1))
        room.slots = 2
        await woken(q)
        assert tasks[1].result() == "b" and not tasks[0].done()
        room.unwritten.clear()
        await woken(q)
        assert tasks[0].result() == "a"

    asyncio.run(main())


def test_a_cancelled_request_leaves_the_queue_and_its_attempt_under_way_is_undone() -> None:
    async def main() -> None:
        room = Room(slow={"b"})
        q = room.queue()
        tasks = await queued(q, ("a", 1), ("b", 1), ("c", 1))
        tasks[0].cancel()
        await settle()
        assert len(q) == 2 and tasks[0].cancelled()
        room.slots = 1
        q.wake()
        await settle()  # the pass's attempt for "b" is under way (it awaits the engine, say)
        assert room.tried == ["b"] and room.slots == 0
        tasks[1].cancel()  # ... and its caller leaves: the attempt is cancelled, its slot back
        await settle()
        assert tasks[1].cancelled() and room.released == ["b"]
        assert tasks[2].result() == "c" and len(q) == 0, "the same pass gave the slot to the next"

    asyncio.run(main())


def test_closing_fails_the_waiting_requests_and_later_attempts() -> None:
    async def main() -> None:
        room = Room()
        q = room.queue()
        tasks = await queued(q, ("a", 1), ("b", 1))
        q.close(lambda: RuntimeError("shutting down"))
        for t in tasks:
            with pytest.raises(RuntimeError, match="shutting down"):
                await t
        room.slots = 1
        with pytest.raises(RuntimeError, match="shutting down"):
            await q.admit(("c", 1), 1)
        assert len(q) == 0 and room.tried == [], "no slot was ever free: nobody was tried"

    asyncio.run(main())


def test_room_freed_during_a_pass_is_looked_at_in_another() -> None:
    async def main() -> None:
        room = Room(unwritten={"a"})
        q = room.queue()
        tasks = await queued(q, ("a", 1))
        room.slots = 1
        q.wake()
        assert await until(lambda: bool(room.tried))  # the pass is trying "a", not written yet ...
        assert room.tried == ["a"] and not room.answered
        room.unwritten.clear()  # ... it is now, and the writer wakes the queue
        await woken(q)
        assert tasks[0].result() == "a"

    asyncio.run(main())


@pytest.mark.parametrize("moment", ["answered", "granted"])
def test_a_request_cancelled_once_its_attempt_found_room_releases_it(moment: str) -> None:
    """``answered``: the attempt has returned, the pass has not heard it yet; ``granted``: the
    pass handed the room over, the caller has not run since."""

    async def main() -> None:
        room = Room()
        q = room.queue()
        tasks = await queued(q, ("a", 1))
        room.slots = 1
        q.wake()
        if moment == "answered":
            assert await until(lambda: bool(room.answered)) and len(q) == 1
        else:
            assert await until(lambda: not len(q)) and room.running == 1
        assert not tasks[0].done()
        tasks[0].cancel()
        await settle()
        assert tasks[0].cancelled() and room.released == ["a"] and room.slots == 1

    asyncio.run(main())


def test_a_new_request_waits_behind_those_that_came_before_it() -> None:
    async def main() -> None:
        room = Room(running=1, short={"a"})
        q = room.queue()
        [a] = await queued(q, ("a", 1))
        room.slots, room.tried = 1, []
        b = asyncio.create_task(q.admit(("b", 1), 1))  # room for "b", but "a" came first
        await settle()
        assert room.tried == ["a"] and not b.done() and len(q) == 2
        room.short.clear()
        room.slots = 2
        await woken(q)
        assert (await a, await b) == ("a", "b")

    asyncio.run(main())
