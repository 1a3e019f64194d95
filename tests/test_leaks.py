"""Leaks: leases come back and resident memory stays flat over many branch and context cycles."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable

from helpers import soak_report

import lloyal

CYCLES = int(os.environ.get("LLOYAL_LEAK_CYCLES", "2000"))  # make soak: 10,000
CONTEXT_CYCLES = int(os.environ.get("LLOYAL_CONTEXT_CYCLES", "60"))  # make soak: 200


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def test_fork_commit_prune_cycles_return_leases_and_memory(
    make_context: Callable[..., lloyal.Context],
) -> None:
    ctx = make_context(n_ctx=512, n_seq_max=4)
    store = lloyal.BranchStore(ctx)
    root = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
    root.prefill(ctx.tokenize("The harbour master counted the boats"))
    cells = store.kv_pressure.cells_used

    def cycle(i: int) -> None:
        kids = [root.fork() for _ in range(3)]
        if i % 50 == 0:  # a real batched decode now and then (each costs ~25 ms per row)
            store.commit([(k, k.produce().token) for k in kids])
        for k in kids:
            k.prune()

    for i in range(200):  # warm-up: allocator pools, logits buffers
        cycle(i)
    before = _rss_mb()
    for i in range(CYCLES):
        cycle(i)
    after = _rss_mb()
    growth = after - before
    soak_report(
        "fork/commit/prune cycles", cycles=CYCLES, forks=3 * CYCLES, rss_before_mb=before, rss_after_mb=after
    )
    assert store.available == 3 and store.kv_pressure.cells_used == cells
    assert growth < 5.0, f"RSS grew {growth:.1f} MB over {CYCLES} fork/prune cycles"


def test_contexts_closed_with_live_branches_free_everything(model: lloyal.Model) -> None:
    def once() -> None:
        ctx = lloyal.Context(model, n_ctx=256, n_seq_max=2)
        b = lloyal.Branch.create(ctx, 0)
        b.prefill([2, 100, 200])
        b.fork()
        ctx.close()  # live branches: everything goes with the context

    for _ in range(10):
        once()
    before = _rss_mb()
    for _ in range(CONTEXT_CYCLES):
        once()
    after = _rss_mb()
    growth = after - before
    soak_report(
        "context create/close cycles", cycles=CONTEXT_CYCLES, rss_before_mb=before, rss_after_mb=after
    )
    assert growth < 5.0, f"RSS grew {growth:.1f} MB over {CONTEXT_CYCLES} context create/close cycles"
