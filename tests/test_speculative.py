"""Branch.verify and the prompt-lookup speculative example on the real model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest
from helpers import load_example

import lloyal

GREEDY = lloyal.SamplingParams(temperature=0)
PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture
def ctx2(make_context: Callable[..., lloyal.Context]) -> lloyal.Context:
    return make_context(n_ctx=1024, n_seq_max=2, n_batch=64)


def _greedy_tokens(ctx: lloyal.Context, n: int) -> list[int]:
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        b.prefill(ctx.tokenize(PROMPT))
        return [t.token for t in b.generate(n)]


def test_correct_drafts_are_all_accepted_and_the_bonus_committed(ctx2: lloyal.Context) -> None:
    expected = _greedy_tokens(ctx2, 6)
    store = lloyal.BranchStore(ctx2)
    with lloyal.Branch.create(ctx2, 0, GREEDY) as b:
        prompt = ctx2.tokenize(PROMPT)
        b.prefill(prompt)
        assert b.verify(expected[:5]) == 5
        assert b.last_token == expected[5]
        assert b.position == len(prompt) + 6
        assert ctx2.kv_seq_pos_max(b.seq_id) == b.position - 1
        assert store.kv_pressure.cells_used == b.position
        assert 1.0 <= b.perplexity < 1000


def test_an_end_of_generation_ends_the_walk_as_the_bonus(ctx2: lloyal.Context) -> None:
    """Drafts after an end of generation are not kept, also when the end itself was drafted:
    plain decoding stops there (drafts past it were accepted into KV, position and perplexity)."""
    eos = ctx2.eog_tokens[0]
    with lloyal.Branch.create(ctx2, 0, GREEDY) as b:
        b.set_logit_bias({eos: 40.0})  # the branch's sampler wants to end now
        prompt = ctx2.tokenize(PROMPT)
        b.prefill(prompt)
        assert b.verify([eos, eos, eos]) == 0
        assert b.last_token == eos and b.position == len(prompt) + 1
        assert ctx2.kv_seq_pos_max(b.seq_id) == len(prompt)


def test_wrong_drafts_are_rolled_back(ctx2: lloyal.Context) -> None:
    expected = _greedy_tokens(ctx2, 3)
    with lloyal.Branch.create(ctx2, 0, GREEDY) as b:
        prompt = ctx2.tokenize(PROMPT)
        b.prefill(prompt)
        wrong = [t + 1 for t in expected]
        assert b.verify([expected[0], wrong[1], wrong[2]]) == 1
        assert b.last_token == expected[1]  # the sampler's own choice replaced the bad draft
        assert b.position == len(prompt) + 2
        assert ctx2.kv_seq_pos_max(b.seq_id) == b.position - 1
        assert b.verify([]) == 0 and b.last_token == expected[2]


def test_verify_refusals(ctx2: lloyal.Context) -> None:
    with lloyal.Branch.create(ctx2, 0, GREEDY) as b:
        with pytest.raises(lloyal.LloyalError, match="no logits"):
            b.verify([5])
        b.prefill(ctx2.tokenize(PROMPT))
        position = b.position
        with pytest.raises(lloyal.InvalidTokenError):
            b.verify([5, 10**9])
        with pytest.raises(ValueError, match="n_batch"):
            b.verify([5] * 64)
        assert b.position == position


def test_prompt_lookup_example_equals_plain_greedy_with_fewer_decodes(ctx2: lloyal.Context) -> None:
    ex = load_example("speculative")
    prompt = ctx2.tokenize(ex.PROMPT)
    base = ex.plain(ctx2, prompt, 32)
    spec = ex.speculative(ctx2, prompt, 32)
    assert spec.tokens == base.tokens
    assert spec.decodes < base.decodes / 2
    assert spec.accepted / spec.drafted > 0.8
    assert ex.lookup_drafts([1, 2, 3, 9, 1, 2], 2) == [3, 9]
    assert ex.lookup_drafts([1, 2, 3], 4) == []


def _branch_state(b: lloyal.Branch, store: lloyal.BranchStore) -> tuple[object, ...]:
    return (
        b.position,
        b.context.kv_seq_pos_max(b.seq_id),
        store.kv_pressure.cells_used,
        b.last_token,
        b.perplexity,
        b.sampling_perplexity,
        b.grammar_resamples,
        b.logits.tobytes(),
    )


def test_a_grammar_error_part_way_leaves_the_branch_exactly_as_before(ctx2: lloyal.Context) -> None:
    # The grammar takes exactly the one draft token; after it only end-of-generation is
    # allowed, and those are banned, so choosing the bonus fails after the draft was accepted.
    [berlin] = ctx2.tokenize(" Berlin", add_special=False)
    grammar = f'root ::= "{ctx2.detokenize([berlin])}"'
    store = lloyal.BranchStore(ctx2)
    with lloyal.Branch.create(ctx2, 0, GREEDY, grammar=grammar) as b:
        b.prefill(ctx2.tokenize(PROMPT))
        stops = [t for t in range(ctx2.n_vocab) if ctx2.is_stop_token(t)]
        b.set_logit_bias({t: float("-inf") for t in stops})
        before = _branch_state(b, store)
        with pytest.raises(lloyal.GrammarError, match="allows no token"):
            b.verify([berlin])
        assert _branch_state(b, store) == before
        # The grammar is back at its start: the draft is still the only allowed token.
        assert b.produce().token == berlin
        b.commit(berlin)
        assert (b.position, b.last_token) == (before[0] + 1, berlin)


def test_averify_is_verify_on_the_event_loop(ctx2: lloyal.Context) -> None:
    """``averify`` (API.md's ``a*`` forms of ``verify``): the same acceptance, bonus and cells;
    cancelled, the branch as it was or verified, never half-way."""
    expected = _greedy_tokens(ctx2, 6)
    prompt = ctx2.tokenize(PROMPT)
    store = lloyal.BranchStore(ctx2)

    async def main() -> None:
        with lloyal.Branch.create(ctx2, 0, GREEDY) as b:
            b.prefill(prompt)
            drafts = [*expected[:3], expected[3] + 1]  # three right, then a wrong one
            assert await b.averify(drafts) == 3
            assert b.last_token == expected[3] and b.position == len(prompt) + 4
            assert store.kv_pressure.cells_used == b.position
            assert await b.averify([]) == 0 and b.last_token == expected[4]
        # cancelled at any point, the cancellation reaches the caller once the engine answered:
        # the branch as it was or verified, never with the drafts walked and no bonus
        for delay in range(6):
            with lloyal.Branch.create(ctx2, 0, GREEDY) as c:
                c.prefill(prompt)
                task = asyncio.ensure_future(c.averify(expected[:5]))
                for _ in range(delay):
                    await asyncio.sleep(0)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                assert c.position in (len(prompt), len(prompt) + 6), delay
                assert store.kv_pressure.cells_used == c.position
                assert ctx2.kv_seq_pos_max(c.seq_id) == c.position - 1

    asyncio.run(main())
