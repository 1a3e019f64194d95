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


def test_an_example_given_a_bad_argument_or_model_says_so_in_one_line() -> None:
    """What a user can get wrong ends a script with one line on stderr and status 1."""
    import subprocess
    import sys

    from helpers import EXAMPLES

    for name, args, said in (
        ("streaming", ["--model", "/no/such.gguf"], 'cannot load model "/no/such.gguf"'),
        ("best_of_n", ["-n", "0"], "n_seq_max must be in 1..=256, got 0"),
    ):
        proc = subprocess.run(
            [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr.startswith(f"{name}.py: error: ") and said in proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr
