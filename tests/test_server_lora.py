"""`lloyal serve --lora/--lora-scaled`: every request runs under the server's adapters, listed on
``GET /lora-adapters`` as llama-server lists them; a request's ``lora`` field is taken when it
asks for those scales and refused otherwise."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from helpers import serving
from lora_files import write_lora

import lloyal
from lloyal.cli import _lora_flags, main

pytest.importorskip("uvicorn", reason="the server extra: pip install 'lloyal[server]'")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapters(model: lloyal.Model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("server-lora")
    return write_lora(model, d / "a.gguf", seed=1), write_lora(model, d / "b.gguf", seed=2)


@pytest.fixture(scope="module")
def url(model_path: Path, adapters: tuple[Path, Path]) -> Iterator[str]:
    from lloyal.server import ServerConfig, create_app

    a, b = adapters
    cfg = ServerConfig(
        model=model_path,
        n_ctx=512,
        parallel=2,
        n_threads=2,
        lora=((a, 1.0), (b, 0.5)),
        warmup=False,
        embeddings=True,
    )
    with serving(create_app(cfg)) as u:
        yield u


def complete(url: str, **extra: Any) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_the_adapters_are_listed_as_llama_server_lists_them(url: str, adapters: tuple[Path, Path]) -> None:
    a, b = adapters
    listed = httpx.get(f"{url}/lora-adapters").json()
    assert listed == [
        {"id": 0, "path": str(a.resolve()), "scale": 1.0},
        {"id": 1, "path": str(b.resolve()), "scale": 0.5},
    ]


def test_requests_run_under_the_adapters(url: str, model_path: Path, adapters: tuple[Path, Path]) -> None:
    """The server's greedy completion is the library's under the same adapters, and not the
    model's own."""
    a, b = adapters
    served = complete(url)
    assert served.status_code == 200, served.text
    text = served.json()["choices"][0]["text"]
    model = lloyal.Model(model_path)  # repacked, as the server's

    def library(lora: list[Any]) -> str:
        with lloyal.Context(model, n_ctx=256, n_threads=2, lora=lora) as ctx:
            root = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
            root.prefill(ctx.tokenize(PROMPT))
            return "".join(t.text for t in root.generate(8))

    assert text == library([(a, 1.0), (b, 0.5)])
    assert text != library([])
    # the request may name the server's own scales (an adapter left out has scale 0)
    same = complete(url, lora=[{"id": 1, "scale": 0.5}, {"id": 0, "scale": 1.0}])
    assert same.status_code == 200 and same.json()["choices"][0]["text"] == text


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ([{"id": 0, "scale": 1.0}], "per-request LoRA scales are not supported"),
        ([{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.25}], "at their scales [1, 0.5]"),
        ([{"id": 2, "scale": 1.0}], "lora id 2 does not exist: this server has 2 adapter(s)"),
    ],
)
def test_other_scales_are_refused_by_name(url: str, lora: list[dict[str, Any]], message: str) -> None:
    r = complete(url, lora=lora)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "lora" and message in error["message"]


def test_embeddings_run_under_the_adapters(url: str, model_path: Path, adapters: tuple[Path, Path]) -> None:
    """As llama-server's --lora: the adapters apply to /v1/embeddings too, and its ``lora`` field
    is checked as a completion's is."""
    a, b = adapters
    served = httpx.post(f"{url}/v1/embeddings", json={"input": "hello"}, timeout=120)
    assert served.status_code == 200, served.text
    vector = np.array(served.json()["data"][0]["embedding"])
    model = lloyal.Model(model_path)

    def library(lora: list[Any]) -> np.ndarray:
        with lloyal.Context(model, n_ctx=512, embeddings=True, lora=lora) as ctx:
            return np.array(ctx.embed("hello"))

    np.testing.assert_allclose(vector, library([(a, 1.0), (b, 0.5)]), rtol=1e-5, atol=1e-6)
    assert np.abs(vector - library([])).max() > 1e-3
    asked = {"input": "hello", "lora": [{"id": 0, "scale": 7.0}]}
    refused = httpx.post(f"{url}/v1/embeddings", json=asked, timeout=120)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora"


def test_a_scale_beyond_float32_is_refused_as_another_scale(url: str) -> None:
    """(It was cast to float32 first: an overflow warning, an error under -W error.)"""
    r = complete(url, lora=[{"id": 0, "scale": 1e300}, {"id": 1, "scale": 0.5}])
    assert r.status_code == 400 and "per-request LoRA scales" in r.json()["error"]["message"]


def test_serve_refuses_adapters_that_cannot_serve_in_one_line(
    model: lloyal.Model,
    model_path: Path,
    adapters: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An adapter for another architecture, or one listed twice, fails as the command's error
    (the weights are loaded before the server starts), not as a traceback in its startup."""
    a, _ = adapters
    other = write_lora(model, tmp_path / "llama.gguf", seed=1, arch="llama")
    for flags, message in [
        (["--lora", str(other)], "arch mismatch"),
        (["--lora", str(a), "--lora-scaled", f"{a}:0.5"], "is listed twice"),
    ]:
        assert main(["--model", str(model_path), "serve", *flags]) == 1
        err = capsys.readouterr().err
        assert err.startswith("lloyal: error: ") and message in err and err.count("\n") == 1, err


def test_lora_flags_read_as_llama_server_reads_them() -> None:
    assert _lora_flags(["a.gguf,b.gguf", "c.gguf"], ["d.gguf:0.5,e.gguf:-1", "/x:y/f.gguf:2"]) == (
        (Path("a.gguf"), 1.0),
        (Path("b.gguf"), 1.0),
        (Path("c.gguf"), 1.0),
        (Path("d.gguf"), 0.5),
        (Path("e.gguf"), -1.0),
        (Path("/x:y/f.gguf"), 2.0),
    )
    for bad in ("a.gguf", ":0.5", "a.gguf:inf", "a.gguf:"):
        with pytest.raises(ValueError, match="--lora-scaled takes FNAME:SCALE"):
            _lora_flags([], [bad])
    with pytest.raises(ValueError, match="beyond a float32's range"):
        _lora_flags([], ["a.gguf:1e300"])
