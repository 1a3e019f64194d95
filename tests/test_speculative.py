"""Branch.verify and the prompt-lookup speculative example on the real model."""

from __future__ import annotations

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
