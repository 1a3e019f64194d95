"""Prompt logprobs on `lloyal serve` (``/v1/completions`` with ``echo`` and ``logprobs``, what
lm-evaluation-harness asks an OpenAI-compatible server for), through the official `openai`
client over loopback, against `Branch.score` on a context of the test's own (both
batch-invariant).
"""

from __future__ import annotations

import pytest

import lloyal

openai = pytest.importorskip("openai", reason="the server extra: pip install 'lloyal[server]'")
pytest.importorskip("uvicorn")


CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " The capital of France is Paris."


def scored(
    ref: lloyal.Context, tokens: list[int], top: int
) -> list[tuple[float | None, list[tuple[int, float]]]]:
    with lloyal.Branch.create(ref, 0, lloyal.SamplingParams(temperature=0)) as b:
        return b.score(tokens, top)


def test_an_lm_eval_loglikelihood_request_gets_every_prompt_tokens_logprob(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    ctx_tokens = ref.tokenize(CONTEXT)
    prompt = ctx_tokens + ref.tokenize(CONTINUATION, add_special=False)
    # lm-evaluation-harness's local-completions payload for a loglikelihood request
    r = client.completions.create(
        model=name, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(prompt) + 1 and len(lp.token_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = scored(ref, prompt, 1)
    for got, got_top, (w, w_top) in zip(
        lp.token_logprobs[1:-1], lp.top_logprobs[1:-1], want[1:], strict=True
    ):
        assert got == pytest.approx(w, abs=1e-6)
        assert list(got_top.values()) == pytest.approx([w_top[0][1]], abs=1e-6)
    assert lp.tokens[: len(prompt)] == [ref.token_to_text(t) for t in prompt]
    assert r.choices[0].text.startswith(ref.detokenize(prompt, special=False))
    # the continuation's log-likelihood, as the harness sums it
    continuation = sum(lp.token_logprobs[len(ctx_tokens) : -1])
    assert continuation == pytest.approx(sum(w for w, _ in want[len(ctx_tokens) :]), abs=1e-5)
    assert lp.token_logprobs[-1] is not None and lp.token_logprobs[-1] <= 0
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 1


def test_a_scored_prompt_forks_nothing_cached(client: openai.OpenAI, name: str, ref: lloyal.Context) -> None:
    prompt = CONTEXT + CONTINUATION
    plain = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].text == again.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0, "the cache serves a plain repeat"
    r = client.completions.create(
        model=name, prompt=prompt, max_tokens=2, logprobs=0, echo=True, temperature=0
    )
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    lp = r.choices[0].logprobs
    want = [w for w, _ in scored(ref, ref.tokenize(prompt), 0)]
    assert lp.token_logprobs[0] is None and want[0] is None
    assert lp.token_logprobs[1 : len(want)] == pytest.approx(want[1:], abs=1e-6)
    assert lp.top_logprobs[1] == {}, "logprobs=0: no alternatives"
    assert r.choices[0].text == ref.detokenize(ref.tokenize(prompt), special=False) + plain.choices[0].text


def test_every_choice_repeats_the_prompts_logprobs(client: openai.OpenAI, name: str) -> None:
    r = client.completions.create(
        model=name, prompt=CONTEXT, max_tokens=3, logprobs=2, echo=True, temperature=1.0, seed=4, n=2
    )
    first, second = (c.logprobs for c in r.choices)
    n = r.usage.prompt_tokens
    assert (
        first.token_logprobs[:n] == second.token_logprobs[:n]
        and first.top_logprobs[:n] == second.top_logprobs[:n]
    )
    assert all(len(t) <= 2 for t in first.top_logprobs[1:])
    assert len(first.tokens) == n + 3


def test_a_streamed_echo_carries_the_prompts_logprobs_first(client: openai.OpenAI, name: str) -> None:
    whole = client.completions.create(
        model=name, prompt=CONTEXT, max_tokens=4, logprobs=1, echo=True, temperature=0
    )
    chunks = list(
        client.completions.create(
            model=name, prompt=CONTEXT, max_tokens=4, logprobs=1, echo=True, temperature=0, stream=True
        )
    )
    first = chunks[0].choices[0]
    n = whole.usage.prompt_tokens
    assert first.text == whole.choices[0].text[: len(first.text)] and first.logprobs is not None
    assert first.logprobs.token_logprobs == whole.choices[0].logprobs.token_logprobs[:n]
    assert first.logprobs.tokens == whole.choices[0].logprobs.tokens[:n]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text


def test_max_tokens_0_with_echo_scores_the_prompt_alone(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    prompt = ref.tokenize(CONTEXT + CONTINUATION)
    r = client.completions.create(
        model=name, prompt=prompt, max_tokens=0, logprobs=2, echo=True, temperature=0
    )
    choice = r.choices[0]
    assert choice.text == ref.detokenize(prompt, special=False) and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and len(choice.logprobs.tokens) == len(prompt)
    want = scored(ref, prompt, 2)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([w for w, _ in want[1:]], abs=1e-6)
    plain = client.completions.create(model=name, prompt=prompt, max_tokens=0, echo=True)
    assert plain.choices[0].text == choice.text and plain.usage.completion_tokens == 0
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="echo=true") as bad:
        client.completions.create(model=name, prompt=prompt, max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
