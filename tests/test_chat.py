"""Chat templates on the real model: format_chat, format_chat_turn (warm multi-turn), parse_chat_output."""

from __future__ import annotations

import doctest

import pytest

import lloyal
import lloyal.chat

END_OF_TURN = 106  # <end_of_turn> on Gemma 3
START_OF_TURN = 105

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# One-shot history: the default model is the *base* Gemma 3 270M, which answers a bare
# question by repeating it; with one example turn it answers.
ONE_SHOT = [
    {"role": "user", "content": "What is the capital of Germany?"},
    {"role": "assistant", "content": "Berlin."},
]


def encode(ctx: lloyal.Context, prompt: str) -> list[int]:
    return ctx.tokenize(prompt, add_special=False, parse_special=True)


def greedy(ctx: lloyal.Context, tokens: list[int], n: int) -> list[int]:
    with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)) as b:
        b.prefill(tokens)
        out = [t.token for t in b.generate(n)]
    return out


@pytest.mark.gemma
def test_user_message_uses_gemma_markers(ctx: lloyal.Context) -> None:
    chat = ctx.format_chat([{"role": "user", "content": "What is 2+2?"}])
    assert chat.prompt == "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    assert chat.template_source == "builtin:gemma"
    assert chat.stop_tokens[0] == END_OF_TURN
    assert all(ctx.is_stop_token(t) for t in chat.stop_tokens)
    tokens = encode(ctx, chat.prompt)
    assert tokens[:3] == [ctx.bos_token, START_OF_TURN, ctx.tokenize("user", add_special=False)[0]]
    assert tokens.count(ctx.bos_token) == 1
    assert tokens[-3:] == [START_OF_TURN, *ctx.tokenize("model\n", add_special=False)]
    no_gen = ctx.format_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_gen.prompt.endswith("Hi<end_of_turn>\n")
    assert "<start_of_turn>model" not in no_gen.prompt


@pytest.mark.gemma
def test_system_message_is_folded_into_first_user_turn(ctx: lloyal.Context) -> None:
    chat = ctx.format_chat(
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
        ]
    )
    assert chat.prompt == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    assert "system" not in chat.prompt


@pytest.mark.gemma
def test_template_override_is_honoured(ctx: lloyal.Context) -> None:
    chat = ctx.format_chat([{"role": "user", "content": "Hi"}], template=CHATML)
    assert chat.prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert chat.template_source == "override"
    hf = "{{ bos_token }}{% for m in messages %}{{ m['content'].strip().upper() }}{% endfor %}"
    assert ctx.format_chat([{"role": "user", "content": "  hi  "}], template=hf).prompt == "<bos>HI"


@pytest.mark.gemma
def test_raise_exception_is_chat_template_error(ctx: lloyal.Context) -> None:
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(lloyal.ChatTemplateError, match="roles must alternate"):
        ctx.format_chat([{"role": "user", "content": "x"}], template=template)
    with pytest.raises(lloyal.ChatTemplateError):
        ctx.format_chat([{"role": "user", "content": "x"}], template="{% for %}")
    with pytest.raises(lloyal.ChatTemplateError, match="no 'system' role"):
        ctx.format_chat([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


@pytest.mark.gemma
def test_tools_reach_the_template(ctx: lloyal.Context) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "str"}}}]
    chat = ctx.format_chat([{"role": "user", "content": "x"}], template="{{ tools|tojson }}", tools=tools)
    assert chat.prompt == (
        '[{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "str"}}}]'
    )
    builtin = ctx.format_chat([{"role": "user", "content": "Weather in Paris?"}], tools=tools)
    assert '"name": "get_weather"' in builtin.prompt
    assert "<tool_call>" in builtin.prompt


@pytest.mark.gemma
def test_assistant_tool_calls_round_trip(ctx: lloyal.Context) -> None:
    call = lloyal.ToolCall("get_weather", {"city": "Paris"})
    chat = ctx.format_chat(
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call.to_message_dict()]},
            {"role": "tool", "content": "sunny"},
        ]
    )
    model_turn = chat.prompt.split("<start_of_turn>model\n")[1].split("<end_of_turn>")[0]
    assert lloyal.parse_chat_output(model_turn).tool_calls == (call,)
    assert "<tool_response>\nsunny\n</tool_response>" in chat.prompt


def test_bad_message_shapes(ctx: lloyal.Context) -> None:
    with pytest.raises(TypeError, match="messages must be a list"):
        ctx.format_chat({"role": "user", "content": "x"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"messages\[0\] must be a dict"):
        ctx.format_chat(["hello"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="JSON-serialisable"):
        ctx.format_chat([{"role": "user", "content": object()}])
    with pytest.raises(ValueError, match="missing 'role'"):
        ctx.format_chat([{"content": "x"}])
    with pytest.raises(ValueError, match="'content' must be"):
        ctx.format_chat([{"role": "user", "content": 3}])
    with pytest.raises(TypeError, match="tools must be a list"):
        ctx.format_chat([{"role": "user", "content": "x"}], tools="f")  # type: ignore[arg-type]


def test_closed_context_raises(model: lloyal.Model) -> None:
    c = lloyal.Context(model, n_ctx=256)
    c.close()
    with pytest.raises(lloyal.ContextClosedError):
        c.format_chat([{"role": "user", "content": "x"}])


def test_parse_hermes_llama3_and_reasoning() -> None:
    hermes = lloyal.parse_chat_output(
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><end_of_turn>'
    )
    assert hermes.content == "Checking."
    assert hermes.tool_calls == (
        lloyal.ToolCall("get_weather", {"city": "Paris"}),
        lloyal.ToolCall("get_time", {}),
    )
    llama = lloyal.parse_chat_output(
        '<|python_tag|>{"name": "search", "parameters": {"q": "rust"}}<|eom_id|>'
    )
    assert llama == lloyal.ChatOutput("", None, (lloyal.ToolCall("search", {"q": "rust"}),))
    think = lloyal.parse_chat_output("<think>\n6*7=42\n</think>\nThe answer is 42.<|im_end|>")
    assert (think.reasoning_content, think.content, think.tool_calls) == ("6*7=42", "The answer is 42.", ())
    broken = '<tool_call>{"name": "f", "arguments": {</tool_call>'
    assert lloyal.parse_chat_output(broken) == lloyal.ChatOutput(broken)


@pytest.mark.gemma
def test_greedy_answer_contains_paris(ctx: lloyal.Context) -> None:
    chat = ctx.format_chat([*ONE_SHOT, {"role": "user", "content": "What is the capital of France?"}])
    tokens = greedy(ctx, encode(ctx, chat.prompt), 40)
    text = ctx.detokenize(tokens)
    assert "Paris" in text
    assert len(tokens) <= 40
    # generate() stops on exactly the stop tokens format_chat reports (EOG tokens).
    assert all(ctx.is_stop_token(t) for t in chat.stop_tokens)
    assert not any(t in chat.stop_tokens for t in tokens)


@pytest.mark.gemma
def test_warm_continuation_equals_cold_prefill(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=1024, n_seq_max=2) as ctx:
        history = [*ONE_SHOT, {"role": "user", "content": "What is the capital of France?"}]
        first = encode(ctx, ctx.format_chat(history).prompt)
        follow_up = {"role": "user", "content": "And of Italy?"}
        params = lloyal.SamplingParams(temperature=0)
        with lloyal.Branch.create(ctx, 0, params) as warm:
            warm.prefill(first)
            answer = [t.token for t in warm.generate(2)]  # "Paris."
            answer_text = ctx.detokenize(answer)
            assert answer_text == "Paris."
            turn = ctx.format_chat_turn(follow_up)
            assert turn.prompt == "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n"
            delta = ctx.turn_separator + encode(ctx, turn.prompt)
            full_chat = ctx.format_chat([*history, {"role": "assistant", "content": answer_text}, follow_up])
            full = encode(ctx, full_chat.prompt)
            assert full == first + answer + delta  # token for token
            warm.prefill(delta)
            assert warm.position == len(full)
            warm_tokens = [t.token for t in warm.generate(5)]
        cold_tokens = greedy(ctx, full, 5)
        assert warm_tokens == cold_tokens
        assert "Rome" in ctx.detokenize(warm_tokens)


@pytest.mark.gemma
def test_chat_module_doctests() -> None:
    result = doctest.testmod(lloyal.chat)
    assert result.attempted > 0
    assert result.failed == 0


def test_template_kwargs_reach_the_template(ctx: lloyal.Context) -> None:
    template = (
        "{{ bos_token }}{% if enable_thinking %}<think on>{% endif %}[{{ date_string }}]"
        "{% for d in documents %}({{ d.title }}){% endfor %}{{ custom.x }}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    msgs = [{"role": "user", "content": "Hi"}]
    chat = ctx.format_chat(
        msgs, template=template, enable_thinking=True, date_string="26 Jul 2024",
        documents=[{"title": "A"}, {"title": "B"}], custom={"x": 7},
    )  # fmt: skip
    assert chat.prompt == "<bos><think on>[26 Jul 2024](A)(B)7user: Hi\n"
    bare = ctx.format_chat(msgs, template=template, documents=[], custom={"x": 0})
    assert bare.prompt == "<bos>[]0user: Hi\n"
    with pytest.raises(ValueError, match="'bos_token' is set by format_chat itself"):
        ctx.format_chat(msgs, template=template, bos_token="<s>")
    with pytest.raises(TypeError, match="template variables must be JSON-serialisable"):
        ctx.format_chat(msgs, template=template, documents=object())


def test_generation_block_renders_as_a_plain_block(ctx: lloyal.Context) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>"
        "{% endgeneration %}{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}"
    )
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert ctx.format_chat(msgs, template=template).prompt == "<u>Hi</u><a>Hello</a>"


def test_format_chat_turn_uses_the_conversation_template(ctx: lloyal.Context) -> None:
    """A template given to format_chat_turn (as a model's own one would be) renders the turn:
    here Gemma's own GGUF template, which trims content where the built-in one does not."""
    gemma_own = (
        "{{ bos_token }}{% for m in messages %}"
        "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    follow_up = {"role": "user", "content": "  And of Italy?  "}
    turn = ctx.format_chat_turn(follow_up, template=gemma_own)
    assert turn.template_source == "override"
    assert turn.prompt == "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n"
    full = ctx.format_chat([*history, follow_up], template=gemma_own).prompt
    before = ctx.format_chat(history, template=gemma_own, add_generation_prompt=False).prompt
    assert full == before + turn.prompt  # the turn splices on after the closed assistant turn
    # Without a template this model (no GGUF template) uses the built-in one, content verbatim.
    assert ctx.format_chat_turn(follow_up).template_source == "builtin:gemma"
    assert "  And of Italy?  " in ctx.format_chat_turn(follow_up).prompt
    rewrites = (
        "{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}<end_of_turn>\n{% endfor %}"
    )
    with pytest.raises(lloyal.ChatTemplateError, match="plain continuation"):
        ctx.format_chat_turn(follow_up, template=rewrites)
