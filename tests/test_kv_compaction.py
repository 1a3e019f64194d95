"""KV compaction (``crates/lloyal-core/src/state/compact.rs``): once the engine has nothing to do
and the cells in use are few next to the most there were, it writes the KV cache out and reads it
back from cell 0. Later decodes then span only the cells in use; branches, shared prefixes and
their next tokens are unchanged.

llama.cpp logs, with ``LLAMA_KV_CACHE_DEBUG=1``, the highest cell in use + 1 (the span every
decode's attention covers) and the cells in use before placing each batch: the tests read those.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
from helpers import produce_commit, wait_until

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

GREEDY = SamplingParams(temperature=0)
FIND_SLOT = re.compile(r"find_slot: stream\[0\], n = +(\d+), used = +(\d+)")
TEXT = "On the {0} day the {0} travellers counted {1} stars, {2} clouds and one lantern. "


def _prompt(ctx: lloyal.Context, k: int, n: int) -> list[int]:
    words = ["first", "second", "third", "fourth", "fifth", "sixth"]
    text = "".join(TEXT.format(words[k], i, i * 7 + k) for i in range(200))
    return ctx.tokenize(text)[:n]


def _spans(log: str) -> list[tuple[int, int]]:
    """(highest cell in use + 1, cells in use) before each batch llama.cpp placed."""
    return [(int(n), int(used)) for n, used in FIND_SLOT.findall(log)]


@pytest.fixture
def logged_context(
    make_context: Callable[..., lloyal.Context], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., lloyal.Context]:
    """Contexts (not batch-invariant) whose llama.cpp logs each placement to stderr."""
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "1")  # read when the context is made
    monkeypatch.setenv("LLOYAL_LOG", "1")

    def make(**options: object) -> lloyal.Context:
        return make_context(n_ctx=4096, n_batch=512, n_seq_max=8, batch_invariant=False, **options)

    return make


def test_cells_left_high_go_back_to_the_front_and_branches_continue_unchanged(
    logged_context: Callable[..., lloyal.Context], capfd: pytest.CaptureFixture[str]
) -> None:
    ctx = logged_context()
    store = BranchStore(ctx)
    prompts = [_prompt(ctx, k, 600) for k in range(4)]
    branches = [Branch.create(ctx, 0, GREEDY) for _ in prompts]
    store.prefill(list(zip(branches, prompts, strict=True)))  # 2400 cells, the last prompt's highest
    last = branches[-1]
    twin = last.fork()  # shares all of its cells
    for b in branches[:-1]:
        b.prune()
    assert store.kv_pressure.cells_used == 600
    # the last prompt's cells were placed above the other three's (its batch began at 1800+)
    assert max(n for n, _ in _spans(capfd.readouterr().err)) >= 1800

    wait_until(lambda: ctx.engine_stats().kv_compactions == 1)
    tokens = produce_commit(last, 8)
    twin_tokens = produce_commit(twin, 8)
    after = _spans(capfd.readouterr().err)

    # The first decode after compaction spans the 600 cells in use (one copy: still shared),
    # not the 2400+ cells before it; the cache's occupancy is as it was.
    assert after and after[0] == (600, 600)
    assert store.kv_pressure.cells_used == 600 + 16
    assert ctx.engine_stats().kv_compactions == 1  # the cells stayed dense: no second one

    # The same tokens as the prompt prefilled alone on a fresh context, and as its twin's.
    # (Logits are not compared: these kernels' sums depend on where the cells sit, compacted or
    # not, by up to ~0.1 in total variation at this prompt's flattest step.)
    ref = Branch.create(logged_context(), 0, GREEDY)
    ref.prefill(prompts[-1])
    assert tokens == produce_commit(ref, 8) == twin_tokens


def test_a_dense_cache_is_left_in_place(
    logged_context: Callable[..., lloyal.Context], capfd: pytest.CaptureFixture[str]
) -> None:
    ctx = logged_context()
    store = BranchStore(ctx)
    a, b = Branch.create(ctx, 0, GREEDY), Branch.create(ctx, 0, GREEDY)
    store.prefill([(a, _prompt(ctx, 0, 600)), (b, _prompt(ctx, 1, 600))])
    a.prune()  # 600 cells freed below b's: fewer than compaction's least worth moving for
    capfd.readouterr()
    produce_commit(b, 2)
    # b's next cells go into the freed ones below it; the span stays at b's end
    assert _spans(capfd.readouterr().err)[0] == (1200, 600)
    assert ctx.engine_stats().kv_compactions == 0


def test_a_context_made_with_compaction_off_keeps_its_cells_in_place(
    logged_context: Callable[..., lloyal.Context],
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLOYAL_KV_COMPACTION", "0")  # read when the context is made
    ctx = logged_context()
    monkeypatch.delenv("LLOYAL_KV_COMPACTION")
    store = BranchStore(ctx)
    branches = [Branch.create(ctx, 0, GREEDY) for _ in range(4)]
    store.prefill([(b, _prompt(ctx, k, 600)) for k, b in enumerate(branches)])
    for b in branches[:-1]:
        b.prune()
    time.sleep(0.2)  # room for a compaction that should not come
    capfd.readouterr()
    produce_commit(branches[-1], 1)
    assert _spans(capfd.readouterr().err)[0] == (2400, 600)
    assert ctx.engine_stats().kv_compactions == 0


def test_a_fork_shorter_than_its_parent_keeps_the_window_it_shares(
    logged_context: Callable[..., lloyal.Context],
) -> None:
    """Gemma 3's sliding-window layers keep a sequence's last 512 cells. A fork that stopped
    short of its parent still needs parent cells the parent's own window has left behind; after
    compaction both continue as the same tree built on a fresh context does."""

    def tree(ctx: lloyal.Context, burst: bool) -> tuple[Branch, Branch]:
        store = BranchStore(ctx)
        others = [Branch.create(ctx, 0, GREEDY) for _ in range(3)] if burst else []
        parent = Branch.create(ctx, 0, GREEDY)
        jobs = [(b, _prompt(ctx, k + 1, 700)) for k, b in enumerate(others)]
        store.prefill([*jobs, (parent, _prompt(ctx, 0, 600))])
        child = parent.fork()
        parent.prefill(_prompt(ctx, 4, 300))  # the parent's window moves 300 cells on
        child.prefill(_prompt(ctx, 5, 20))
        for b in others:
            b.prune()
        return parent, child

    ctx = logged_context()
    parent, child = tree(ctx, burst=True)  # 2,100 cells pruned below the tree's 920
    wait_until(lambda: ctx.engine_stats().kv_compactions == 1)
    ref_parent, ref_child = tree(logged_context(), burst=False)
    assert produce_commit(child, 8) == produce_commit(ref_child, 8)
    assert produce_commit(parent, 8) == produce_commit(ref_parent, 8)
