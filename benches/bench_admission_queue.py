"""Requests queued deep behind the server's slots: what waiting for room costs the event loop
and the decodes.

``N`` requests (a shared instruction, then a few words of their own; 8 sampled tokens each)
go to one :class:`~lloyal.scheduling.scheduler.Scheduler` at once, with 8 slots on a context of
26 sequences (the server's ``3 x parallel + 2``). Two admission policies, in interleaved rounds
on the same context:

- ``pass``: the scheduler's :class:`~lloyal.scheduling.room_queue.RoomQueue` (a wake-up tries
  the waiting requests in order and stops where no later one can start);
- ``wake-all``: the same queue told that every slot is free and nothing runs, so every
  wake-up tries every waiting request, as the ``asyncio.Condition`` it replaced did
  (``notify_all``; without that lock's hand-offs, so the old cost is understated).

Reported: wall seconds, the share of the wall outside the engine's ticks, admission attempts
per request, and wake-all's wall over pass's per round. ``pytest benches`` runs it once at a
small size; ``python benches/bench_admission_queue.py [N] [MODEL] [--staggered]`` prints the
table (default 256 requests, the default model; ``make bench-host-bound``'s model is a GPU-like
decode). The requests all ask for 8 tokens, so they start and end in waves of 8 and the engine
idles while each wave's successors are admitted; ``--staggered`` asks for 8 to 12 (a server's
mixed lengths), which leaves it idle far less.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import lloyal

pytest.importorskip("fastapi", reason="the server extra: pip install 'lloyal[server]'")

from lloyal.scheduling.room_queue import RoomQueue
from lloyal.scheduling.scheduler import Done, GenSpec, Scheduler

SLOTS = 8
POLICIES = ("pass", "wake-all")


def queue_round(ctx: lloyal.Context, n: int, policy: str, staggered: bool = False) -> dict[str, float]:
    """``n`` requests at once through a new scheduler admitting by ``policy`` (8 tokens each, or
    8 to 12 when ``staggered``)."""
    sched = Scheduler(ctx, max_running=SLOTS)
    if policy == "wake-all":
        everyone = RoomQueue(sched._attempt, slots=lambda: n, busy=lambda: False, release=sched.book.release)
        sched._room = everyone
    system = ctx.tokenize("Answer in one short sentence, plainly and without a list:")
    params = lloyal.SamplingParams(temperature=0.8, top_k=40, seed=1)

    async def one(i: int) -> int:
        spec = GenSpec(
            prompt=[*system, *ctx.tokenize(f" what is {i} times {i + 3}?", add_special=False)],
            params=params,
            max_tokens=8 + (i % 5 if staggered else 0),
        )
        async for ev in sched.generate(spec):
            if isinstance(ev, Done):
                return ev.completion_tokens
        raise AssertionError("no Done")

    async def main() -> list[int]:
        try:
            return list(await asyncio.gather(*(one(i) for i in range(n))))
        finally:
            await sched.stop()

    before, t0 = ctx.engine_stats(), time.perf_counter()
    made = asyncio.run(main())
    wall, after = time.perf_counter() - t0, ctx.engine_stats()
    assert len(made) == n and all(m > 0 for m in made)
    ticks = after.tick_seconds - before.tick_seconds
    return {
        "wall_s": wall,
        "outside_ticks": max(0.0, wall - ticks) / wall,
        "attempts_per_request": sched._room.tries / n,
    }


def context(path: Path | str) -> lloyal.Context:
    """The server's shape for ``SLOTS``: ``3 x parallel + 2`` sequences, the rest of them for
    cached prefixes."""
    return lloyal.Context(path, n_ctx=2048, n_seq_max=3 * SLOTS + 2)


def test_admission_queue(benchmark: Any, model_path: Path, full: bool) -> None:
    n = 256 if full else 12
    with context(model_path) as ctx:
        r = benchmark.pedantic(lambda: queue_round(ctx, n, "pass"), rounds=1)
        assert r["attempts_per_request"] < 8
        if full:
            print(f"\n{n} requests, pass: {r}")


def main() -> None:
    staggered = "--staggered" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--staggered"]
    n = int(args[0]) if args else 256
    path = args[1] if len(args) > 1 else lloyal.default_model_path()
    rounds = 3
    lengths = "8 to 12 tokens" if staggered else "8 tokens"
    print(
        f"{n} requests of {lengths}, {SLOTS} slots, {rounds} interleaved rounds (median), {Path(path).name}"
    )
    with context(path) as ctx:
        queue_round(ctx, SLOTS, "pass")  # warm-up
        runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
        for _ in range(rounds):
            for p in POLICIES:
                runs[p].append(queue_round(ctx, n, p, staggered))
    print("| policy | wall s | outside ticks | attempts a request |")
    print("|---|---|---|---|")
    for p in POLICIES:
        med = {k: statistics.median(r[k] for r in runs[p]) for k in runs[p][0]}
        cells = f"{med['wall_s']:.2f} | {med['outside_ticks']:.0%} | {med['attempts_per_request']:.1f}"
        print(f"| {p} | {cells} |")
    ratios = [w["wall_s"] / p["wall_s"] for p, w in zip(runs["pass"], runs["wake-all"], strict=True)]
    print("wake-all wall / pass wall, per round: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
