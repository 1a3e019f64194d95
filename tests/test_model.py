"""Model loading: facts, weight sharing, and ModelLoadError for every kind of bad file."""

from __future__ import annotations

from pathlib import Path

import pytest

import lloyal


def test_model_facts(model: lloyal.Model, model_path: Path) -> None:
    assert model.n_vocab == 262144
    assert model.architecture == "gemma3"
    assert model.n_layer == 18
    assert model.n_embd == 640
    assert model.n_ctx_train == 32768
    assert model.chat_template is None  # the default model ships no Jinja template
    assert model.meta("general.name") == "Gemma 3 270m"
    assert model.meta("no.such.key") is None
    assert Path(model.path) == model_path.resolve()
    assert 200_000_000 < model.n_params < 300_000_000


def test_contexts_of_one_model_share_weights(model: lloyal.Model, model_path: Path) -> None:
    a = lloyal.Context(model, n_ctx=256)
    b = lloyal.Context(str(model_path), n_ctx=256)
    try:
        assert a.model.path == b.model.path
        # Greedy next token from each context is the same: same weights, independent KV.
        toks = a.tokenize("One, two, three,")
        a.decode(toks, 0)
        b.decode(toks, 0)
        assert a.sample(temperature=0) == b.sample(temperature=0)
        assert a.kv_cache_size() == b.kv_cache_size() == len(toks) - 1
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("kind", "needle"),
    [("missing", "No such file"), ("directory", "directory"), ("empty", "0 bytes"), ("magic", "magic")],
)
def test_bad_files_raise_model_load_error(tmp_path: Path, kind: str, needle: str) -> None:
    path = tmp_path / "model.gguf"
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "magic":
        path.write_bytes(b"NOTGGUF!" + bytes(64))
    with pytest.raises(lloyal.ModelLoadError) as exc:
        lloyal.Model(path)
    assert str(path) in str(exc.value)
    assert needle in str(exc.value)


def test_truncated_gguf_raises_model_load_error(tmp_path: Path, model_path: Path) -> None:
    path = tmp_path / "truncated.gguf"
    path.write_bytes(model_path.read_bytes()[:4096])
    with pytest.raises(lloyal.ModelLoadError) as exc:
        lloyal.Model(path)
    assert "truncated.gguf" in str(exc.value)


def test_context_from_bad_path_raises(tmp_path: Path) -> None:
    with pytest.raises(lloyal.ModelLoadError):
        lloyal.Context(tmp_path / "nope.gguf")


def test_default_model_path_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLOYAL_MODEL", str(tmp_path / "x.gguf"))
    assert lloyal.default_model_path() == tmp_path / "x.gguf"
