"""The ``lloyal`` command line on the real model (demo, bench, info)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lloyal.cli import main


def test_demo_jsonl_reports_each_branch_and_a_winner(
    model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--model", str(model_path), "demo", "-n", "3", "--max-tokens", "6", "--jsonl"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    branches = [e for e in events if "branch" in e]
    summary = events[-1]["summary"]
    assert [b["branch"] for b in branches] == [0, 1, 2]
    assert all(1 <= b["tokens"] <= 6 and b["perplexity"] >= 1.0 for b in branches)
    assert summary["winner"] == min(branches, key=lambda b: b["perplexity"])["branch"]
    assert summary["decode_calls"] == summary["steps"] <= 6


def test_bench_jsonl_rows(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(model_path), "bench", "-b", "1,2", "--pp", "8", "--tg", "2", "--jsonl"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["pp"] == 8 and r["tg"] == 2 and r["s_pp"] > 0 and r["s_tg"] > 0 for r in rows)
    assert "2/2" in captured.err  # the progress bar finished


def test_bench_table_and_bad_batches(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(model_path), "bench", "-b", "1", "--pp", "4", "--tg", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("|    B |") and table[2].startswith("|    1 |")
    with pytest.raises(SystemExit):
        main(["--model", str(model_path), "bench", "-b", "one"])
    assert main(["--model", str(model_path), "bench", "-b", "0"]) == 1
    assert "batches must be positive" in capsys.readouterr().err


def test_info_names_the_architecture(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(model_path), "info"]) == 0
    out = capsys.readouterr().out
    assert "gemma3" in out and "262144" in out
