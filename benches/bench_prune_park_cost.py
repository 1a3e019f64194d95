"""What parking a pruned branch's cells costs per ``prune()``.

A pruned branch's own cells are moved to a hidden sequence (one ``llama_memory_seq_cp`` of its
range) before its sequence is removed, so survivors never reuse them ahead of their own cells
(docs/performance.md, "Batch invariance"). A context with ``n_seq_max=256`` has no id left for
the hidden sequence and frees the cells at once: the same prune without the park, in the same
run. The setup (fork, prefill 32 tokens on the child) is not timed.

Run: ``.venv/bin/python -m pytest benches/bench_prune_park_cost.py --benchmark-enable``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import THREADS

import lloyal

OWN = 32


@pytest.mark.parametrize("n_seq_max", [8, 256], ids=["parked", "freed"])
def test_prune(benchmark, model_path: Path, full: bool, n_seq_max: int) -> None:
    benchmark.group = "prune-park-cost"
    with lloyal.Context(model_path, n_ctx=4096, n_batch=64, n_seq_max=n_seq_max, n_threads=THREADS) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, 0)
        root.prefill(ctx.tokenize("The harbour master logged every ship that came in."))
        prefix = store.kv_pressure.cells_used
        suffix = ctx.tokenize(" And then another one arrived, " * 8, add_special=False)[:OWN]
        children: list[lloyal.Branch] = []

        def setup() -> tuple[tuple[lloyal.Branch], dict[str, object]]:
            child = root.fork()
            child.prefill(suffix)
            children.append(child)
            return (child,), {}

        def run(child: lloyal.Branch) -> None:
            child.prune()

        benchmark.pedantic(run, setup=setup, rounds=200 if full else 2)
        assert all(c.disposed for c in children)
        assert store.kv_pressure.cells_used == prefix
        root.prune()
