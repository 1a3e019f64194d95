"""Prompt logprobs on `lloyal serve` (``/v1/completions`` with ``echo`` and ``logprobs``, what
lm-evaluation-harness asks an OpenAI-compatible server for, and vLLM's ``prompt_logprobs`` on
both endpoints), through the official `openai` client over loopback, against `Branch.score` on
a context of the test's own (both batch-invariant).
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
) -> list[tuple[float | None, list[tuple[int, float]], int | None]]:
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
    for got, got_top, (w, w_top, _) in zip(
        lp.token_logprobs[1:-1], lp.top_logprobs[1:-1], want[1:], strict=True
    ):
        assert got == pytest.approx(w, abs=1e-6)
        assert list(got_top.values()) == pytest.approx([w_top[0][1]], abs=1e-6)
    assert lp.tokens[: len(prompt)] == [ref.token_to_text(t) for t in prompt]
    assert r.choices[0].text.startswith(ref.detokenize(prompt, special=False))
    # the continuation's log-likelihood, as the harness sums it
    continuation = sum(lp.token_logprobs[len(ctx_tokens) : -1])
    assert continuation == pytest.approx(sum(w for w, _, _ in want[len(ctx_tokens) :]), abs=1e-5)
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
    want = [w for w, _, _ in scored(ref, ref.tokenize(prompt), 0)]
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
    # every token's text offset counts from the start of the whole text, as the unstreamed one
    offsets = [
        o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == whole.choices[0].logprobs.text_offset and len(offsets) == n + 4


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
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([w for w, _, _ in want[1:]], abs=1e-6)
    plain = client.completions.create(model=name, prompt=prompt, max_tokens=0, echo=True)
    assert plain.choices[0].text == choice.text and plain.usage.completion_tokens == 0
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="echo=true") as bad:
        client.completions.create(model=name, prompt=prompt, max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"


def vllm_prompt_logprobs(
    ref: lloyal.Context, tokens: list[int], k: int
) -> list[dict[str, dict[str, object]] | None]:
    """vLLM's ``prompt_logprobs`` for ``tokens`` from `Branch.score`: per token, the token itself
    (its rank) then the ``k`` best (ranks 1 to k), keyed by id; None for the first."""
    out: list[dict[str, dict[str, object]] | None] = []
    for t, (lp, top, rank) in zip(tokens, scored(ref, tokens, k), strict=True):
        if lp is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": lp, "rank": rank, "decoded_token": ref.token_to_text(t)}}
        for r, (a, alp) in enumerate(top, start=1):
            d.setdefault(str(a), {"logprob": alp, "rank": r, "decoded_token": ref.token_to_text(a)})
        out.append(d)
    return out


def same_logprobs(
    got: list[dict[str, dict[str, object]] | None], want: list[dict[str, dict[str, object]] | None]
) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g is not None and w is not None and list(g) == list(w), "the token first, then the best"
        for key in w:
            assert g[key]["rank"] == w[key]["rank"] and g[key]["decoded_token"] == w[key]["decoded_token"]
            assert g[key]["logprob"] == pytest.approx(w[key]["logprob"], abs=1e-6)


def test_vllms_prompt_logprobs_field_scores_a_completions_prompt(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    prompt = ref.tokenize(CONTEXT + CONTINUATION)
    r = client.completions.create(
        model=name, prompt=prompt, max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": 2}
    )
    want = vllm_prompt_logprobs(ref, prompt, 2)
    ranks = [next(iter(w.values()))["rank"] for w in want[1:] if w is not None]
    assert any(rank > 2 for rank in ranks), "a prompt token outside the best two keeps its own rank"
    for c in r.choices:
        same_logprobs(c.model_extra["prompt_logprobs"], want)
        assert c.logprobs is None and not c.text.startswith(CONTEXT), "no echo, no sampled logprobs asked"
    # echo with fewer sampled alternatives: each field keeps its own count
    e = client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=1,
        logprobs=1,
        echo=True,
        temperature=0,
        extra_body={"prompt_logprobs": 3},
    )
    assert all(len(t) == 1 for t in e.choices[0].logprobs.top_logprobs[1:])
    same_logprobs(e.choices[0].model_extra["prompt_logprobs"], vllm_prompt_logprobs(ref, prompt, 3))
    # the prompt alone: max_tokens 0 needs no echo when the prompt is scored
    z = client.completions.create(model=name, prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": 0})
    assert z.choices[0].text == "" and z.usage.completion_tokens == 0
    same_logprobs(z.choices[0].model_extra["prompt_logprobs"], vllm_prompt_logprobs(ref, prompt, 0))


def test_vllms_prompt_logprobs_field_scores_a_chat_prompt_at_the_top_level(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(
        model=name, messages=messages, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    prompt = ref.tokenize(ref.format_chat(messages).prompt, add_special=False, parse_special=True)
    assert r.usage.prompt_tokens == len(prompt)
    same_logprobs(r.model_extra["prompt_logprobs"], vllm_prompt_logprobs(ref, prompt, 1))
    plain = client.chat.completions.create(model=name, messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].message.content == r.choices[0].message.content
    assert "prompt_logprobs" not in (plain.model_extra or {})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("value", [21, -1, 1.5])
def test_a_prompt_logprobs_outside_0_to_20_is_refused_naming_it(
    client: openai.OpenAI, name: str, value: object, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs") as bad:
        client.completions.create(
            model=name, prompt=CONTEXT, max_tokens=2, stream=stream, extra_body={"prompt_logprobs": value}
        )
    assert bad.value.code == "invalid_schema" and bad.value.param == "prompt_logprobs"


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_logprobs_cannot_be_streamed(client: openai.OpenAI, name: str, chat: bool) -> None:
    extra = {"prompt_logprobs": 1}
    with pytest.raises(openai.BadRequestError, match="stream") as bad:
        if chat:
            messages = [{"role": "user", "content": "Hi"}]
            client.chat.completions.create(model=name, messages=messages, stream=True, extra_body=extra)
        else:
            client.completions.create(model=name, prompt=CONTEXT, stream=True, extra_body=extra)
    assert bad.value.body["param"] == "prompt_logprobs"
