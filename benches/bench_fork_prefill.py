"""Fork cost against prefix length, and packed multi-branch prefill against the raw loop.

- fork: a 16-token vs a long prefix (2000 tokens when run for real): the child shares the
  parent's cells (``llama_memory_seq_cp``, metadata only), so time and new KV cells must not
  grow with the prefix.
  ``test_fork_raw`` is llama.cpp's floor for the same step: ``llama_memory_seq_cp`` then
  ``llama_memory_seq_rm`` through llama-cpp-python's C bindings on a context configured like
  lloyal's (unified KV, full SWA cache). Both cost per cell of the prefix: llama.cpp keeps a
  per-sequence ordered set of positions and inserts / erases one node per shared cell.
- prefill: six branches with mixed prompt lengths written by one ``BranchStore.prefill``
  (packed into ceil(T / n_batch) decodes) vs the same rows decoded through llama.cpp's C API
  at the same n_batch (lloyal on llama.cpp's own kernels, ``batch_invariant=False``, and on
  the default batch-invariant ones).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import THREADS
from interleave import interleaved, median_figures
from llama_peer import RawLoop

import lloyal

N_BATCH = 256
LENGTHS = [37, 120, 5, 300, 64, 200]


def _tokens(ctx: lloyal.Context, n: int) -> list[int]:
    text = " ".join(f"Entry {i}: the harbour master logged ship number {i * 7 % 101}." for i in range(400))
    toks = ctx.tokenize(text)
    assert len(toks) >= n
    return toks[:n]


@pytest.mark.parametrize("prefix", [16, 2000])
def test_fork(benchmark, model_path: Path, full: bool, prefix: int) -> None:
    benchmark.group = "fork-vs-prefix"
    length = prefix if full else min(prefix, 64)
    with lloyal.Context(model_path, n_ctx=4096, n_seq_max=2, n_threads=THREADS) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, 0)
        root.prefill(_tokens(ctx, length))
        cells = store.kv_pressure.cells_used

        def run() -> int:
            child = root.fork()
            pos = child.position
            child.prune()
            return pos

        pos = benchmark(run)
        assert pos == length
        assert store.kv_pressure.cells_used == cells == length
        root.prune()


@pytest.mark.parametrize("prefix", [16, 2000])
def test_fork_raw(benchmark, model_path: Path, full: bool, prefix: int) -> None:
    benchmark.group = "fork-vs-prefix"
    length = prefix if full else min(prefix, 64)
    raw = RawLoop(model_path, 4096, 2, THREADS)
    try:
        with lloyal.Context(model_path, n_ctx=256) as tok_ctx:
            toks = _tokens(tok_ctx, length)
        rows = [(t, i, 0, i == len(toks) - 1) for i, t in enumerate(toks)]
        for start in range(0, len(rows), 512):
            raw.decode(rows[start : start + 512])
        mem = raw.ll.llama_get_memory(raw.ctx)

        def run() -> int:
            raw.seq_cp(0, 1)
            pos = int(raw.ll.llama_memory_seq_pos_max(mem, 1)) + 1
            raw.seq_rm(1)
            return pos

        pos = benchmark(run)
        assert pos == length
        assert int(raw.ll.llama_memory_seq_pos_max(mem, 1)) == -1
    finally:
        raw.close()


def raw_prefill_run(model_path: Path, lengths: list[int]) -> tuple[RawLoop, Callable[[], int]]:
    """llama.cpp's C API: every prompt's rows in order, N_BATCH rows per llama_decode."""
    raw = RawLoop(model_path, 2048, len(lengths), THREADS)
    raw.batch = raw.ll.llama_batch_init(N_BATCH, 0, 1)
    with lloyal.Context(model_path, n_ctx=256) as tok_ctx:
        items = [_tokens(tok_ctx, n) for n in lengths]
    rows = [(t, i, s, i == len(toks) - 1) for s, toks in enumerate(items) for i, t in enumerate(toks)]

    def run() -> int:
        raw.clear()
        calls = 0
        for start in range(0, len(rows), N_BATCH):
            raw.decode(rows[start : start + N_BATCH])
            calls += 1
        return calls

    return raw, run


def lloyal_context(model_path: Path, lengths: list[int], invariant: bool) -> lloyal.Context:
    return lloyal.Context(
        model_path,
        n_ctx=2048,
        n_batch=N_BATCH,
        n_seq_max=len(lengths),
        n_threads=THREADS,
        batch_invariant=invariant,
    )


def lloyal_prefill_run(ctx: lloyal.Context, lengths: list[int]) -> Callable[[], int]:
    """One ``BranchStore.prefill`` of every prompt (bin-packed into ceil(T / n_batch) decodes)."""
    store = lloyal.BranchStore(ctx)
    items = [_tokens(ctx, n) for n in lengths]

    def run() -> int:
        branches = [lloyal.Branch.create(ctx, 0) for _ in lengths]
        store.prefill(list(zip(branches, items, strict=True)))
        assert [b.position for b in branches] == lengths
        for b in branches:
            b.prune()
        return -(-sum(lengths) // N_BATCH)

    return run


@pytest.mark.parametrize("impl", ["lloyal_store_prefill", "lloyal_store_prefill_invariant", "raw_loop"])
def test_prefill_mixed(benchmark, model_path: Path, full: bool, impl: str) -> None:
    benchmark.group = "prefill-mixed"
    lengths = LENGTHS if full else [5, 12, 3]
    total = sum(lengths)
    rounds = 3 if full else 1
    if impl == "raw_loop":
        raw, run_raw = raw_prefill_run(model_path, lengths)
        try:
            calls = benchmark.pedantic(run_raw, rounds=rounds, iterations=1)
        finally:
            raw.close()
    else:
        with lloyal_context(model_path, lengths, impl.endswith("_invariant")) as ctx:
            calls = benchmark.pedantic(lloyal_prefill_run(ctx, lengths), rounds=rounds, iterations=1)
    benchmark.extra_info.update(tokens=total, decode_calls=calls)
    assert calls == -(-total // N_BATCH)


def test_prefill_mixed_paired(benchmark, model_path: Path, full: bool) -> None:
    """Target 5 with interleaved rounds: raw loop, then ``store.prefill`` on llama.cpp's kernels,
    repeated (the separate benchmarks above run a minute apart on a machine that drifts)."""
    benchmark.group = "prefill-mixed-paired"
    lengths = LENGTHS if full else [5, 12, 3]
    rounds = 6 if full else 1
    raw, run_raw = raw_prefill_run(model_path, lengths)
    try:
        with lloyal_context(model_path, lengths, invariant=False) as ctx:
            runs = {"raw": run_raw, "lloyal": lloyal_prefill_run(ctx, lengths)}
            med, calls = interleaved(benchmark, runs, rounds)
    finally:
        raw.close()
    benchmark.extra_info.update(tokens=sum(lengths), rounds=rounds, **median_figures(med, ("lloyal", "raw")))
    assert calls == {"raw": -(-sum(lengths) // N_BATCH), "lloyal": -(-sum(lengths) // N_BATCH)}
