"""Rows summarised by the decode itself (``Context.device_rows``, ``LLOYAL_DEVICE_ROWS=1``): the
same tokens as the host's summaries, perplexities and logprobs within float error.

Here the summary runs on llama.cpp's CPU backend; on a GPU it runs there (benches/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import lloyal

# One run of every sampling path that reads a row's summary: top-k (the device's best tokens),
# greedy (its argmax), penalties and a bias (replaced logits), no top-k (the whole row), a
# grammar (the row's maxima, computed when asked), engine generation with logprobs, a fork,
# verify (several rows of one sequence in a decode).
SCRIPT = r"""
import json, sys
import lloyal
model = lloyal.Model(sys.argv[1], repack=False)
ctx = lloyal.Context(model, n_ctx=1024, n_batch=64, n_seq_max=8, batch_invariant=False)
prompt = ctx.tokenize("The three most important things about a garden are")
runs = {}
cases = {
    "top_k": dict(temperature=0.8, top_k=40, top_p=0.95, seed=7),
    "greedy": dict(temperature=0.0),
    "penalty": dict(temperature=1.3, top_k=5, seed=3, repeat_penalty=1.3),
    "bias": dict(temperature=0.9, top_k=8, seed=5),
    "whole_row": dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, seed=11),
    "grammar": dict(temperature=0.9, top_k=20, seed=2),
}
for name, params in cases.items():
    b = lloyal.Branch.create(ctx, 0, params)
    if name == "bias":
        b.set_logit_bias({506: 4.0, 236764: -2.0})
    if name == "grammar":
        b.set_grammar('root ::= ("yes" | "no" | "maybe") " " [a-z ]+')
    b.prefill(prompt)
    tokens = []
    for _ in range(12):
        t = b.produce().token
        if ctx.is_stop_token(t):
            break
        b.commit(t)
        tokens.append(t)
    b.prefill(tokens[:2])  # a batch whose one output is its second row
    runs[name] = [tokens, b.produce().token, b.perplexity, b.sampling_perplexity]
    b.prune()
root = lloyal.Branch.create(ctx, 0, cases["top_k"])
root.prefill(prompt)
child = root.fork()
child.reseed_sampler(99)
items = [list(b.generate(10, top_logprobs=3, logprobs=True)) for b in (root, child)]
runs["generate"] = [
    [[i.token, i.logprob, [list(p) for p in i.top_logprobs]] for i in its] for its in items
]
runs["forks"] = [root.perplexity, child.perplexity]
# verify: several output rows of one sequence in one decode
greedy = lloyal.Branch.create(ctx, 0, cases["greedy"])
greedy.prefill(prompt)
drafts = runs["greedy"][0][:4] + [9]
runs["verify"] = [greedy.verify(drafts), greedy.last_token, greedy.perplexity]
sampled = lloyal.Branch.create(ctx, 0, cases["top_k"])
sampled.prefill(prompt)
runs["verify_sampled"] = [
    sampled.verify(runs["top_k"][0][:3]), sampled.perplexity, sampled.sampling_perplexity
]
print(json.dumps({"device_rows": ctx.device_rows, "runs": runs}))
"""


def run_script(model_path: Path, device_rows: str) -> dict[str, Any]:
    env = {**os.environ, "LLOYAL_DEVICE_ROWS": device_rows, "LLOYAL_N_GPU_LAYERS": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def assert_close(device: Any, host: Any, where: str) -> None:
    """Equal ints (token ids) and floats within 1e-5 relative, through nested lists."""
    if isinstance(host, list):
        assert isinstance(device, list) and len(device) == len(host), where
        for i, (d, h) in enumerate(zip(device, host, strict=True)):
            assert_close(d, h, f"{where}[{i}]")
    elif isinstance(host, float):
        assert device == pytest.approx(host, rel=1e-5, abs=1e-6), where
    else:
        assert device == host, where


def floats(value: Any) -> list[float]:
    """Every float in nested lists, in order."""
    if isinstance(value, list):
        return [f for v in value for f in floats(v)]
    return [value] if isinstance(value, float) else []


def test_device_summaries_give_the_host_s_tokens_and_perplexities(model_path: Path) -> None:
    host = run_script(model_path, "0")
    device = run_script(model_path, "1")
    assert (host["device_rows"], device["device_rows"]) == (False, True)
    assert device["runs"].keys() == host["runs"].keys()
    for name, run in host["runs"].items():
        assert_close(device["runs"][name], run, name)
    # The device sums in float32, the host in float64: equal to 1e-5, not to the last bit, which
    # shows the device's summaries were the ones read.
    pairs = list(zip(floats(list(device["runs"].values())), floats(list(host["runs"].values())), strict=True))
    assert len(pairs) > 40 and sum(d != h for d, h in pairs) > len(pairs) // 2, "not the device's sums"
    tokens = host["runs"]["top_k"][0]
    assert len(tokens) == 12 and len(set(tokens)) > 4, "the sampled run must draw, not repeat"
    assert host["runs"]["grammar"][0], "the grammar run must produce tokens"
    # (How many drafts verify keeps is not asserted: this context is not batch-invariant, so a
    # verify's 5-row decode may rank near-ties otherwise than the 1-row decodes of the greedy run,
    # as it did on the GPU lease's CPU. Both sides of the comparison above run the same kernels.)


def test_contexts_that_keep_rows_on_the_host(
    exact_model: lloyal.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = exact_model
    monkeypatch.setenv("LLOYAL_DEVICE_ROWS", "1")
    with lloyal.Context(model, n_ctx=256, batch_invariant=False) as ctx:
        assert ctx.device_rows
    with lloyal.Context(model, n_ctx=256, batch_invariant=True) as ctx:
        assert not ctx.device_rows, "a batch-invariant context keeps the host's statistics"
    with lloyal.Context(model, n_ctx=256, embeddings=True) as ctx:
        assert not ctx.device_rows
    monkeypatch.delenv("LLOYAL_DEVICE_ROWS")
    with lloyal.Context(model, n_ctx=256, batch_invariant=False) as ctx:
        assert not ctx.device_rows, "off by default"


def test_a_bad_choice_is_refused_naming_the_variable(
    model: lloyal.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLOYAL_DEVICE_ROWS", "auto")
    with pytest.raises(ValueError, match=r"LLOYAL_DEVICE_ROWS.*use 0 or 1"):
        lloyal.Context(model, n_ctx=256)


def test_the_scheduler_and_speculative_tests_pass_with_device_summaries() -> None:
    """The engine's paths (admission, prefix forks, chunked prompts, verify) with every row
    summarised by the decode: those modules' own tests, in a process where the suite's model
    counts as offloaded (its contexts are then not batch-invariant, so device rows apply)."""
    tests = Path(__file__).resolve().parent
    # Not an xdist worker's environment (pytest-benchmark refuses to run under xdist, as an error
    # with the suite's filterwarnings), and no benchmark plugin: these modules have no benches.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env |= {"LLOYAL_DEVICE_ROWS": "1", "LLOYAL_N_GPU_LAYERS": "99"}
    files = [str(tests / "test_scheduler.py"), str(tests / "test_speculative.py")]
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    cmd += ["-p", "no:benchmark"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tests.parent)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
