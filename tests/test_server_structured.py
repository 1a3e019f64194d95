"""Structured output on `lloyal serve`, through the official `openai` client over loopback, on
the real model: forced tool calls (``tool_choice`` ``"required"`` or a named function), vLLM's and
llama-server's output constraints (``guided_*``, ``structured_outputs``, ``json_schema``) and their
sampling extensions (``ignore_eos``, ``stop_token_ids``).

Outputs are generated under llguidance grammars; greedy ones are compared token for token with
the library's own greedy run under the same grammar (both contexts batch-invariant).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest
from helpers import SERVER_KEY as KEY
from helpers import greedy_completion

import lloyal

openai = pytest.importorskip("openai", reason="the server extra: pip install 'lloyal[server]'")
pytest.importorskip("uvicorn")

from lloyal.server.constraints import choice_regex  # noqa: E402
from lloyal.server.protocol import ChatRequest  # noqa: E402
from lloyal.server.tools import tool_choice  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
SCHEMAS = {
    "get_weather": WEATHER,
    "get_time": {"type": "object", "properties": {}, "additionalProperties": False},
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def library_call(ref: lloyal.Context, schema: dict[str, Any], max_tokens: int = 64) -> str:
    """The library's greedy output for ``MESSAGES`` (tools shown) under ``schema``."""
    fc = ref.format_chat(MESSAGES, tools=TOOLS)
    prompt = ref.tokenize(fc.prompt, add_special=False, parse_special=True)
    grammar = lloyal.Grammar.from_json_schema(ref, schema)
    return ref.detokenize(greedy_completion(ref, prompt, max_tokens, fc.stop_tokens, grammar))


def running(server: str) -> float:
    text = httpx.get(server + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    line = next(x for x in text.splitlines() if x.startswith("lloyal_running_sequences "))
    return float(line.split()[1])


def test_a_named_function_is_called_with_arguments_under_its_schema(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    r = client.chat.completions.create(
        model=name, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a forced function
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert call.function.arguments == library_call(ref, WEATHER)


def test_a_function_without_parameters_is_called_with_an_empty_object(
    client: openai.OpenAI, name: str
) -> None:
    r = client.chat.completions.create(
        model=name,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=16,
        temperature=0,
    )
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {})


def test_a_named_call_streams_its_id_and_name_then_its_arguments(client: openai.OpenAI, name: str) -> None:
    whole = client.chat.completions.create(
        model=name, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=name,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=NAMED,
            max_tokens=64,
            temperature=0,
            stream=True,
        )
    )
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is None
    assert first.tool_calls[0].id.startswith("call_") and first.tool_calls[0].function.name == "get_weather"
    pieces = [
        c.choices[0].delta.tool_calls for c in chunks[1:] if c.choices and c.choices[0].delta.tool_calls
    ]
    assert len(pieces) > 3 and all(p[0].index == 0 and p[0].id is None for p in pieces)
    assert (
        "".join(p[0].function.arguments for p in pieces)
        == whole.choices[0].message.tool_calls[0].function.arguments
    )
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_calls_one_or_more_offered_tools(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    r = client.chat.completions.create(
        model=name, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls
    for fn, args in calls:
        jsonschema.validate(args, SCHEMAS[fn])
    schema = tool_choice(ChatRequest(messages=MESSAGES, tools=TOOLS, tool_choice="required")).schema
    assert schema is not None
    want = json.loads(library_call(ref, schema, 96))
    assert calls == [(c["name"], c["parameters"]) for c in want]
    assert len({c.id for c in choice.message.tool_calls}) == len(calls)


# What Pydantic's model_json_schema() gives: definitions in $defs, referred to from the root.
PYDANTIC_WEATHER = {
    "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}, "Place": {"type": "string", "maxLength": 12}},
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"],
}


def test_required_calls_of_tools_whose_parameters_refer_to_their_own_defs(
    client: openai.OpenAI, name: str
) -> None:
    """Inside the ``"required"`` array a tool's parameters are no longer the root, so its
    ``#/$defs/...`` references are moved with its definitions (the request was a 400: "Pointer
    '/$defs/Unit' does not exist"); a second tool's definitions of the same names stay apart."""
    other = {
        "$defs": {"Unit": {"enum": ["utc", "local"]}},
        "type": "object",
        "properties": {"zone": {"$ref": "#/$defs/Unit"}},
        "required": ["zone"],
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": PYDANTIC_WEATHER}},
        {"type": "function", "function": {"name": "get_time", "parameters": other}},
    ]
    r = client.chat.completions.create(
        model=name,
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,  # this model would call get_time until the budget ran out
        max_tokens=96,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1
    params = {"get_weather": PYDANTIC_WEATHER, "get_time": other}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    schema = tool_choice(ChatRequest(messages=MESSAGES, tools=tools, tool_choice="required")).schema
    assert schema is not None and set(schema["$defs"]) == {
        "get_weather",
        "get_weather.Unit",
        "get_weather.Place",
        "get_time",
        "get_time.Unit",
    }
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "utc"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"zone": "celsius"}}], schema)


def test_required_without_parallel_calls_makes_exactly_one(client: openai.OpenAI, name: str) -> None:
    r = client.chat.completions.create(
        model=name,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=1.0,
        seed=11,
        n=3,
    )
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_streamed_required_reply_sends_each_call_as_it_is_written(client: openai.OpenAI, name: str) -> None:
    request: dict[str, Any] = dict(
        model=name,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=96,
        temperature=0,
        logprobs=True,
    )
    whole = client.chat.completions.create(**request)
    calls = whole.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **request))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content is None
    streamed = [t for d in deltas for t in d.tool_calls or []]
    heads = [t for t in streamed if t.id is not None]
    assert [(t.index, t.function.name) for t in heads] == [(i, t.function.name) for i, t in enumerate(calls)]
    assert all(t.id.startswith("call_") and t.type == "function" for t in heads)
    for i, call in enumerate(calls):
        assert "".join(t.function.arguments for t in streamed if t.index == i) == call.function.arguments
    assert len(streamed) > len(calls) + 3  # the arguments come in pieces, not whole at the end
    assert not any(d.content for d in deltas)
    logprobs = [
        lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content
    ]
    assert len(logprobs) == whole.usage.completion_tokens
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_forced_call_cut_by_max_tokens_ends_with_length(client: openai.OpenAI, name: str) -> None:
    full = client.chat.completions.create(
        model=name, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64, temperature=0
    )
    cut = client.chat.completions.create(
        model=name, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=3, temperature=0
    )
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    partial = cut.choices[0].message.tool_calls[0].function.arguments
    assert full.choices[0].message.tool_calls[0].function.arguments.startswith(partial) and partial
    required = client.chat.completions.create(
        model=name, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=3, temperature=0
    )
    assert required.choices[0].finish_reason == "length" and not required.choices[0].message.tool_calls
    assert required.choices[0].message.content  # the cut JSON, as text


def test_a_required_reply_cut_in_its_arguments_answers_the_calls_its_stream_sent(
    client: openai.OpenAI, name: str
) -> None:
    """Cut by ``max_tokens`` after a call's name: the unstreamed reply holds the calls named so
    far, the last one's arguments partial, as the streamed one sent them (``length`` both)."""
    request: dict[str, Any] = dict(
        model=name, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0
    )
    whole = client.chat.completions.create(max_tokens=96, **request)
    full = whole.choices[0].message.tool_calls
    cut = client.chat.completions.create(max_tokens=whole.usage.completion_tokens - 3, **request)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None
    calls = cut.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == [c.function.name for c in full][: len(calls)] and calls
    last = calls[-1].function.arguments
    assert (
        full[len(calls) - 1].function.arguments.startswith(last)
        and last != full[len(calls) - 1].function.arguments
    )
    chunks = list(
        client.chat.completions.create(stream=True, max_tokens=whole.usage.completion_tokens - 3, **request)
    )
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    for i, call in enumerate(calls):
        assert "".join(t.function.arguments for t in streamed if t.index == i) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "function"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools", "tools[0]"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),  # malformed whatever the choice
        ({"tools": [*TOOLS, {"name": "f"}], "tool_choice": "none"}, "tools", f"tools[{len(TOOLS)}]"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
                "tool_choice": "required",
            },
            "tools",
            "parameters",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools",
            "schema",
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "grammar": 'root ::= "x"'}, "tool_choice", "grammar"),
    ],
)
def test_a_bad_tool_choice_is_a_400_naming_the_field(
    server: str, name: str, fields: dict[str, Any], param: str, message: str
) -> None:
    for stream in (False, True):
        r = httpx.post(
            server + "/v1/chat/completions",
            json={"model": name, "messages": MESSAGES, "max_tokens": 4, "stream": stream} | fields,
            headers={"authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (
            err["type"] == "invalid_request_error" and err["param"] == param and message in err["message"]
        ), err
    assert running(server) == 0


# -- vLLM's and llama-server's output constraints ---------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHOICES = ["red", "green (light)", "blue"]
YES_NO = 'root ::= ("yes" | "no") " " [0-9]'
# PERSON as a schema would often be written: nothing said of other keys, a oneOf whose branches
# overlap, a format and a keyword llguidance does not implement (llama.cpp's converter reads it
# as PERSON: closed, oneOf as anyOf, the rest ignored)
LOOSE_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10, "format": "password"},
        "age": {
            "oneOf": [{"type": "integer", "maximum": 120}, {"type": "integer", "minimum": 0, "maximum": 99}]
        },
    },
    "required": ["name", "age"],
    "uniqueItems": True,
}


def _check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def _check_choice(text: str) -> None:
    assert text in CHOICES, text


def _check_yes_no(text: str) -> None:
    assert re.fullmatch(r"(yes|no) [0-9]", text), text


CONSTRAINTS = [
    ({"guided_json": PERSON}, _check_json),
    ({"guided_json": json.dumps(PERSON)}, _check_json),
    ({"json_schema": PERSON}, _check_json),
    ({"guided_choice": CHOICES}, _check_choice),
    ({"guided_regex": "(yes|no) [0-9]"}, _check_yes_no),
    ({"guided_grammar": YES_NO}, _check_yes_no),
    ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}, _check_json),
    ({"structured_outputs": {"choice": CHOICES}}, _check_choice),
    ({"structured_outputs": {"regex": "(yes|no) [0-9]"}}, _check_yes_no),
    ({"structured_outputs": {"grammar": YES_NO}}, _check_yes_no),
    ({"json_schema": LOOSE_PERSON}, _check_json),
    ({"response_format": {"type": "json_object", "schema": PERSON}}, _check_json),  # llama-server's
    ({"response_format": {"type": "json_schema", "schema": PERSON}}, _check_json),  # forms
    ({"guided_grammar": 'start: ("yes" | "no") " " /[0-9]/'}, _check_yes_no),  # Lark, as vLLM's guidance
]


@pytest.mark.parametrize(
    ("field", "check"), CONSTRAINTS, ids=lambda x: json.dumps(x)[:40] if isinstance(x, dict) else ""
)
def test_vllm_and_llama_server_constraints_hold_on_both_endpoints(
    client: openai.OpenAI, name: str, field: dict[str, Any], check: Any
) -> None:
    c = client.completions.create(
        model=name,
        prompt="A colour, an answer or a person:",
        max_tokens=40,
        temperature=1.0,
        seed=5,
        extra_body=field,
    )
    assert c.choices[0].finish_reason == "stop", c.choices[0].text
    check(c.choices[0].text)
    r = client.chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=5, extra_body=field
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    check(r.choices[0].message.content)


def test_a_structured_json_object_is_response_formats_json_object(client: openai.OpenAI, name: str) -> None:
    def answer(field: dict[str, Any]) -> str:
        r = client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=48, temperature=0, extra_body=field
        )
        return str(r.choices[0].message.content)

    text = answer({"structured_outputs": {"json_object": True}})
    assert text == answer({"response_format": {"type": "json_object"}}) and text.startswith("{")


def test_a_guided_choice_is_the_librarys_greedy_choice(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    prompt = "Pick a colour:"
    c = client.completions.create(
        model=name, prompt=prompt, max_tokens=16, temperature=0, extra_body={"guided_choice": CHOICES}
    )
    grammar = lloyal.Grammar.from_regex(ref, choice_regex(CHOICES))
    assert c.choices[0].text == ref.detokenize(greedy_completion(ref, ref.tokenize(prompt), 16, (), grammar))


@pytest.mark.parametrize("choices", [["a > b", "a < b"], ["<b>bold</b>", "-> x & y ~ z"]])
def test_a_guided_choice_may_hold_any_punctuation(
    client: openai.OpenAI, name: str, choices: list[str]
) -> None:
    """``<`` and ``>`` are taken as themselves (escaped, Rust's regex reads them as word
    boundaries), as are the characters its syntax does give a meaning."""
    c = client.completions.create(
        model=name, prompt="Pick one:", max_tokens=16, temperature=0, extra_body={"guided_choice": choices}
    )
    assert c.choices[0].text in choices


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"guided_json": PERSON, "response_format": {"type": "json_object"}}, "guided_json", "not both"),
        ({"grammar": YES_NO, "guided_regex": "x"}, "guided_regex", "not both"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json", "schema object"),
        ({"guided_choice": []}, "guided_choice", "non-empty strings"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
        ({"guided_regex": "("}, "guided_regex", "guided_regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "guided_grammar"),
        ({"grammar": "root ::= missing"}, "grammar", "missing"),  # the reason, not just "failed"
        ({"response_format": {"json_schema": {"schema": PERSON}}}, "response_format", "type is missing"),
        ({"json_schema": {"type": "nope"}}, "json_schema", "json_schema"),
        ({"structured_outputs": {"json": PERSON, "regex": "x"}}, "structured_outputs", "one of"),
        ({"structured_outputs": {}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
        ({"guided_choice": CHOICES, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
        ({"min_tokens": 5}, "min_tokens", "at most max_tokens"),
        ({"guided_choice": CHOICES, "min_tokens": 1}, "min_tokens", "output constraint"),
        ({"skip_special_tokens": False}, "skip_special_tokens", "not supported"),
        ({"tools": TOOLS, "tool_choice": NAMED, "guided_choice": CHOICES}, "tool_choice", "guided_choice"),
    ],
)
def test_a_bad_output_field_is_a_400_naming_it(
    server: str, name: str, fields: dict[str, Any], param: str, message: str
) -> None:
    chat = {"messages": MESSAGES}
    for route, body in (("chat/completions", chat), ("completions", {"prompt": "x"})):
        if "tools" in fields and route == "completions":
            continue
        for stream in (False, True):
            r = httpx.post(
                f"{server}/v1/{route}",
                json={"model": name, "max_tokens": 4, "stream": stream} | body | fields,
                headers={"authorization": f"Bearer {KEY}"},
                timeout=60,
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and message in err["message"], err
    assert running(server) == 0


def test_defaults_of_the_unimplemented_fields_are_accepted(client: openai.OpenAI, name: str) -> None:
    defaults = {
        "min_tokens": 0,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
    }
    c = client.completions.create(model=name, prompt="Hi", max_tokens=2, temperature=0, extra_body=defaults)
    assert c.usage.completion_tokens == 2


def test_ignore_eos_bans_every_end_of_generation_token(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    eog = [t for t in range(ref.n_vocab) if ref.is_stop_token(t)]
    assert len(eog) > 1  # Gemma's <eos> and <end_of_turn> at least
    favoured = {str(t): 100 for t in eog}  # an end-of-generation token would come first
    request: dict[str, Any] = dict(model=name, prompt="Once upon a time", max_tokens=12, temperature=0)
    short = client.completions.create(logit_bias=favoured, **request)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens == 0
    long = client.completions.create(logit_bias=favoured, extra_body={"ignore_eos": True}, **request)
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 12
    # the library's greedy run with every end-of-generation token banned
    greedy = lloyal.SamplingParams(temperature=0)
    with lloyal.Branch.create(ref, 0, greedy) as b:
        b.set_sampling(greedy, logit_bias=dict.fromkeys(eog, float("-inf")))
        b.prefill(ref.tokenize("Once upon a time"))
        want = []
        for _ in range(12):
            want.append(b.produce().token)
            b.commit(want[-1])
    assert long.choices[0].text == ref.detokenize(want)


def test_min_tokens_holds_off_the_end_of_generation_until_then(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    eog = [t for t in range(ref.n_vocab) if ref.is_stop_token(t)]
    favoured = {str(t): 100 for t in eog}  # an end-of-generation token would come first
    request: dict[str, Any] = dict(model=name, max_tokens=12, temperature=0, logit_bias=favoured)
    c = client.completions.create(prompt="Once upon a time", extra_body={"min_tokens": 3}, **request)
    assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == 3
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(messages=messages, extra_body={"min_tokens": 2}, **request)
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 2
    # the library's greedy run with every end-of-generation token banned for three tokens
    greedy = lloyal.SamplingParams(temperature=0)
    with lloyal.Branch.create(ref, 0, greedy) as b:
        b.set_sampling(greedy, logit_bias={t: 100.0 for t in eog})
        b.prefill(ref.tokenize("Once upon a time"))
        want = [t.token for t in b.generate(12, min_tokens=3)]
    assert c.choices[0].text == ref.detokenize(want)


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    prompt = "The colours of the rainbow are"
    text = ref.detokenize(greedy_completion(ref, ref.tokenize(prompt), 12))
    stop = text[8:11]
    cut = text.index(stop)
    for include, want in ((True, text[: cut + len(stop)]), (False, text[:cut])):
        request: dict[str, Any] = dict(model=name, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
        extra = {"include_stop_str_in_output": include}
        c = client.completions.create(extra_body=extra, **request)
        assert c.choices[0].text == want and c.choices[0].finish_reason == "stop"
        chunks = client.completions.create(stream=True, extra_body=extra, **request)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want


def test_stop_token_ids_end_the_completion_before_that_token(
    client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    prompt = "The colours of the rainbow are"
    tokens = greedy_completion(ref, ref.tokenize(prompt), 12)
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    c = client.completions.create(
        model=name, prompt=prompt, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [stop_at]}
    )
    assert c.choices[0].finish_reason == "stop"
    assert c.choices[0].text == ref.detokenize(tokens[:first]) and c.usage.completion_tokens == first
