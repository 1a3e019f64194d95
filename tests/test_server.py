"""`lloyal serve` through the official `openai` client over loopback, on the real model.

One server per module (uvicorn in a thread on 127.0.0.1, a free port). Greedy answers are
compared token for token with the library driven directly, so batching, forking and the prefix
cache are checked for exactness, not just for running.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest
from helpers import (
    GPU_BACKEND,
    MODELS_ON_CPU,
    THP,
    THP_COLLAPSE,
    greedy_completion,
    person_schema,
    serving,
    stream_with_usage,
)
from helpers import SERVER_KEY as KEY

import lloyal

openai = pytest.importorskip("openai", reason="the server extra: pip install 'lloyal[server]'")
uvicorn = pytest.importorskip("uvicorn")

from lloyal.server import ServerConfig, begin_shutdown, create_app  # noqa: E402
from lloyal.server.state import ServerState  # noqa: E402

N_CTX = 1024


@pytest.fixture(scope="module")
def server(model_path: str) -> Iterator[str]:
    # Batch-invariant: the tests compare the server's tokens with a context of their own.
    cfg = ServerConfig(
        model=model_path,
        n_ctx=N_CTX,
        parallel=6,
        api_key=KEY,
        embeddings=True,
        n_threads=2,
        batch_invariant=True,
    )
    with serving(create_app(cfg)) as url:
        yield url


AUTH = {"authorization": f"Bearer {KEY}"}


def metric(server: str, key: str) -> float:
    text = httpx.get(server + "/metrics", headers=AUTH).text
    m = re.search(rf"^{re.escape(key)} (\S+)$", text, re.M)
    assert m, f"{key} not in /metrics"
    return float(m.group(1))


PROMPT = "The capital of France is"


# -- basics ----------------------------------------------------------------------------------


def test_the_openapi_document_lists_the_errors_the_routes_answer(server: str) -> None:
    """What a client generated from ``/openapi.json`` (or a schema-driven fuzzer) expects: a bad
    body is a 400 with OpenAI's error JSON, not FastAPI's 422; ``/metrics`` is text."""
    doc = httpx.get(server + "/openapi.json", headers=AUTH).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"400", "401", "429", "503"} <= set(responses), path
        schema = responses["400"]["content"]["application/json"]["schema"]
        assert schema["properties"]["error"]["required"] == ["message", "type"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_a_browser_on_another_origin_may_call_the_server(server: str) -> None:
    """CORS, allowed for any origin by default (llama-server's and vLLM's): the preflight is
    answered without the API key (browsers send none with it), the call itself still needs it."""
    origin = {"origin": "http://localhost:3000"}
    pre = httpx.options(
        server + "/v1/chat/completions",
        headers={
            **origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization",
        },
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    assert httpx.get(server + "/v1/models", headers=origin).status_code == 401
    ok = httpx.get(server + "/v1/models", headers={**origin, **AUTH})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"


def test_models_health_tokenize(server: str, client: openai.OpenAI, name: str, ref: lloyal.Context) -> None:
    assert [m.id for m in client.models.list().data] == [name]
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    assert httpx.post(server + "/tokenize", json={"content": PROMPT}).status_code == 401  # all but /health
    toks = httpx.post(server + "/tokenize", json={"content": PROMPT}, headers=AUTH).json()["tokens"]
    assert toks == ref.tokenize(PROMPT, add_special=False)  # llama-server's default: no BOS
    bos = httpx.post(server + "/tokenize", json={"content": PROMPT, "add_special": True}, headers=AUTH)
    assert bos.json()["tokens"] == ref.tokenize(PROMPT) == [ref.bos_token, *toks]
    back = httpx.post(server + "/detokenize", json={"tokens": toks}, headers=AUTH).json()["content"]
    assert back == PROMPT
    # with pieces, as llama-server: a piece that is not UTF-8 alone (a byte-fallback token) as bytes
    pieces = httpx.post(server + "/tokenize", json={"content": "a 🦙", "with_pieces": True}, headers=AUTH)
    llama = list("🦙".encode())
    assert [p["piece"] for p in pieces.json()["tokens"]] == ["a", " ", *([b] for b in llama)]


def test_completion_greedy_equals_library(client: openai.OpenAI, name: str, ref: lloyal.Context) -> None:
    want = greedy_completion(ref, ref.tokenize(PROMPT), 12)
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.detokenize(want)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.tokenize(PROMPT))
    assert r.usage.completion_tokens == 12
    # token ids as the prompt, and a batch of two prompts: same answer at index 0 and 1
    r2 = client.completions.create(
        model=name, prompt=[ref.tokenize(PROMPT), ref.tokenize(PROMPT)], max_tokens=12, temperature=0
    )
    assert [c.index for c in r2.choices] == [0, 1]
    assert [c.text for c in r2.choices] == [r.choices[0].text] * 2


def test_echo_and_stop(client: openai.OpenAI, name: str, ref: lloyal.Context) -> None:
    full = ref.detokenize(greedy_completion(ref, ref.tokenize(PROMPT), 16))
    stop = full[5:9]
    assert stop.strip(), full
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    # more than OpenAI's 4 (vLLM and llama-server take any number): the one that matches is the 6th
    many = [f"never-{i}-zz" for i in range(5)] + [stop]
    m = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0, stop=many)
    assert (m.choices[0].text, m.choices[0].finish_reason) == (r.choices[0].text, "stop")
    for bad in (["x"] * 65, [stop, ""]):
        with pytest.raises(openai.BadRequestError, match="stop takes at most 64 non-empty strings"):
            client.completions.create(model=name, prompt=PROMPT, max_tokens=4, stop=bad)
    e = client.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith(PROMPT) and len(e.choices[0].text) > len(PROMPT)


def test_stream_equals_non_stream_with_usage(client: openai.OpenAI, name: str) -> None:
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        stream_with_usage(client.completions.create, model=name, prompt=PROMPT, max_tokens=10, temperature=0)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_logprobs(client: openai.OpenAI, name: str) -> None:
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 5 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and val <= 0
        assert math.isclose(val, max(top.values()), abs_tol=1e-4)  # greedy: the top token
        assert tok in top
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
    streamed = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, stream=True
    )
    offsets = [
        o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == lp.text_offset  # from the start of the text, not of each chunk
    c = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)


def test_llama_servers_sampling_fields_are_honoured(client: openai.OpenAI, name: str) -> None:
    """llama-server's names and samplers, which its OpenAI endpoints take too: ``repeat_penalty``
    is ``repetition_penalty``, ``n_predict`` is ``max_tokens`` (-1: no limit), and DRY, mirostat,
    XTC, typical-p and the penalty window each change what is sampled."""

    def text(max_tokens: int | None = 12, **fields: Any) -> str:
        extra = {"temperature": 0, "seed": 3, **fields}
        r = client.completions.create(
            model=name, prompt="a a a a a a a a", max_tokens=max_tokens, extra_body=extra
        )
        return str(r.choices[0].text)

    plain = text()
    assert text(repeat_penalty=1.8) == text(repetition_penalty=1.8) != plain
    assert text(dry_multiplier=2.0, dry_allowed_length=1) != plain
    assert text(repetition_penalty=1.8, repeat_last_n=0) == plain  # a window of no tokens
    for fields in ({"mirostat": 2}, {"xtc_probability": 1.0, "xtc_threshold": 0.01}, {"typical_p": 0.2}):
        sampled = {"temperature": 1.0, **fields}
        assert text(**sampled) == text(**sampled) != text(temperature=1.0), fields
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=None, extra_body={"n_predict": 3})
    assert r.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="one of them"):
        client.completions.create(model=name, prompt=PROMPT, max_tokens=3, extra_body={"n_predict": 3})
    with pytest.raises(openai.BadRequestError, match="stream=true") as opts:
        client.completions.create(
            model=name, prompt=PROMPT, max_tokens=3, stream_options={"include_usage": True}
        )
    assert opts.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError, match="use_beam_search") as beam:
        client.completions.create(
            model=name, prompt=PROMPT, max_tokens=3, extra_body={"use_beam_search": True}
        )
    assert beam.value.param == "use_beam_search"


def test_logit_bias_bans_the_greedy_token(client: openai.OpenAI, name: str, ref: lloyal.Context) -> None:
    first = greedy_completion(ref, ref.tokenize(PROMPT), 1)[0]
    r = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(first): -100}, logprobs=0
    )
    assert r.choices[0].text != ref.token_to_text(first)


# -- n, best_of, seeds -----------------------------------------------------------------------


def test_n_choices_are_forks_with_seeds(client: openai.OpenAI, name: str) -> None:
    args: dict[str, Any] = dict(model=name, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7)
    r = client.completions.create(n=3, **args)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len(set(texts)) == 3  # different seeds per choice
    assert [c.text for c in client.completions.create(n=3, **args).choices] == texts  # seeded: reproducible
    # choice i of a seeded request is what a single request with seed + i gives
    one = client.completions.create(**{**args, "seed": 8})
    assert one.choices[0].text == texts[1]


def test_best_of_keeps_the_least_perplexing(client: openai.OpenAI, name: str) -> None:
    args: dict[str, Any] = dict(
        model=name, prompt="In a quiet harbour", max_tokens=8, temperature=1.0, seed=11
    )
    every = client.completions.create(n=4, logprobs=0, **args)  # the same four candidates, all returned
    ppl = []
    for c in every.choices:
        lps = c.logprobs.token_logprobs
        ppl.append((math.exp(-sum(lps) / len(lps)), c.text))
    best = client.completions.create(n=1, best_of=4, **args)
    assert best.usage.completion_tokens == 32  # all four were generated, one returned
    assert best.choices[0].text == min(ppl)[1], ppl
    two = client.completions.create(n=2, best_of=4, **args)
    assert [c.text for c in two.choices] == [t for _, t in sorted(ppl)[:2]]


# -- chat ------------------------------------------------------------------------------------


def test_chat_greedy_equals_library_and_stream(client: openai.OpenAI, name: str, ref: lloyal.Context) -> None:
    msgs = [{"role": "user", "content": "Name one colour."}]
    fc = ref.format_chat(msgs)
    prompt = ref.tokenize(fc.prompt, add_special=False, parse_special=True)
    want = ref.detokenize(greedy_completion(ref, prompt, 20, fc.stop_tokens))
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(model=name, messages=msgs, max_tokens=20, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_multi_turn_prefills_only_the_new_turn(client: openai.OpenAI, name: str, ref: lloyal.Context) -> None:
    first = [{"role": "user", "content": "Write the word 'blue'."}]
    r1 = client.chat.completions.create(model=name, messages=first, max_tokens=8, temperature=0)
    p1 = r1.usage.prompt_tokens
    convo = [*first, {"role": "assistant", "content": r1.choices[0].message.content}]
    convo.append({"role": "user", "content": "Again."})
    r2 = client.chat.completions.create(model=name, messages=convo, max_tokens=8, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= p1  # at least the whole first prompt came from the cache
    assert r2.usage.prompt_tokens > cached
    # and the answer is the cold answer
    fc = ref.format_chat(convo)
    prompt = ref.tokenize(fc.prompt, add_special=False, parse_special=True)
    assert r2.choices[0].message.content == ref.detokenize(greedy_completion(ref, prompt, 8, fc.stop_tokens))


def test_shared_system_prompt_is_reused_across_users(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    system = {"role": "system", "content": "You are a terse assistant for a bakery. " * 4}
    asks = [[system, {"role": "user", "content": q}] for q in ("Open on Sunday?", "Any rye bread?")]
    shared = ref.tokenize(ref.format_chat(asks[0]).prompt, add_special=False, parse_special=True)
    other = ref.tokenize(ref.format_chat(asks[1]).prompt, add_special=False, parse_special=True)
    common = next(i for i, (x, y) in enumerate(zip(shared, other, strict=False)) if x != y)
    client.chat.completions.create(model=name, messages=asks[0], max_tokens=4, temperature=0)
    r = client.chat.completions.create(model=name, messages=asks[1], max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == common  # forked at the divergence point
    fc = ref.format_chat(asks[1])
    assert r.choices[0].message.content == ref.detokenize(greedy_completion(ref, other, 6, fc.stop_tokens))


def test_penalties_see_only_the_requests_own_tokens_when_its_prompt_is_cached(
    client: openai.OpenAI, name: str
) -> None:
    """A request forked from a cached prompt penalises what it generates, as the same request run
    cold does, not also the tokens of the request that left the prompt in the cache (its branch's
    penalty history came with the fork: the text changed once the prompt was cached)."""
    prompt = "Here is a long list of fruits people eat in summer: apples, bananas, cherries, apples, and"
    ask = {"model": name, "prompt": prompt, "max_tokens": 10, "temperature": 0, "frequency_penalty": 1.5}
    runs = [client.completions.create(**ask) for _ in range(3)]  # type: ignore[call-overload]
    assert [r.usage.prompt_tokens_details.cached_tokens > 0 for r in runs] == [False, True, True]
    assert runs[1].choices[0].text == runs[0].choices[0].text == runs[2].choices[0].text


SCHEMA = person_schema()


def test_response_format_json_schema(client: openai.OpenAI, name: str) -> None:
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "A person as JSON."}],
            max_tokens=48,
            temperature=temperature,
            seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    o = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Any JSON object."}],
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if o.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(o.choices[0].message.content), dict)


def test_gbnf_grammar_field(client: openai.OpenAI, name: str) -> None:
    """llama-server's ``grammar`` (GBNF) constrains both endpoints, on llguidance like
    ``response_format``; a bad grammar is a 400 naming the field."""
    gbnf = 'root ::= ("yes" | "no") " " [0-9]{1,2}'
    c = client.completions.create(
        model=name, prompt="Answer:", max_tokens=8, temperature=1.0, seed=2, extra_body={"grammar": gbnf}
    )
    assert c.choices[0].finish_reason == "stop" and re.fullmatch(r"(yes|no) [0-9]{1,2}", c.choices[0].text)
    r = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Yes?"}], max_tokens=8, extra_body={"grammar": gbnf}
    )
    answer = r.choices[0].message.content or ""
    assert re.fullmatch(r"(yes|no) [0-9]{1,2}", answer), answer
    with pytest.raises(openai.BadRequestError, match="grammar") as bad:
        client.completions.create(model=name, prompt="x", max_tokens=1, extra_body={"grammar": "root ::= ("})
    assert bad.value.body["param"] == "grammar"
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
            extra_body={"grammar": gbnf},
        )


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_tools_are_rendered_and_parsed(client: openai.OpenAI, name: str) -> None:
    r = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=WEATHER_TOOLS,
        max_tokens=24,
        temperature=0,
    )
    msg = r.choices[0].message
    if msg.tool_calls:  # the 270M model may or may not call it; when it does, the shape is OpenAI's
        assert r.choices[0].finish_reason == "tool_calls"
        assert isinstance(json.loads(msg.tool_calls[0].function.arguments), dict)
    else:
        assert isinstance(msg.content, str)


def test_a_streamed_reply_with_tools_sends_its_plain_text_as_it_comes(
    client: openai.OpenAI, name: str
) -> None:
    request: dict[str, Any] = dict(
        model=name,
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        tools=WEATHER_TOOLS,
        max_tokens=24,
        temperature=0,
        logprobs=True,
    )
    whole = client.chat.completions.create(**request)
    msg = whole.choices[0].message
    assert msg.content and not msg.tool_calls, msg  # the model answers this one in text
    chunks = list(client.chat.completions.create(stream=True, **request))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == msg.content
    assert len(pieces) > 5  # token by token, not whole in the last chunk
    logprobs = [
        lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content
    ]
    assert len(logprobs) == whole.usage.completion_tokens
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


# -- concurrency, cancellation, leases ---------------------------------------------------------


def test_concurrent_requests_share_decode_steps(server: str, name: str, ref: lloyal.Context) -> None:
    prompts = [f"Fact number {i}:" for i in range(6)]
    want = [ref.detokenize(greedy_completion(ref, ref.tokenize(p), 10)) for p in prompts]
    steps0 = metric(server, "lloyal_decode_steps_total")
    tokens0 = metric(server, "lloyal_generation_tokens_total")
    calls0 = metric(server, "lloyal_engine_decode_calls_total")
    rows0 = metric(server, "lloyal_engine_rows_total")

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120) as ac:
            rs = await asyncio.gather(
                *(ac.completions.create(model=name, prompt=p, max_tokens=10, temperature=0) for p in prompts)
            )
        return [r.choices[0].text for r in rs]

    assert asyncio.run(main()) == want  # batched with each other == alone
    steps = metric(server, "lloyal_decode_steps_total") - steps0
    tokens = metric(server, "lloyal_generation_tokens_total") - tokens0
    assert tokens == 60
    assert steps < 40  # 60 tokens in far fewer decode steps: requests shared steps
    # The engine's own counters: every committed token and every prompt token is a row, and
    # the commits of a step shared its llama_decode calls (prompts may have taken a few more).
    prompt_rows = sum(len(ref.tokenize(p)) for p in prompts)
    assert metric(server, "lloyal_engine_rows_total") - rows0 >= tokens + prompt_rows - 6 * 2
    assert metric(server, "lloyal_engine_decode_calls_total") - calls0 < steps + 12


def test_64_concurrent_requests_queue_and_complete(server: str, name: str, ref: lloyal.Context) -> None:
    prompts = [f"Item {i}:" for i in range(64)]

    async def main() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300) as ac:
            return await asyncio.gather(
                *(ac.completions.create(model=name, prompt=p, max_tokens=3, temperature=0) for p in prompts)
            )

    rs = asyncio.run(main())  # 64 requests against --parallel 6: the rest wait their turn
    for p, r in zip(prompts, rs, strict=True):
        assert r.usage.prompt_tokens == len(ref.tokenize(p))
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    assert metric(server, "lloyal_running_sequences") == 0
    assert metric(server, "lloyal_queue_depth") == 0


def test_cancelled_stream_frees_its_branches(server: str, client: openai.OpenAI, name: str) -> None:
    stream = client.completions.create(
        model=name, prompt="Count: 1, 2,", max_tokens=200, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while metric(server, "lloyal_running_sequences") != 0:
        assert time.monotonic() < deadline, "the cancelled request still runs"
        time.sleep(0.1)


def test_prefix_cache_metrics(server: str) -> None:
    text = httpx.get(server + "/metrics", headers=AUTH).text
    for key in (
        "lloyal_requests_total",
        "lloyal_generation_tokens_per_second",
        "lloyal_queue_depth",
        "lloyal_kv_cells_used",
        "lloyal_prefix_cache_hit_rate",
    ):
        assert key in text
    assert 0 < metric(server, "lloyal_prefix_cache_hit_rate") <= 1
    # requests are counted by the route they matched: made-up paths are one "other" series
    for i in range(3):
        httpx.get(f"{server}/no/such/path/{i}", headers=AUTH)
    text = httpx.get(server + "/metrics", headers=AUTH).text
    assert "/no/such/path" not in text
    assert 'lloyal_requests_total{path="other",status="404"}' in text
    assert 'lloyal_requests_total{path="/v1/completions",status="200"}' in text


# -- embeddings ------------------------------------------------------------------------------


def test_embeddings(client: openai.OpenAI, name: str, ref: lloyal.Context) -> None:
    r = client.embeddings.create(model=name, input=["hello world", "a cat"])
    v = [np.array(d.embedding) for d in r.data]
    assert len(v) == 2 and v[0].shape == (ref.model.n_embd,)
    assert [round(float(np.linalg.norm(x)), 4) for x in v] == [1.0, 1.0]
    again = client.embeddings.create(model=name, input="hello world", encoding_format="float")
    np.testing.assert_allclose(np.array(again.data[0].embedding), v[0], rtol=1e-5, atol=1e-6)
    assert r.usage.prompt_tokens == len(ref.tokenize("hello world")) + len(ref.tokenize("a cat"))
    # an input is pooled from one decode: past the embedding context's batch (512) is refused up
    # front (it passed the n_ctx check and failed with "create the Context with a larger n_batch")
    with pytest.raises(openai.BadRequestError, match="takes at most 512 an input") as e:
        client.embeddings.create(model=name, input="word " * 600)
    assert e.value.code == "context_length_exceeded" and e.value.param == "input"


# -- errors ----------------------------------------------------------------------------------


def test_errors_are_openai_shaped(server: str, client: openai.OpenAI, name: str) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        client.completions.create(model=name, prompt="x", max_tokens=N_CTX + 1)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="temperature") as v:
        client.completions.create(model=name, prompt="x", max_tokens=1, temperature=5)
    assert v.value.code == "invalid_schema" and v.value.param == "temperature"
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=name, prompt=[10**9], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=name, prompt="x", max_tokens=1, n=3, best_of=2)
    with pytest.raises(openai.BadRequestError, match="streamed"):
        client.completions.create(model=name, prompt="x", max_tokens=1, best_of=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="--parallel") as many:
        client.completions.create(model=name, prompt="x", max_tokens=1, n=40)
    assert many.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="top_k") as k:  # beyond the core's 32 bits
        client.completions.create(model=name, prompt="x", max_tokens=1, extra_body={"top_k": 2**31})
    assert k.value.code == "invalid_schema"
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )
    # text that is not Unicode (a lone surrogate: JSON's "\ud800" escape without its pair; the
    # openai client cannot send one), wherever it is, refused before a stream opens
    for body, said in [
        (
            '"messages": [{"role": "user", "content": "hi \\ud800"}]',
            "messages.0.content: a {} (\\ud800) at character 3",
        ),
        (
            '"messages": [{"role": "user", "content": "x"}], "stop": "\\udfff", "stream": true',
            "stop: a {} (\\udfff) at",
        ),
    ]:
        raw = httpx.post(
            server + "/v1/chat/completions",
            content=f'{{"model": "{name}", {body}}}'.encode(),
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        )
        assert raw.status_code == 400, raw.text
        error = raw.json()["error"]
        assert error["message"].startswith(said.format("lone UTF-16 surrogate")), error
        assert error["code"] == "invalid_schema"
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        bad.models.list()
    raw = httpx.post(
        server + "/v1/completions", json={"model": name}, headers={"authorization": f"Bearer {KEY}"}
    )  # schema-invalid (no prompt): 400 in OpenAI's shape (as OpenAI and vLLM), not FastAPI's 422
    assert raw.status_code == 400
    assert raw.json() == {
        "error": {
            "message": "prompt: Field required",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "invalid_schema",
        }
    }
    raw = httpx.post(
        server + "/v1/completions",
        content=b'{"model": "x", "prompt": ',
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )  # malformed JSON: 400
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "json_invalid"
    # the router's refusals and a detokenized id outside the vocabulary, in OpenAI's shape too
    auth = {"authorization": f"Bearer {KEY}"}
    for method, path, status, code in [
        ("GET", "/v1/nope", 404, "not_found"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("POST", "/detokenize", 400, None),
    ]:
        raw = httpx.request(method, server + path, json={"tokens": [2**70]}, headers=auth)
        assert raw.status_code == status and raw.json()["error"]["code"] == code, raw.text
    # the server still answers, and nothing leaked
    assert client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0).choices
    assert metric(server, "lloyal_running_sequences") == 0
    assert metric(server, "lloyal_queue_depth") == 0


# -- limits: request timeout, a full queue, shutdown ------------------------------------------
# A second server with tight limits: 2 completions at once, 1 request may wait, 2.5 s per request.


TIMEOUT = 2.5


@pytest.fixture(scope="module")
def tight(model_path: str) -> Iterator[tuple[str, Any]]:
    cfg = ServerConfig(
        model=model_path,
        n_ctx=N_CTX,
        parallel=2,
        max_queue=1,
        request_timeout=TIMEOUT,
        n_threads=2,
        # the default, fast kernels (the module's other server is batch-invariant: it compares tokens)
        prefill_chunk=16,
    )
    app = create_app(cfg)
    with serving(app) as url:
        yield url, app


def _endless(ref: lloyal.Context) -> dict[str, Any]:
    """A completion that runs until max_tokens: the end-of-generation token is banned."""
    return dict(
        prompt="Count: 1, 2,", max_tokens=N_CTX - 16, temperature=0, logit_bias={str(ref.eog_token): -100}
    )


def _sched(app: Any) -> Any:
    return app.state.lloyal["s"].scheduler


def _idle(app: Any) -> None:
    """Wait until nothing runs; every leased sequence is then a cached prefix (nothing leaked)."""
    sched = _sched(app)
    ctx = app.state.lloyal["s"].ctx
    deadline = time.monotonic() + 20

    def leased() -> int:
        return int(ctx.n_seq_max - sched.store.available)

    # A finished request leaves the scheduler's lists before its branches are pruned (a prune
    # waits for the engine's tick in progress), so this thread may look in between.
    while sched.running or sched.waiting or sched._requests or leased() != len(sched.cache):
        left = f"requests still run, or {leased()} leases for {len(sched.cache)} cached entries"
        assert time.monotonic() < deadline, left
        time.sleep(0.05)


def test_fast_kernels_by_default_and_prefill_chunk_options(
    tight: tuple[str, Any], name: str, monkeypatch: pytest.MonkeyPatch, model_path: Path
) -> None:
    url, app = tight
    state = app.state.lloyal["s"]
    assert state.model.repack and state.ctx.batch_invariant is False and state.ctx.type_k == "f16"
    assert state.ctx.engine_prefill_chunk == 16
    # the weights are read into memory, not mapped: they get huge pages (tests/test_model.py);
    # on a GPU run they are in the GPU's memory and the logits buffer in pinned host memory
    on_host_pages = THP and MODELS_ON_CPU and not GPU_BACKEND
    assert state.model.huge_page_bytes >= 0.85 * state.model.size or not on_host_pages
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    out = c.completions.create(model=name, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 4 and out.choices[0].text
    # Nothing it answers reads a branch's sampling perplexity, so its context does not keep it;
    # its logits buffer is on huge pages after the first decode (tests/test_context.py).
    assert state.ctx.sampling_perplexity is False
    assert state.ctx.huge_page_bytes > 0 or not (THP_COLLAPSE and MODELS_ON_CPU)
    _idle(app)
    # `lloyal serve` asks for the fast kernels unless told `--batch-invariant`.
    from lloyal import cli

    seen: list[ServerConfig] = []
    monkeypatch.setattr("lloyal.server.serve", lambda cfg, **kw: seen.append(cfg))
    assert cli.main(["--model", str(model_path), "serve", "--batch-invariant", "--prefill-chunk", "0"]) == 0
    assert seen[0].batch_invariant and seen[0].prefill_chunk == 0 and seen[0].n_gpu_layers is None
    assert not seen[0].use_mmap
    assert cli.main(["--model", str(model_path), "serve", "--prefill-chunk", "paced", "-ngl", "99"]) == 0
    assert not seen[1].batch_invariant and seen[1].prefill_chunk is None and seen[1].n_gpu_layers == 99
    assert cli.main(["--model", str(model_path), "serve", "--mmap"]) == 0 and seen[2].use_mmap
    assert seen[0].warmup and cli.main(["--model", str(model_path), "serve", "--no-warmup"]) == 0
    assert not seen[3].warmup
    # Batch invariance and GPU layers together: the state refuses with the context's reason.
    refused = "batch_invariant=True is not possible here: the model was loaded with n_gpu"
    with pytest.raises(ValueError, match=refused):
        ServerState(ServerConfig(model=model_path, n_ctx=256, batch_invariant=True, n_gpu_layers=99))
    with pytest.raises(SystemExit):
        cli.main(["--model", str(model_path), "serve", "--prefill-chunk", "-3"])


@pytest.mark.parametrize("warmup", [True, False])
def test_the_server_decodes_a_token_at_startup_and_keeps_nothing_of_it(
    model_path: Path, warmup: bool
) -> None:
    """As llama-server warms up (``--no-warmup`` to skip): a token decoded before the first
    request pays the backend's first-use costs, and leaves no lease, cell or cached prefix."""
    state = ServerState(ServerConfig(model=model_path, n_ctx=256, parallel=2, n_threads=2, warmup=warmup))
    try:
        stats, store = state.ctx.engine_stats(), state.scheduler.store
        assert stats.decode_calls == stats.rows == (1 if warmup else 0)
        # a commit, not a prompt: the first request's prompt still waits for a burst's company
        assert stats.burst_waits == 0
        assert store.available == state.ctx.n_seq_max and store.kv_pressure.cells_used == 0
        assert len(state.scheduler.cache) == 0 and state.scheduler.steps == 0
    finally:
        state.close()


def test_request_timeout_is_408_and_frees_the_branches(
    tight: tuple[str, Any], name: str, ref: lloyal.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, app = tight
    # On a GPU the endless request's ~1,000 tokens take about a second: a shorter limit there.
    limit = TIMEOUT if MODELS_ON_CPU else 0.3
    monkeypatch.setattr(app.state.lloyal["s"].cfg, "request_timeout", limit)
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model=name, **_endless(ref))
    assert limit <= time.monotonic() - t0 < limit + 5
    assert e.value.status_code == 408
    assert e.value.body == {
        "message": f"the request did not finish within the server's timeout of {limit:g} s "
        "(--request-timeout) and was cancelled: lower max_tokens or n, or retry later",
        "type": "timeout_error",
        "param": None,
        "code": "request_timeout",
    }
    _idle(app)
    # streamed: the tokens so far, then an error event (the status was sent with the first chunk)
    texts: list[str] = []
    with pytest.raises(openai.APIError) as s:
        for chunk in c.completions.create(model=name, stream=True, **_endless(ref)):
            texts.append(chunk.choices[0].text)
    assert s.value.body["code"] == "request_timeout"
    assert len(texts) > 5
    _idle(app)
    # the server goes on serving
    r = c.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_a_full_queue_is_429_with_retry_after(tight: tuple[str, Any], name: str, ref: lloyal.Context) -> None:
    url, app = tight
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    running = c.completions.create(model=name, n=2, stream=True, **_endless(ref))  # both slots
    next(iter(running))
    queued: list[Any] = []

    def second() -> None:
        queued.append(c.completions.create(model=name, prompt="x", max_tokens=2, temperature=0))

    t = threading.Thread(target=second)
    t.start()
    deadline = time.monotonic() + 10
    while _sched(app).waiting != 1:
        assert time.monotonic() < deadline, "the second request did not queue"
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as e:  # the queue holds max_queue=1 already
        c.completions.create(model=name, prompt="y", max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1"
    assert e.value.code == "queue_full" and e.value.type == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):  # streamed: refused with the status, not in the stream
        c.completions.create(model=name, prompt="y", max_tokens=2, stream=True)
    running.close()  # frees both slots: the queued request runs
    t.join(30)
    assert queued[0].usage.completion_tokens == 2
    _idle(app)


def test_shutdown_answers_503_and_cancels_after_the_grace(
    tight: tuple[str, Any], name: str, ref: lloyal.Context
) -> None:
    """Last in this module: the tight server stays closed."""
    url, app = tight
    # closed at the end: its pool holds the cancelled stream's connection
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        stream = iter(c.completions.create(model=name, stream=True, **{**_endless(ref), "max_tokens": 400}))
        next(stream)
        drained = begin_shutdown(app, grace=0.5)
        deadline = time.monotonic() + 5
        while not _sched(app).closing:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=name, prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "shutting_down"
        assert httpx.get(url + "/health").status_code == 503
        with pytest.raises(openai.APIError) as s:  # the running stream is cancelled at the end of the grace
            for _ in stream:
                pass
        assert s.value.body["code"] == "shutting_down"
        assert drained.result(10) == 1
        _idle(app)
