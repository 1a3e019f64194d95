"""A real `lloyal serve` process on loopback, driven by the official `openai` client.

The process is started the way a user starts it (the CLI, small n_ctx, the default model) and
stopped with SIGTERM while a stream is in flight: the stream completes, new connections are
refused, and the process exits with status 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import free_port, greedy_completion, stream_with_usage

import lloyal

openai = pytest.importorskip("openai", reason="the server extra: pip install 'lloyal[server]'")
pytest.importorskip("uvicorn")

N_CTX = 1024
GRACE = 300  # seconds: long enough for the stream in flight on a loaded 2-core machine


@pytest.fixture(scope="module")
def proc(
    model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    cmd = [sys.executable, "-m", "lloyal.cli", "--model", str(model_path), "serve", "--port", str(port)]
    cmd += ["--n-ctx", str(N_CTX), "--parallel", "4", "-t", "2", "--shutdown-grace", str(GRACE)]
    cmd += ["--batch-invariant"]  # the tests compare its tokens with a context of their own
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    out = log.open("wb")
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert p.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    yield url, p
    if p.poll() is None:
        p.kill()
    p.wait(10)
    out.close()


@pytest.fixture(scope="module")
def client(proc: tuple[str, subprocess.Popen[bytes]]) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def test_completion(client: openai.OpenAI, name: str, ref: lloyal.Context) -> None:
    prompt = "The capital of France is"
    want = ref.detokenize(greedy_completion(ref, ref.tokenize(prompt), 8))
    r = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.tokenize(prompt)), 8)


def test_chat_streaming(client: openai.OpenAI, name: str, ref: lloyal.Context) -> None:
    msgs = [{"role": "user", "content": "Name one colour."}]
    fc = ref.format_chat(msgs)
    prompt = ref.tokenize(fc.prompt, add_special=False, parse_special=True)
    want = greedy_completion(ref, prompt, 12, fc.stop_tokens)
    request = {"model": name, "messages": msgs, "max_tokens": 12, "temperature": 0}
    chunks = list(stream_with_usage(client.chat.completions.create, **request))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.detokenize(want)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(want)


def test_sigterm_finishes_the_stream_in_flight_then_exits_0(
    proc: tuple[str, subprocess.Popen[bytes]], client: openai.OpenAI, name: str, ref: lloyal.Context
) -> None:
    """Last in this module: it stops the server."""
    url, p = proc
    max_tokens = 200  # ~1-2 s on an idle machine: still running when the refusal is seen
    stream = stream_with_usage(
        client.completions.create,
        model=name,
        prompt="Count: 1, 2,",
        max_tokens=max_tokens,
        temperature=0,
        logit_bias={str(ref.eog_token): -100},  # runs to max_tokens
    )
    it = iter(stream)
    first = next(it)
    got: list[Any] = [first]
    arrived: list[float] = []
    failed: list[BaseException] = []

    def read() -> None:
        try:
            for c in it:
                got.append(c)
                arrived.append(time.monotonic())
        except BaseException as exc:
            failed.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:  # the listening socket closes: new requests are refused
        try:
            httpx.get(url + "/health", timeout=1)
        # refused, or closed unanswered (a connection the closing socket had queued is reset)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            refused = time.monotonic()
            break
        assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
        time.sleep(0.05)
    reader.join(GRACE)
    assert not reader.is_alive() and not failed, failed
    assert arrived and arrived[-1] > refused  # the stream was still running when the server closed
    text = [c.choices[0] for c in got if c.choices]
    assert text[-1].finish_reason == "length"
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == max_tokens
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(model=name, prompt="x", max_tokens=1)
    assert p.wait(30) == 0
