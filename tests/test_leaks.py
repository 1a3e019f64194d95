"""Leaks: leases come back and resident memory stays flat over many branch and context cycles."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable

from helpers import soak_report, wait_until

import lloyal

CYCLES = int(os.environ.get("LLOYAL_LEAK_CYCLES", "2000"))  # make soak: 10,000
CONTEXT_CYCLES = int(os.environ.get("LLOYAL_CONTEXT_CYCLES", "60"))  # make soak: 200
COMPACTION_CYCLES = int(os.environ.get("LLOYAL_COMPACTION_CYCLES", "2"))  # make soak: 60


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


def test_compaction_cycles_keep_branches_leases_and_memory(
    make_context: Callable[..., lloyal.Context],
) -> None:
    """Bursts of prompts pruned after each one, every burst leaving a kept branch's cells
    sparse: the engine compacts after each, the kept branch goes on decoding, and leases,
    cells and resident memory come back."""
    ctx = make_context(n_ctx=2048, n_seq_max=8, batch_invariant=False)
    store = lloyal.BranchStore(ctx)
    greedy = lloyal.SamplingParams(temperature=0)
    kept = lloyal.Branch.create(ctx, 0, greedy)
    kept.prefill(ctx.tokenize("The harbour master counted the boats " * 30)[:100])
    text = " ".join(f"Crate {i} holds {i * 7 % 31} lanterns and {i % 5} ropes." for i in range(200))
    burst_tokens = ctx.tokenize(text)[:300]

    def cycle(i: int) -> None:
        burst = [lloyal.Branch.create(ctx, 0, greedy) for _ in range(4)]
        store.prefill([(b, burst_tokens) for b in burst])  # 1,200 cells above the kept 100
        for b in burst:
            b.prune()
        wait_until(lambda: ctx.engine_stats().kv_compactions == i + 1)
        kept.commit(kept.produce().token)

    warm = 2
    for i in range(warm):
        cycle(i)
    before = _rss_mb()
    for i in range(warm, warm + COMPACTION_CYCLES):
        cycle(i)
    after = _rss_mb()
    soak_report("compaction cycles", cycles=COMPACTION_CYCLES, rss_before_mb=before, rss_after_mb=after)
    assert store.available == 7 and kept.position == 100 + warm + COMPACTION_CYCLES
    assert store.kv_pressure.cells_used == kept.position
    assert after - before < 5.0, f"RSS grew {after - before:.1f} MB over {COMPACTION_CYCLES} compactions"
