"""How `lloyal serve` renders a chat prompt: vLLM's ``chat_template_kwargs`` (llama-server's too),
``add_generation_prompt`` and ``continue_final_message``, through the official `openai` client.

The server runs the tiny generated Qwen 3 GGUF (tests/gguf_families), whose template reads
``enable_thinking``; prompts are compared with the library's own rendering, and greedy outputs
token for token (both contexts batch-invariant).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gguf_families.generate import family_path
from helpers import greedy_completion, serving

import lloyal

openai = pytest.importorskip("openai", reason="the server extra: pip install 'lloyal[server]'")
pytest.importorskip("uvicorn")

from lloyal.server import ServerConfig, create_app  # noqa: E402

N_CTX = 256
NAME = "qwen3"
ASK = [{"role": "user", "content": "hi"}]
OPEN = [*ASK, {"role": "assistant", "content": "Hello, my"}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    cfg = ServerConfig(model=family_path(NAME), n_ctx=N_CTX, parallel=2, n_threads=2, batch_invariant=True)
    with serving(create_app(cfg)) as url:
        yield url


@pytest.fixture(scope="module")
def ref() -> Iterator[lloyal.Context]:
    model = lloyal.Model(family_path(NAME), repack=False, n_gpu_layers=0)  # invariant on a GPU run too
    with lloyal.Context(model, n_ctx=N_CTX, n_threads=2, batch_invariant=True) as ctx:
        yield ctx


def prompt_tokens(ref: lloyal.Context, text: str) -> list[int]:
    return ref.tokenize(text, add_special=False, parse_special=True)


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, extra_body=extra
    )


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, ref: lloyal.Context) -> None:
    plain = ask(client, ASK)
    quiet = ask(client, ASK, chat_template_kwargs={"enable_thinking": False})
    want = ref.format_chat(ASK, enable_thinking=False).prompt
    assert want.endswith("<think>\n\n</think>\n\n")  # what Qwen 3's template adds for it
    assert quiet.usage.prompt_tokens == len(prompt_tokens(ref, want))
    assert plain.usage.prompt_tokens == len(prompt_tokens(ref, ref.format_chat(ASK).prompt))
    assert quiet.usage.prompt_tokens > plain.usage.prompt_tokens


def test_continue_final_message_goes_on_from_its_text(client: openai.OpenAI, ref: lloyal.Context) -> None:
    r = ask(client, OPEN, continue_final_message=True, add_generation_prompt=False)
    rendered = ref.format_chat(OPEN, add_generation_prompt=False).prompt
    prompt = prompt_tokens(ref, rendered[: rendered.rfind("Hello, my") + len("Hello, my")])
    assert ref.detokenize(prompt).endswith("Hello, my")
    assert r.usage.prompt_tokens == len(prompt)
    fc = ref.format_chat(OPEN)
    assert r.choices[0].message.content == ref.detokenize(greedy_completion(ref, prompt, 6, fc.stop_tokens))


def test_continue_final_message_cuts_after_the_stripped_text(client: openai.OpenAI) -> None:
    """As transformers (vLLM) cut it: after the message's text stripped, its last text part
    when it has parts; a trailing space does not change the prompt."""
    want = ask(client, OPEN, continue_final_message=True, add_generation_prompt=False)
    spaced = [*ASK, {"role": "assistant", "content": "Hello, my "}]
    parts = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Hello, my"}]}]
    for messages in (spaced, parts):
        r = ask(client, messages, continue_final_message=True, add_generation_prompt=False)
        assert (r.usage.prompt_tokens, r.choices[0].message.content) == (
            want.usage.prompt_tokens,
            want.choices[0].message.content,
        )


def test_text_parts_reach_a_string_content_template_as_one_text(
    client: openai.OpenAI, ref: lloyal.Context
) -> None:
    """Qwen 3's template reads content as a string (a list renders as nothing): text parts are
    joined by newlines first, as vLLM gives such a template ("hi" and "there" were lost)."""
    joined = [{"role": "user", "content": "hi\nthere"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    r = ask(client, parts)
    assert r.usage.prompt_tokens == len(prompt_tokens(ref, ref.format_chat(joined).prompt))
    assert r.choices[0].message.content == ask(client, joined).choices[0].message.content


def test_a_completion_prompt_reads_special_tokens_as_tokens(server: str, ref: lloyal.Context) -> None:
    """A prompt a client rendered with the chat template itself: its markers are the special
    tokens, as llama-server and vLLM read them (they were split into plain-text pieces)."""
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    r = httpx.post(
        server + "/v1/completions", json={"model": NAME, "prompt": text, "max_tokens": 1}, timeout=60
    )
    want = ref.tokenize(text, add_special=True, parse_special=True)
    assert len(want) < len(ref.tokenize(text, add_special=True))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)


def test_message_fields_as_templates_read_them(ref: lloyal.Context) -> None:
    """A turn that only calls tools keeps ``content: null`` (templates test ``is none``), a call
    with empty arguments has ``{}``, and which templates read content as parts."""
    from lloyal.server.translate import content_as_parts, message_dict

    call = {"type": "function", "function": {"name": "f", "arguments": ""}}
    m = message_dict({"role": "assistant", "tool_calls": [call]})
    assert m["content"] is None and m["tool_calls"][0]["function"]["arguments"] == {}
    assert message_dict({"role": "developer", "content": "Be brief."})["role"] == "system"
    template = (
        "{% for m in messages %}{% if m.content is none %}[calls]{% else %}{{ m.content }}{% endif %}"
        "{% endfor %}"
    )
    assert ref.format_chat([{"role": "user", "content": "hi"}, m], template=template).prompt == "hi[calls]"
    assert not content_as_parts(ref.model.chat_template) and not content_as_parts(None)
    assert content_as_parts("{% for part in message['content'] %}{{ part.text }}{% endfor %}")
    assert content_as_parts("{%- for item in m.content -%}")


def test_add_generation_prompt_false_renders_no_assistant_turn(
    client: openai.OpenAI, ref: lloyal.Context
) -> None:
    r = ask(client, OPEN, add_generation_prompt=False)
    rendered = ref.format_chat(OPEN, add_generation_prompt=False).prompt
    assert rendered.endswith("<|im_end|>\n")
    assert r.usage.prompt_tokens == len(prompt_tokens(ref, rendered))


@pytest.mark.parametrize(
    ("fields", "messages", "param", "message"),
    [
        ({"continue_final_message": True}, OPEN, "continue_final_message", "add_generation_prompt to false"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            [*ASK, {"role": "assistant", "content": ""}],
            "continue_final_message",
            "last message with text",
        ),
        ({"chat_template_kwargs": {"tools": []}}, ASK, "chat_template_kwargs", "'tools'"),
        (
            {"chat_template_kwargs": {"add_generation_prompt": False}},
            ASK,
            "chat_template_kwargs",
            "cannot set",
        ),
    ],
)
def test_a_bad_prompt_field_is_a_400_naming_it(
    server: str, fields: dict[str, Any], messages: list[dict[str, Any]], param: str, message: str
) -> None:
    r = httpx.post(
        server + "/v1/chat/completions",
        json={"model": NAME, "messages": messages, "max_tokens": 2} | fields,
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
