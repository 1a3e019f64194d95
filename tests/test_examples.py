"""The scripts in examples/ run on the real model and do what their docstrings say."""

from __future__ import annotations

from pathlib import Path

from helpers import load_example

import lloyal


def test_best_of_n_keeps_one_lease_and_returns_the_winner_text(model_path: Path) -> None:
    example = load_example("best_of_n")
    with lloyal.Context(model_path, n_ctx=1024, n_seq_max=5) as ctx:
        winner, text = example.best_of_n(ctx, "The capital of France is", n=4, max_tokens=8)
        assert 0 <= winner < 4
        assert text.strip() != ""
        store = lloyal.BranchStore(ctx)
        assert store.available == 4  # retain_only freed the root and the 3 losers
