"""Model loading: facts, weight sharing, and ModelLoadError for every kind of bad file."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import GPU_BACKEND, THP

import lloyal


def test_model_facts(model: lloyal.Model, model_path: Path) -> None:
    assert model.n_vocab == 262144
    assert model.architecture == "gemma3"
    assert model.n_layer == 18
    assert model.n_embd == 640
    assert model.n_ctx_train == 32768
    assert model.chat_template is None  # the default model ships no Jinja template
    assert model.meta("general.architecture") == "gemma3"
    assert model.meta("no.such.key") is None
    assert Path(model.path) == model_path.resolve()
    assert 200_000_000 < model.n_params < 300_000_000
    assert 0 < model.size <= model_path.stat().st_size
    assert "gemma3" in repr(model)


def test_weights_read_into_memory_are_advised_huge_pages(exact_model: lloyal.Model, model_path: Path) -> None:
    """``use_mmap=False``: every weight buffer the load allocates is marked for 2 MiB pages
    before llama.cpp reads into it (``Model.huge_page_bytes``); mapped, only the repacked
    weights are (the file's pages stay mapped), and nothing off Linux. (Host buffers: the
    models stay on the CPU on a GPU run too.)"""
    model = exact_model
    read = lloyal.Model(model_path, use_mmap=False, n_gpu_layers=0)
    if GPU_BACKEND:
        # llama.cpp takes the GPU's pinned host buffers for CPU weights (71 of 247 MB advised
        # on an H200 host): at most the rest is lloyal's to advise
        assert read.huge_page_bytes < 0.85 * read.size
    else:
        # the main weight buffer alone is ~90% of the weights (what else a load maps varies)
        assert not THP or read.huge_page_bytes >= 0.85 * read.size
        assert not THP or 0 < model.huge_page_bytes < 0.5 * read.size  # mapped: repacked Q4 layers only
        assert THP or read.huge_page_bytes == model.huge_page_bytes == 0
    with lloyal.Context(read, n_ctx=256) as a, lloyal.Context(model, n_ctx=256) as b:
        toks = a.tokenize("One, two, three,")
        a.decode(toks, 0)
        b.decode(toks, 0)
        assert a.sample(temperature=0) == b.sample(temperature=0)  # the same weights


def test_llama_cpp_array_news_in_the_extension_are_cache_line_aligned() -> None:
    """ggml's work buffer is a C++ ``new uint8_t[]``: the extension's ``operator new[]``
    (``cxx_alloc.rs``) aligns it to 64 bytes, so where the heap puts it does not split its
    rows across cache lines (an 8% slower prompt when it did, benches/RESULTS.md)."""
    if sys.platform != "linux":
        assert not hasattr(ctypes.CDLL(lloyal._lloyal.__file__), "_Znam")
        return
    ext = ctypes.CDLL(lloyal._lloyal.__file__)
    new = ext._Znam
    new.restype, new.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]
    for size in (0, 24, 2_244_800):
        p = new(size)
        assert p and p % 64 == 0, (size, p)
        free(p)


def test_same_path_loads_once(model: lloyal.Model, model_path: Path, tmp_path: Path) -> None:
    """docs/api.md ("Model"): a path opened twice loads once. A real load of this model takes ~0.7 s
    (262k-token vocabulary); a second Model() of a path that is loaded must be a lookup."""
    link = tmp_path / "alias.gguf"
    link.symlink_to(model_path)
    for path in (model_path, str(model_path), link):
        t0 = time.perf_counter()
        again = lloyal.Model(path, repack=model.repack)
        elapsed = time.perf_counter() - t0
        assert elapsed < 0.1, f"Model({path!r}) took {elapsed:.3f}s: the weights were loaded again"
        assert Path(again.path) == Path(model.path)  # canonical path: the symlink resolves
        assert again.n_vocab == model.n_vocab


def test_contexts_of_one_model_share_weights(exact_model: lloyal.Model, model_path: Path) -> None:
    a = lloyal.Context(exact_model, n_ctx=256)
    t0 = time.perf_counter()
    # A path: the already-loaded weights are reused (the fixture's unrepacked ones, which a
    # batch-invariant context loads; a default context would load repacked weights once).
    b = lloyal.Context(str(model_path), n_ctx=256, batch_invariant=True)
    opened = time.perf_counter() - t0
    try:
        assert opened < 0.5, f"Context(path) took {opened:.3f}s: the weights were loaded again"
        assert a.model.path == b.model.path == exact_model.path
        # Same weights, independent KV: the same prompt gives the same greedy token and logits.
        toks = a.tokenize("One, two, three,")
        a.decode(toks, 0)
        assert b.kv_cache_size() == -1
        b.decode(toks, 0)
        assert a.sample(temperature=0) == b.sample(temperature=0)
        assert (a.get_logits() == b.get_logits()).all()
        assert a.kv_cache_size() == b.kv_cache_size() == len(toks) - 1
    finally:
        a.close()
        b.close()


def make_bad_file(tmp_path: Path, model_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.gguf"
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "magic":
        path.write_bytes(b"NOTGGUF!" + bytes(64))
    elif kind == "version":
        path.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(64))
    elif kind.startswith("truncated"):
        n = int(kind.removeprefix("truncated"))
        with open(model_path, "rb") as f:
            path.write_bytes(f.read(n))
    else:
        assert kind == "missing"
    return path


BAD_FILES = [
    ("missing", "No such file"),
    ("directory", "directory"),
    ("empty", "0 bytes"),
    ("magic", "magic"),
    ("version", "version 9"),
    ("truncated100", "failed"),
    ("truncated4096", "failed"),
]


@pytest.mark.parametrize(("kind", "needle"), BAD_FILES)
def test_bad_files_raise_model_load_error(tmp_path: Path, model_path: Path, kind: str, needle: str) -> None:
    path = make_bad_file(tmp_path, model_path, kind)
    with pytest.raises(lloyal.ModelLoadError) as exc:
        lloyal.Model(path)
    assert isinstance(exc.value, lloyal.LloyalError)
    assert str(path) in str(exc.value)
    assert needle in str(exc.value)
    # The same through Context(path).
    with pytest.raises(lloyal.ModelLoadError) as exc2:
        lloyal.Context(str(path), n_ctx=256)
    assert str(path) in str(exc2.value)


def test_bad_files_do_not_crash_the_process(tmp_path: Path, model_path: Path) -> None:
    """Loading every bad file in a fresh interpreter ends normally, each with a ModelLoadError."""
    paths = [str(make_bad_file(tmp_path, model_path, kind)) for kind, _ in BAD_FILES]
    script = (
        "import sys, lloyal\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        lloyal.Model(p)\n"
        "        print('LOADED', p)\n"
        "    except lloyal.ModelLoadError as e:\n"
        "        print('ModelLoadError', p in str(e))\n"
        "print('END')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *paths],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LLOYAL_MODEL": str(model_path)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["ModelLoadError True"] * len(paths) + ["END"]


def test_default_model_path_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLOYAL_MODEL", str(tmp_path / "x.gguf"))
    assert lloyal.default_model_path() == tmp_path / "x.gguf"
    with pytest.raises(lloyal.ModelLoadError, match=r"x\.gguf"):
        lloyal.create_context(n_ctx=256)


def test_default_model_path_is_a_gguf(model_path: Path) -> None:
    assert isinstance(model_path, Path)
    assert model_path.is_file()
    with open(model_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_gpu_layers_default_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, model_path: Path
) -> None:
    """``LLOYAL_N_GPU_LAYERS`` is the default of ``n_gpu_layers`` (as llama-server's
    ``LLAMA_ARG_N_GPU_LAYERS``): a value that is no count is refused by every load that reads it,
    and an explicit ``n_gpu_layers`` does not read it."""
    monkeypatch.setenv("LLOYAL_N_GPU_LAYERS", "all")
    with pytest.raises(ValueError, match=r'LLOYAL_N_GPU_LAYERS="all" is not a layer count'):
        lloyal.Model(model_path)
    with pytest.raises(ValueError, match="LLOYAL_N_GPU_LAYERS"):
        lloyal.Context(str(model_path), n_ctx=256)
    assert lloyal.Model(model_path, n_gpu_layers=0, repack=False).n_vocab == 262144
    monkeypatch.setenv("LLOYAL_N_GPU_LAYERS", " ")
    assert lloyal.Model(model_path, repack=False).n_vocab == 262144
