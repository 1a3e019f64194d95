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
