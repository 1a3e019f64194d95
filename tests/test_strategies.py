"""lloyal.strategies on the real model: best_of_n, beam_search, speculative_generate (docs/api.md)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

import lloyal
from lloyal import strategies

GREEDY = lloyal.SamplingParams(temperature=0)
PROMPT = "The capital of France is"
COPY = "Original: the harbour master walked along the pier.\nCopy: the harbour"


def greedy_tokens(ctx: lloyal.Context, prompt: str, n: int) -> tuple[list[int], float]:
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        b.prefill(ctx.tokenize(prompt))
        return [t.token for t in b.generate(n)], b.perplexity


def test_exports() -> None:
    assert lloyal.strategies is strategies
    assert "strategies" in lloyal.__all__
    for name in ("best_of_n", "beam_search", "speculative_generate"):
        assert callable(getattr(strategies, name))


def test_best_of_n_keeps_the_least_perplexing_and_one_lease(
    make_context: Callable[..., lloyal.Context],
) -> None:
    ctx = make_context(n_ctx=512, n_seq_max=3)
    store = lloyal.BranchStore(ctx)
    n_prompt = len(ctx.tokenize(PROMPT))
    best = strategies.best_of_n(ctx, PROMPT, 3, max_tokens=4, seed=5)
    assert store.available == 2  # retain_only freed the other two candidates
    assert best.branch.is_active and best.branch.parent is None
    assert len(best.texts) == len(best.tokens) == len(best.perplexities) == 3
    assert all(1 <= len(t) <= 4 for t in best.tokens)
    assert all(text.strip() for text in best.texts)
    assert best.perplexities[best.index] == min(best.perplexities)
    assert best.text == best.texts[best.index] == ctx.detokenize(list(best.tokens[best.index]))
    assert best.branch.position == n_prompt + len(best.tokens[best.index])
    assert best.branch.perplexity == pytest.approx(best.perplexities[best.index])
    assert len(set(best.texts)) > 1, "reseeded candidates differ"
    best.branch.prune()
    live_after_each_step: list[int] = []
    again = strategies.best_of_n(
        ctx, ctx.tokenize(PROMPT), 3, max_tokens=4, seed=5, on_step=live_after_each_step.append
    )
    assert (again.index, again.tokens, again.perplexities) == (best.index, best.tokens, best.perplexities)
    # one on_step call per lockstep decode, each with the candidates that decoded in it
    assert again.steps == len(live_after_each_step) == max(len(t) for t in again.tokens)
    assert live_after_each_step == [sum(len(t) > step for t in again.tokens) for step in range(again.steps)]
    # a candidate ends on a stop token exactly when it is shorter than max_tokens
    assert again.stopped == tuple(len(t) < 4 for t in again.tokens)
    again.branch.prune()
    with pytest.raises(ValueError, match="n_seq_max=3"):
        strategies.best_of_n(ctx, PROMPT, 4)
    with pytest.raises(ValueError, match="n must be"):
        strategies.best_of_n(ctx, PROMPT, 0)
    assert store.available == 3


def test_beam_search_result_and_leases(make_context: Callable[..., lloyal.Context]) -> None:
    ctx = make_context(n_ctx=512, n_seq_max=3)
    store = lloyal.BranchStore(ctx)
    n_prompt = len(ctx.tokenize(PROMPT))
    result = strategies.beam_search(ctx, PROMPT, width=2, max_tokens=4)
    assert store.available == ctx.n_seq_max - 1
    assert result.branch.is_active and result.branch.parent is None
    assert 1 <= len(result.tokens) <= 4
    assert result.text == ctx.detokenize(list(result.tokens))
    assert result.score < 0
    assert math.isfinite(result.perplexity) and result.perplexity >= 1.0
    assert result.perplexity == pytest.approx(math.exp(-result.score / len(result.tokens)))
    if not result.finished:
        assert result.branch.position == n_prompt + len(result.tokens)
    result.branch.prune()
    with pytest.raises(ValueError, match=r"n_seq_max>=4"):
        strategies.beam_search(ctx, PROMPT, width=3, max_tokens=2)
    blocker = lloyal.Branch.create(ctx, 0, GREEDY)
    with pytest.raises(ValueError, match="only 2 of n_seq_max=3 are free"):
        strategies.beam_search(ctx, PROMPT, width=2, max_tokens=2)
    blocker.prune()
    assert store.available == 3


def test_beam_width_one_is_greedy(make_context: Callable[..., lloyal.Context]) -> None:
    ctx = make_context(n_ctx=512, n_seq_max=2)
    expected, ppl = greedy_tokens(ctx, PROMPT, 6)
    result = strategies.beam_search(ctx, PROMPT, width=1, max_tokens=6)
    assert list(result.tokens) == expected
    assert result.perplexity == pytest.approx(ppl, rel=1e-5)
    assert result.compactions == 0
    assert lloyal.BranchStore(ctx).available == 1


def test_speculative_generate_equals_greedy(make_context: Callable[..., lloyal.Context]) -> None:
    ctx = make_context(n_ctx=512, n_seq_max=2)
    expected, _ = greedy_tokens(ctx, COPY, 16)
    result = strategies.speculative_generate(ctx, COPY, 16)
    with result.branch:
        assert list(result.tokens) == expected
        assert result.text == ctx.detokenize(expected)
        assert 0 < result.accepted <= result.drafted
        assert result.rounds < len(expected), "accepted drafts save rounds"
        assert result.rounds <= result.decodes <= 2 * result.rounds
        assert result.rounds + result.accepted == len(expected)
        assert 0.0 < result.acceptance <= 1.0
        assert result.branch.position == len(ctx.tokenize(COPY)) + len(expected)
    # On a caller's branch, with a custom (always wrong) drafter: still greedy, nothing accepted.
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        wrong = strategies.speculative_generate(b, COPY, 6, draft=lambda _h, k: [expected[0] + 1] * k)
        assert list(wrong.tokens) == expected[:6]
        assert wrong.accepted == 0 and wrong.drafted > 0
        assert wrong.branch == b
    assert strategies.prompt_lookup_drafts([1, 2, 3, 9, 1, 2], 2) == [3, 9]
    assert strategies.prompt_lookup_drafts([1, 2, 3], 4) == []


def test_beam_search_survives_a_step_that_drops_a_fork_and_its_parent(
    make_context: Callable[..., lloyal.Context],
) -> None:
    """A step that drops a beam and the fork made from it last step (listed first) prunes the
    parent as the fork's ancestor, then meets it again as a beam of its own: passed over now
    (it raised BranchDisposedError, 43 tokens into a width-3 search on a non-invariant context)."""
    ctx = make_context(n_ctx=256, n_seq_max=4)
    root = lloyal.Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize(PROMPT))
    beam = root.fork()
    beam.commit(beam.produce().token)
    its_fork = beam.fork()
    for dropped in (its_fork, beam):  # _advance's order: a beam's forks before the beam
        strategies._prune_upwards(dropped, {root.handle})
    assert beam.disposed and its_fork.disposed and root.is_leaf
    root.prune()
    result = strategies.beam_search(ctx, PROMPT, width=3, max_tokens=20)
    with result.branch:
        assert len(result.tokens) == 20
    assert lloyal.BranchStore(ctx).available == 4


def test_strategies_give_back_leases_and_cells_when_they_fail(
    make_context: Callable[..., lloyal.Context],
) -> None:
    ctx = make_context(n_ctx=256, n_seq_max=4, n_batch=64)
    store = lloyal.BranchStore(ctx)

    def interrupt(_live: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(lloyal.KvCacheFullError):
        strategies.best_of_n(ctx, PROMPT, n=3, max_tokens=200)
    assert (store.available, store.kv_pressure.cells_used) == (4, 0)
    with pytest.raises(KeyboardInterrupt):
        strategies.best_of_n(ctx, PROMPT, n=2, max_tokens=5, on_step=interrupt)
    assert (store.available, store.kv_pressure.cells_used) == (4, 0)

    def failing(_history: list[int], _n: int) -> list[int]:
        raise RuntimeError("the drafter failed")

    with pytest.raises(RuntimeError, match="the drafter failed"):
        strategies.speculative_generate(ctx, PROMPT, 8, draft=failing)
    assert (store.available, store.kv_pressure.cells_used) == (4, 0)
    with pytest.raises(ValueError, match="the prompt is empty"):
        strategies.best_of_n(ctx, "", n=2)


def test_speculative_generate_keeps_to_k_and_to_the_cells_left(
    make_context: Callable[..., lloyal.Context],
) -> None:
    """At most ``k`` drafts a round, whatever the drafter offers; a full cache ends the run with
    the tokens so far (plain decoding's tokens), not an error that loses them."""
    ctx = make_context(n_ctx=256, n_seq_max=2, n_batch=64)
    expected, _ = greedy_tokens(ctx, PROMPT, 256 - len(ctx.tokenize(PROMPT)))
    offered = strategies.speculative_generate(ctx, PROMPT, 40, draft=lambda _h, _n: [5] * 200, k=2)
    with offered.branch:
        assert offered.drafted <= 2 * offered.rounds
    full = strategies.speculative_generate(ctx, PROMPT, 400)
    with full.branch:
        prompt = len(ctx.tokenize(PROMPT))
        assert full.branch.position == 256 and not full.stopped
        assert list(full.tokens) == expected[: 256 - prompt]
    # a branch given text goes on from where it is: no BOS mid-sequence, "" adds nothing
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        b.prefill(ctx.tokenize(PROMPT))
        on = strategies.speculative_generate(b, "", 3)
        assert b.position == prompt + 3 and list(on.tokens) == expected[:3]
        strategies.speculative_generate(b, " and", 1)
        assert b.position == prompt + 3 + len(ctx.tokenize(" and", add_special=False)) + 1
