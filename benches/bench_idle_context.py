"""An idle second context's cost to a busy one: decode time with and without it open.

Every context's engine thread decodes on an OpenMP pool of its own, and libgomp throttles every
pool (its waiting threads sleep after 100 spins instead of ~300,000) once the pools hold more
threads than there are CPUs. An engine idle for 0.1 s hands its pool back, so a context that is
open but not decoding no longer slows the others. ``python benches/bench_idle_context.py
[STEPS B...]`` prints, per ``B`` (default 64 steps, B = 1 16), the decode milliseconds a tick of
one context with ``B`` streams (``bench_host_work``'s load) alone, with a second context open
that generated and then idled for 0.3 s, and with one that a thread still alive called
``Context.decode`` on (a server's embeddings run in an executor's threads), in interleaved
rounds, with the ratios per round and the process's voluntary context switches a tick.
``pytest benches`` runs it once at a small size.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from bench_host_work import host_round

import lloyal

IDLE = 0.3  # seconds the second context idles before the timed round (past the engine's 0.1 s)


def sleeps() -> int:
    """Voluntary context switches of this process's threads so far (Linux; 0 elsewhere): a
    throttled OpenMP thread sleeps in the kernel at a decode's barriers instead of spinning."""
    total = 0
    for task in Path("/proc/self/task").glob("*"):
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        total += sum(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_"))
    return total


def timed(ctx: lloyal.Context, b: int, steps: int) -> dict[str, float]:
    """``host_round`` with the voluntary context switches a tick it took."""
    before = sleeps()
    r = host_round(ctx, b, steps)
    r["sleeps_per_tick"] = (sleeps() - before) / r["ticks"]
    return r


def round_with(path: Path, ctx: lloyal.Context, b: int, steps: int, second: str) -> dict[str, float]:
    """One timed round on ``ctx``, with a second context open and idle: none (``""``), one that
    generated (``"branches"``), or one that a thread still alive (an executor's, say) called
    ``decode`` on (``"flat"``)."""
    if not second:
        time.sleep(IDLE)
        return timed(ctx, b, steps)
    with lloyal.Context(path, n_ctx=1024, n_seq_max=2) as other:
        if second == "branches":
            host_round(other, 1, 2)  # its engine thread decoded: it has made its pool
            time.sleep(IDLE)
            return timed(ctx, b, steps)
        decoded, leave = threading.Event(), threading.Event()

        def flat() -> None:
            other.decode(other.tokenize("The harbour town of Aldermoor"), 0)
            decoded.set()
            leave.wait()

        helper = threading.Thread(target=flat)
        helper.start()
        try:
            assert decoded.wait(60)
            time.sleep(IDLE)
            return timed(ctx, b, steps)
        finally:
            leave.set()
            helper.join()


@pytest.mark.parametrize("second", ["branches", "flat"])
def test_idle_second_context(benchmark: Any, model_path: Path, full: bool, second: str) -> None:
    b, steps = (16, 64) if full else (2, 3)
    with lloyal.Context(model_path, n_ctx=4096, n_seq_max=b + 1) as ctx:
        r = benchmark.pedantic(lambda: round_with(model_path, ctx, b, steps, second), rounds=1)
        assert r["made"] == b * steps and r["decode_ms_per_tick"] > 0


def main() -> None:
    args = [int(a) for a in sys.argv[1:]]
    steps, bs = (args[0], args[1:]) if args else (64, [])
    bs = bs or [1, 16]
    rounds = 5
    path = lloyal.default_model_path()
    print(f"{steps} steps, {rounds} interleaved rounds (median), {lloyal.system_info()}")
    print(
        "| B | decode ms/tick alone | an idle context that generated | ratio by round "
        "| an idle context decoded by a live thread | ratio by round "
        "| sleeps/tick (alone, generated, live thread) |"
    )
    print("|---|---|---|---|---|---|---|")
    with lloyal.Context(path, n_ctx=4096, n_seq_max=max(bs) + 1) as ctx:
        host_round(ctx, max(bs), 4)  # warm-up
        for b in bs:
            ms: dict[str, list[float]] = {"": [], "branches": [], "flat": []}
            naps: dict[str, list[float]] = {"": [], "branches": [], "flat": []}
            for _ in range(rounds):
                for second, got in ms.items():
                    r = round_with(path, ctx, b, steps, second)
                    got.append(r["decode_ms_per_tick"])
                    naps[second].append(r["sleeps_per_tick"])
            cells = [f"{statistics.median(ms['']):.1f}"]
            for second in ("branches", "flat"):
                ratios = [w / a for a, w in zip(ms[""], ms[second], strict=True)]
                cells += [
                    f"{statistics.median(ms[second]):.1f} ({statistics.median(ratios):.2f}x)",
                    ", ".join(f"{r:.2f}" for r in ratios),
                ]
            cells.append(", ".join(f"{statistics.median(naps[k]):.0f}" for k in ("", "branches", "flat")))
            print(f"| {b} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
