"""Branch.score: a prefill that gives each token's logprob under the logits before it, on the
real model, against the same tokens committed one by one on a batch-invariant context."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest

import lloyal

GREEDY = lloyal.SamplingParams(temperature=0)
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun."


@pytest.fixture
def ctx(make_exact_context: Callable[..., lloyal.Context]) -> lloyal.Context:
    return make_exact_context(n_ctx=1024, n_seq_max=4, batch_invariant=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - (np.log(np.exp(x - x.max()).sum()) + x.max())


def one_by_one(
    ctx: lloyal.Context, head: list[int], tokens: list[int], top: int
) -> list[tuple[float, list[int], int]]:
    """Each token's logprob, best ``top`` ids and rank (1 + the tokens with a higher logit) from
    the logits before it, committing the tokens one at a time after ``head`` (prefilled)."""
    out = []
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        b.prefill(head)
        for t in tokens:
            logits = b.logits
            lp = log_softmax(logits)
            rank = 1 + int((logits > logits[t]).sum())
            out.append((float(lp[t]), [int(i) for i in np.argsort(-lp, kind="stable")[:top]], rank))
            b.commit(t)
    return out


def test_each_token_is_scored_under_the_logits_before_it(ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize(TEXT)
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        scored = b.score(tokens, top_logprobs=3)
        assert b.position == len(tokens) and ctx.kv_seq_pos_max(b.seq_id) == len(tokens) - 1
        with lloyal.Branch.create(ctx, 0, GREEDY) as plain:
            plain.prefill(tokens)
            assert np.array_equal(b.logits, plain.logits), "the last row is the branch's logits"
    assert len(scored) == len(tokens)
    assert scored[0] == (None, [], None), "nothing came before the first token"
    assert all(isinstance(s, lloyal.ScoredToken) for s in scored)
    assert (scored[1].logprob, scored[1].top, scored[1].rank) == tuple(scored[1])
    want = one_by_one(ctx, tokens[:1], tokens[1:], 3)
    assert any(w[2] > 3 for w in want) and any(w[2] == 1 for w in want), "ranks in and out of the top"
    for (lp, top, rank), (want_lp, want_top, want_rank) in zip(scored[1:], want, strict=True):
        assert lp is not None and abs(lp - want_lp) < 1e-5
        assert rank == want_rank
        assert [t for t, _ in top] == want_top
        assert [x[1] for x in top] == sorted((x[1] for x in top), reverse=True), "best first"
        assert top[0][1] >= lp - 1e-9


def test_the_first_token_is_scored_against_the_branchs_logits(ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize(TEXT)
    head, tail = tokens[:6], tokens[6:12]
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        b.prefill(head)
        before = log_softmax(b.logits)
        scored = b.score(tail)
        assert b.position == 12
    assert scored[0][0] == pytest.approx(float(before[tail[0]]), abs=1e-5)
    assert [s[1] for s in scored] == [[]] * 6, "no alternatives unless asked"
    want = one_by_one(ctx, head, tail, 0)
    assert [s[0] for s in scored] == pytest.approx([w[0] for w in want], abs=1e-5)


def test_a_long_prompt_is_scored_64_rows_a_tick(ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize(" ".join([TEXT] * 8))
    assert len(tokens) > 130
    calls = ctx.engine_stats().decode_calls
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        scored = b.score(tokens)
        assert b.position == len(tokens)
    assert ctx.engine_stats().decode_calls - calls == -(-len(tokens) // 64)
    want = one_by_one(ctx, tokens[:1], tokens[1:], 0)
    assert [s[0] for s in scored[1:]] == pytest.approx([w[0] for w in want], abs=1e-5)


def test_scores_do_not_depend_on_other_branches_decoding_alongside(ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize(TEXT)
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        alone = b.score(tokens, top_logprobs=2)
    with lloyal.Branch.create(ctx, 0, GREEDY) as other, lloyal.Branch.create(ctx, 0, GREEDY) as b:
        other.prefill(ctx.tokenize("Once upon a time"))
        t = threading.Thread(target=lambda: [None for _ in other.generate(24)])
        t.start()
        beside = b.score(tokens, top_logprobs=2)
        t.join()
    assert beside == alone


def test_nothing_to_score_changes_nothing(ctx: lloyal.Context) -> None:
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        b.prefill(ctx.tokenize("Hello"))
        pos, logits = b.position, b.logits.copy()
        assert b.score([]) == []
        assert b.position == pos and np.array_equal(b.logits, logits)


def test_a_refused_score_leaves_the_branch_as_it_was(
    make_exact_context: Callable[..., lloyal.Context],
) -> None:
    ctx = make_exact_context(n_ctx=64, n_seq_max=2, batch_invariant=True)
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        b.prefill(ctx.tokenize("Hello there"))
        pos, logits = b.position, b.logits.copy()
        cells = lloyal.BranchStore(ctx).kv_pressure.cells_used
        with pytest.raises(ValueError, match="top_logprobs"):
            b.score(ctx.tokenize(" you"), top_logprobs=21)
        with pytest.raises(lloyal.InvalidTokenError):
            b.score([1, ctx.n_vocab])
        with pytest.raises(lloyal.KvCacheFullError):
            b.score(ctx.tokenize(" word" * ctx.n_ctx, add_special=False))
        assert b.position == pos and np.array_equal(b.logits, logits)
        assert ctx.kv_seq_pos_max(b.seq_id) == pos - 1
        assert lloyal.BranchStore(ctx).kv_pressure.cells_used == cells
        assert b.score(ctx.tokenize(" you", add_special=False))[0][0] is not None, "still usable"


def test_an_awaited_score_is_the_same_and_leaves_the_event_loop_running(ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize(" ".join([TEXT] * 3))
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        want = b.score(tokens, top_logprobs=2)

    async def main() -> tuple[list[lloyal.ScoredToken], int, int, list[object]]:
        beats = 0

        async def beat() -> None:
            nonlocal beats
            while True:
                beats += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(beat())
        with lloyal.Branch.create(ctx, 0, GREEDY) as b:
            got = await b.ascore(tokens, 2)
            pos = b.position
            errors: list[object] = []
            for bad in ([tokens[:2], 21], [[1, ctx.n_vocab], 0], [[1] * (ctx.n_ctx + 1), 0]):
                try:
                    await b.ascore(*bad)  # type: ignore[arg-type]
                except (lloyal.LloyalError, ValueError) as e:
                    errors.append(type(e))
            assert b.position == pos, "a refused score leaves the branch as it was"
        ticker.cancel()
        return got, pos, beats, errors

    got, pos, beats, errors = asyncio.run(main())
    assert got == want and all(isinstance(s, lloyal.ScoredToken) for s in got)
    assert pos == len(tokens)
    assert beats > 0, "the event loop ran while the engine scored"
    assert errors == [ValueError, lloyal.InvalidTokenError, lloyal.KvCacheFullError]


def test_cancelling_an_awaited_score_in_flight_rolls_it_back(ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize(" ".join([TEXT] * 24))[: ctx.n_ctx - 8]
    assert len(tokens) > 5 * 64

    async def main() -> tuple[int, int, int]:
        with lloyal.Branch.create(ctx, 0, GREEDY) as b:
            b.prefill(ctx.tokenize("Hello"))
            pos = b.position
            cells = lloyal.BranchStore(ctx).kv_pressure.cells_used
            calls = ctx.engine_stats().decode_calls
            task = asyncio.create_task(b.ascore(tokens))
            while ctx.engine_stats().decode_calls < calls + 2:  # in flight: its rows are decoding
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            done = ctx.engine_stats().decode_calls - calls
            await b.aprefill(ctx.tokenize(" there", add_special=False))  # the engine has moved on
            return b.position - pos, lloyal.BranchStore(ctx).kv_pressure.cells_used - cells, done

    moved, cells, done = asyncio.run(main())
    assert 2 <= done < -(-len(tokens) // 64), "cancelled part way"
    assert (moved, cells) == (1, 1), "the scored rows were rolled back; only the later prefill stayed"
