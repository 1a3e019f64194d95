"""Batch invariance (docs/api.md, "BranchStore"): a token's logits do not depend on how it was batched.

The default context is batch-invariant on the CPU: weights not repacked, ggml's tiled K-quant
matmul off, flash attention on its one-row path (q8_0 K cache). These tests compare bit for
bit (``==`` / ``np.array_equal``) on the real model, in the regimes where llama.cpp's other
kernels would differ: 4+ rows per commit (repacked gemm), 8+ rows (tiled matmul), 64+ rows
(tiled attention), one row over 512+ cells (split-KV attention), a last prompt chunk of a few
tokens, packed prefill at other cell offsets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
from helpers import exact_model_fixture, greedy_steps, produce_commit

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

# Batch invariance is a CPU feature: this module runs on the CPU on a GPU run too.
pytestmark = pytest.mark.usefixtures("on_cpu")
model = exact_model_fixture()


GREEDY = SamplingParams(temperature=0)

PROMPTS = [
    "The history of the Roman Empire",
    "In a small village by the sea, there lived",
    "def fibonacci(n):\n    ",
    "My favourite recipe for vegetable soup is",
    "The three laws of thermodynamics state that",
    "Once upon a time, in a kingdom far away,",
    "To install the package, first run",
]

STORY = (
    "The lighthouse keeper had lived on the island for almost thirty years. Every evening he "
    "climbed the one hundred and twelve steps of the spiral staircase, trimmed the wick, "
    "polished the great brass lens and watched the beam sweep slowly across the dark water. "
)

MakeContext = Callable[..., lloyal.Context]


def run_branches(
    ctx: lloyal.Context, prompts: list[list[int]], steps: int, batched: bool
) -> tuple[list[list[int]], list[float], list[np.ndarray]]:
    """Greedy generation for one branch per prompt: batched commits or one branch at a time."""
    branches = [Branch.create(ctx, 0, GREEDY) for _ in prompts]
    for b, p in zip(branches, prompts, strict=True):
        b.prefill(p)
    out: list[list[int]] = [[] for _ in branches]
    greedy_steps(branches, out, steps, batched)
    result = (out, [b.perplexity for b in branches], [b.logits for b in branches])
    for b in branches:
        b.prune()
    return result


def test_default_context_is_batch_invariant(make_context: MakeContext) -> None:
    ctx = make_context(n_ctx=256)
    assert ctx.batch_invariant and ctx.flash_attn
    assert (ctx.type_k, ctx.type_v) == ("q8_0", "f16")
    assert ctx.model.repack is False


@pytest.mark.parametrize("n", [4, 7])
def test_batched_commit_equals_single_commits_bit_for_bit(make_context: MakeContext, n: int) -> None:
    ctx = make_context(n_ctx=512, n_seq_max=n)
    prompts = [ctx.tokenize(p) for p in PROMPTS[:n]]
    tok_b, ppl_b, log_b = run_branches(ctx, prompts, 5, batched=True)
    tok_s, ppl_s, log_s = run_branches(ctx, prompts, 5, batched=False)
    assert tok_b == tok_s
    assert len({tuple(t) for t in tok_b}) == n, "the prompts should diverge"
    assert ppl_b == ppl_s
    assert all(np.array_equal(x, y) for x, y in zip(log_b, log_s, strict=True))


def test_batched_commit_exact_over_a_long_shared_prefix(make_context: MakeContext) -> None:
    """600 shared cells: one-row decodes over 512+ cells would take llama.cpp's split-KV
    attention with f16 K/V; here single and batched commits of forks still agree exactly."""
    ctx = make_context(n_ctx=1024, n_seq_max=4)
    store = BranchStore(ctx)
    prefix = (ctx.tokenize(STORY * 12))[:600]
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill(prefix)
    firsts = [int(t) for t in np.argsort(root.logits)[::-1][:3]]

    def run(batched: bool) -> tuple[list[list[int]], list[float]]:
        kids = [root.fork() for _ in firsts]
        out: list[list[int]] = [[t] for t in firsts]
        store.commit(list(zip(kids, firsts, strict=True)))
        greedy_steps(kids, out, 4, batched)
        ppl = [k.perplexity for k in kids]
        for k in kids:
            k.prune()
        return out, ppl

    assert run(batched=True) == run(batched=False)


@pytest.mark.parametrize("n_prompt", [150, 131])
def test_greedy_output_identical_across_n_batch(make_context: MakeContext, n_prompt: int) -> None:
    """docs/api.md: n_batch 32/64/128/512 give the same tokens, perplexity and logits (131
    tokens leaves a last prefill chunk of 3 tokens for n_batch 32/64/128)."""
    runs = {}
    for n_batch in (32, 64, 128, 512):
        ctx = make_context(n_ctx=512, n_batch=n_batch)
        assert ctx.n_batch == n_batch
        tokens = ctx.tokenize(STORY * 4)[:n_prompt]
        assert len(tokens) == n_prompt
        root = Branch.create(ctx, 0, GREEDY)
        root.prefill(tokens)
        first_logits = root.logits
        out = produce_commit(root, 16)
        runs[n_batch] = (out, root.perplexity, first_logits, root.logits, root.position)
        ctx.close()
    ref = runs[512]
    assert ref[4] == n_prompt + 16 and 1.0 <= ref[1] < 1000.0
    for n_batch, run in runs.items():
        assert run[0] == ref[0], f"n_batch={n_batch}: tokens differ"
        assert run[1] == ref[1], f"n_batch={n_batch}: perplexity differs"
        assert np.array_equal(run[2], ref[2]) and np.array_equal(run[3], ref[3])


def test_packed_prefill_equals_individual_prefill(make_context: MakeContext) -> None:
    """Items packed into one decode at other cell offsets == each decoded alone."""
    packed_ctx = make_context(n_ctx=512, n_seq_max=4)
    alone_ctx = make_context(n_ctx=512)
    items = [packed_ctx.tokenize(p) for p in PROMPTS[:3]] + [packed_ctx.tokenize(STORY)[:70]]
    store = BranchStore(packed_ctx)
    packed = [Branch.create(packed_ctx, 0, GREEDY) for _ in items]
    store.prefill(list(zip(packed, items, strict=True)))
    for b, toks in zip(packed, items, strict=True):
        alone = Branch.create(alone_ctx, 0, GREEDY)
        alone.prefill(toks)
        assert np.array_equal(b.logits, alone.logits)
        assert produce_commit(b, 6) == produce_commit(alone, 6)
        assert b.perplexity == alone.perplexity
        alone.prune()


def test_fast_kernels_are_the_default_and_invariance_one_flag_away(
    model_path: object, make_context: MakeContext
) -> None:
    for fast in (
        lloyal.Context(model_path, n_ctx=256),  # type: ignore[arg-type]
        lloyal.Context(model_path, n_ctx=256, batch_invariant=False),  # type: ignore[arg-type]
    ):
        try:
            assert not fast.batch_invariant
            assert (fast.type_k, fast.type_v) == ("f16", "f16")
            assert fast.model.repack is True  # built from a path: llama.cpp's repacked weights
            assert fast.tokenize("hi") == [2, 2202]
        finally:
            fast.close()
    assert lloyal.Model(model_path).repack is True  # type: ignore[arg-type]
    with lloyal.Context(model_path, n_ctx=256, batch_invariant=True) as exact:  # type: ignore[arg-type]
        assert exact.batch_invariant and exact.model.repack is False
        assert (exact.type_k, exact.type_v) == ("q8_0", "f16")
    f16 = make_context(n_ctx=256, type_k="f16")  # auto: both f16 cannot be invariant
    assert not f16.batch_invariant and f16.type_k == "f16"
    v8 = make_context(n_ctx=256, type_k="f16", type_v="q8_0", batch_invariant=True)
    assert v8.batch_invariant and (v8.type_k, v8.type_v) == ("f16", "q8_0")


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"flash_attn": False}, "flash_attn=True"),
        ({"type_k": "f16"}, "type_k"),
        ({"type_k": "f32", "type_v": "f32"}, "type_k"),
    ],
)
def test_impossible_batch_invariance_is_a_value_error(
    model: lloyal.Model, options: dict[str, object], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        lloyal.Context(model, n_ctx=256, batch_invariant=True, **options)  # type: ignore[arg-type]


def test_repacked_model_cannot_be_batch_invariant(model_path: object) -> None:
    repacked = lloyal.Model(model_path, repack=True)  # type: ignore[arg-type]
    assert repacked.repack
    with pytest.raises(ValueError, match="repack=True"):
        lloyal.Context(repacked, n_ctx=256, batch_invariant=True)
    with lloyal.Context(repacked, n_ctx=256) as auto:
        assert not auto.batch_invariant and auto.type_k == "f16"


# What ggml reads: the C environment (Python's os.environ is a copy taken at start-up).
_SWITCH = """
import ctypes
_libc = ctypes.CDLL(None)
_libc.getenv.restype = ctypes.c_char_p
def switch():
    value = _libc.getenv(b"GGML_CPU_TILED_MM")
    return "unset" if value is None else value.decode()
"""


def _fresh_process(script: str) -> list[str]:
    """Run ``script`` in a new interpreter without GGML_CPU_TILED_MM (as a user's process)."""
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    cmd = [sys.executable, "-c", _SWITCH + script]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_tiled_matmul_stays_on_unless_invariance_comes_before_the_first_decode() -> None:
    """llama.cpp's tiled K-quant matmul (8+ rows) is one process-wide switch read at the first
    decode: a fast process keeps it on; a batch-invariant context made first turns it off."""
    fast_first = """
import lloyal
path = lloyal.default_model_path()
with lloyal.Context(path, n_ctx=256) as fast:
    fast.decode(fast.tokenize("one two three four five six seven eight nine ten"), 0)
print(switch())
try:
    lloyal.Context(path, n_ctx=256, batch_invariant=True)
except ValueError as e:
    print("refused" if "before decoding" in str(e) and "GGML_CPU_TILED_MM=0" in str(e) else str(e))
with lloyal.Context(lloyal.Model(path, repack=False), n_ctx=256) as auto:
    print(auto.batch_invariant, auto.type_k)
"""
    assert _fresh_process(fast_first) == ["unset", "refused", "False", "f16"]
    invariant_first = """
import lloyal
path = lloyal.default_model_path()
exact = lloyal.Context(path, n_ctx=256, batch_invariant=True)
print(exact.batch_invariant, switch())
with lloyal.Context(path, n_ctx=256) as fast:
    fast.decode(fast.tokenize("one two three four five six seven eight nine ten"), 0)
with lloyal.Context(path, n_ctx=256, batch_invariant=True) as again:
    print(again.batch_invariant)
exact.close()
"""
    assert _fresh_process(invariant_first) == ["True", "0", "True"]
