"""The ``lloyal`` command line on the real model (demo, generate, best-of-n, bench, info), progress bars."""

from __future__ import annotations

import html
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import lloyal
from lloyal._model_path import assemble_model
from lloyal.cli import main
from lloyal.progress import Progress, prefill


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
    assert all(type(r[k]) is int for r in rows for k in ("batch", "pp", "tg"))  # not 1.0
    assert captured.err == "", "no progress bar drawn into a log (stderr is no terminal)"
    assert main(["--model", str(model_path), "bench", "-b", "1", "--pp", "40000", "--tg", "1"]) == 1
    assert "beyond the model's training context of 32768" in capsys.readouterr().err


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


# --- info, generate, best-of-n, errors, python -m lloyal ---------------------------------------


def _run_module(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lloyal", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_python_m_lloyal_info_jsonl_is_one_json_object(model_path: Path) -> None:
    done = _run_module("--model", str(model_path), "info", "--jsonl")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1
    facts = json.loads(lines[0])
    assert facts["architecture"] == "gemma3" and facts["n_vocab"] == 262144
    assert facts["n_ctx_train"] == 32768 and facts["chat_template"] is False
    assert Path(facts["path"]) == model_path and facts["n_layer"] == 18
    assert done.stderr == ""  # no progress bar when stderr is not a terminal


def test_info_takes_the_model_as_a_positional_argument(
    model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", str(model_path), "--jsonl"]) == 0
    assert Path(json.loads(capsys.readouterr().out)["path"]) == model_path
    # the positional argument wins over --model
    assert main(["--model", "/nonexistent/other.gguf", "info", str(model_path)]) == 0
    out = capsys.readouterr().out
    assert "architecture   gemma3" in out and "chat_template  False" in out


def test_best_of_n_jsonl_events_tree_and_text_output(
    model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = tmp_path / "t.html"
    prompt = 'Tom wrote <b>"hi"</b> & then'
    argv = [
        "--model",
        str(model_path),
        "best-of-n",
        prompt,
        "-n",
        "2",
        "--max-tokens",
        "4",
        "--seed",
        "3",
        "-t",
        "1",
    ]
    assert main([*argv, "--jsonl", "--tree", str(tree)]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    candidates, summary = events[:-1], events[-1]
    assert [c["event"] for c in candidates] == ["candidate", "candidate"] and summary["event"] == "summary"
    assert [c["branch"] for c in candidates] == [0, 1]
    assert sum(c["winner"] for c in candidates) == 1
    best = min(candidates, key=lambda c: c["perplexity"])
    assert best["winner"] and summary["winner"] == best["branch"] and summary["text"] == best["text"]
    assert all(1 <= c["tokens"] <= 4 and c["perplexity"] >= 1.0 for c in candidates)
    assert summary["tokens"] == sum(c["tokens"] for c in candidates)
    # the server's best_of: the candidates generate together, one decode a step
    assert summary["steps"] == max(c["tokens"] for c in candidates) <= summary["decode_calls"]
    assert summary["decode_calls"] < summary["tokens"]
    assert summary["n"] == 2 and summary["tree"] == str(tree)
    page = tree.read_text(encoding="utf-8")
    for c in candidates:
        assert html.escape(c["text"]) in page
    assert html.escape(prompt) in page and "<b>" not in page
    assert page.count('class="node winner"') == 1
    # same seed, same candidates: the text output names the same winner
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"winner: branch {best['branch']} of 2" in out
    assert f"--- branch {best['branch']}  tokens {best['tokens']}" in out and "<- winner" in out
    assert prompt + best["text"] in out


def test_generate_jsonl_token_events_match_greedy_decoding(
    model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "The capital of France is"
    argv = ["--model", str(model_path), "generate", prompt, "-n", "5", "--temperature", "0", "--threads", "1"]
    assert main([*argv, "--jsonl"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokens, summary = events[:-1], events[-1]
    assert all(e["event"] == "token" for e in tokens) and summary["event"] == "summary"
    assert [e["index"] for e in tokens] == list(range(len(tokens))) and 1 <= len(tokens) <= 5
    assert summary["tokens"] == len(tokens) and summary["stopped"] == (len(tokens) < 5)
    assert summary["text"] == "".join(e["text"] for e in tokens) and summary["perplexity"] >= 1.0
    # The CLI's own setup (repacked weights, n_ctx 512): the same kernels, so the same tokens on
    # any CPU (the suite's model is not repacked, and kernels differ in the last bits).
    with (
        lloyal.Context(lloyal.Model(model_path), n_ctx=512, n_threads=1) as ctx,
        lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)) as b,
    ):
        b.prefill(ctx.tokenize(prompt))
        assert [e["token"] for e in tokens] == [t.token for t in b.generate(5)]
        assert summary["prompt_tokens"] == b.position - len(tokens)
    # without --jsonl the same text is streamed after the prompt
    assert main(argv) == 0
    assert capsys.readouterr().out == prompt + summary["text"] + "\n"


@pytest.mark.parametrize(
    "command",
    [["info"], ["generate", "hi", "-n", "2"], ["best-of-n", "hi", "-n", "2", "--max-tokens", "2"]],
)
def test_a_bad_model_path_exits_1_with_a_message(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "missing.gguf"
    assert main(["--model", str(bad), *command]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("lloyal: error: ") and str(bad) in captured.err


def test_python_m_lloyal_errors_exit_1_without_a_traceback(model_path: Path, tmp_path: Path) -> None:
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("not a model")
    done = _run_module("generate", "--model", str(not_gguf), "hello")
    assert done.returncode == 1 and done.stdout == ""
    assert "lloyal: error:" in done.stderr and str(not_gguf) in done.stderr and "Traceback" not in done.stderr
    done = _run_module("--model", str(model_path), "best-of-n", "hi", "-n", "0")
    assert done.returncode == 1 and "-n must be in 1..255" in done.stderr


def test_serve_refuses_a_negative_cache_budget(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(model_path), "serve", "--cache-cells", "-1"]) == 1
    assert "--cache-cells must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such.gguf", "serve"], 'cannot load model "/no/such.gguf": No such file'),
        (["serve", "--port", "99999"], "--port must be in 0..65535"),
        (["serve", "-t", "0"], "--threads must be >= 1"),
        (["serve", "-ngl", "5", "--batch-invariant"], "--batch-invariant runs on the CPU"),
        (
            ["serve", "--lora", "/no/a.gguf"],
            'cannot load LoRA adapter "/no/a.gguf": No such file or directory',
        ),
        (
            ["serve", "--lora-scaled", "a.gguf:1e300"],
            "the scale of 'a.gguf:1e300' is beyond a float32's range",
        ),
        (
            ["serve", "--lora-scaled", "a.gguf"],
            "--lora-scaled takes FNAME:SCALE (e.g. adapter.gguf:0.5), got 'a.gguf'",
        ),
        (["serve", "--lora-scaled", "a.gguf:x"], "--lora-scaled takes FNAME:SCALE"),
        (["serve", "--lora", "a.gguf", "--batch-invariant"], "--batch-invariant cannot go with --lora"),
    ],
)
def test_serve_refuses_bad_flags_in_one_line_before_it_starts(
    model_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    """What the server would meet as it starts (a traceback there) is refused by the CLI."""
    full = args if args[0] == "--model" else ["--model", str(model_path), *args]
    assert main(full) == 1
    err = capsys.readouterr().err
    assert err.startswith("lloyal: error: ") and message in err and err.count("\n") == 1, err
    not_gguf = Path(__file__)  # a file, not a model
    assert main(["--model", str(not_gguf), "serve"]) == 1
    assert "not a GGUF file (wrong magic bytes)" in capsys.readouterr().err


# --- progress bars ------------------------------------------------------------------------------


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_only_on_a_terminal() -> None:
    tty, pipe = FakeTTY(), io.StringIO()
    for stream in (tty, pipe):
        with Progress(4, "steps", stream=stream, unit="tok", min_interval=0) as bar:
            for _ in range(4):
                bar.update()
    assert pipe.getvalue() == "" and bar.done == 4 and bar.closed
    drawn = tty.getvalue()
    assert "\r" in drawn and "steps [" in drawn and "4/4 tok 100%" in drawn and drawn.endswith("\n")
    assert "#" * 30 in drawn  # the full bar


def test_prefill_in_chunks_matches_one_prefill_and_shows_a_bar(
    make_exact_context: Callable[..., lloyal.Context],
) -> None:
    ctx = make_exact_context(n_ctx=512, n_batch=32, n_seq_max=2, n_threads=1)
    tokens = ctx.tokenize("The harbour town was quiet that night. " * 16)
    assert len(tokens) > 3 * 32
    a, b = lloyal.Branch.create(ctx, 0), lloyal.Branch.create(ctx, 0)
    tty = FakeTTY()
    prefill(a, tokens, stream=tty)
    b.prefill(tokens)
    assert a.position == b.position == len(tokens)
    assert np.array_equal(a.logits, b.logits)  # batch-invariant: same logits however chunked
    drawn = tty.getvalue()
    assert f"{len(tokens)}/{len(tokens)} tokens" in drawn and drawn.endswith("\r\x1b[K")  # erased
    short = FakeTTY()
    a.prune()
    c = lloyal.Branch.create(ctx, 0)
    prefill(c, tokens[:8], stream=short)
    assert c.position == 8 and short.getvalue() == ""  # one chunk: no bar


def test_assemble_model_writes_the_checked_gguf_once(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "model.gguf"
    tty = FakeTTY()
    assert assemble_model(target, stream=tty) == target
    assert target.stat().st_size == lloyal.default_model_path().stat().st_size
    assert [p.name for p in target.parent.iterdir()] == ["model.gguf"]  # no partial file left
    drawn = tty.getvalue()
    assert "assembling model [" in drawn and "MiB 100%" in drawn
    mtime = target.stat().st_mtime_ns
    again = FakeTTY()
    assert assemble_model(target, stream=again) == target
    assert target.stat().st_mtime_ns == mtime and again.getvalue() == ""  # already there: untouched
