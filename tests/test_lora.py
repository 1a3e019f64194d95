"""LoRA adapters: ``Model.load_lora`` and ``Context(lora=...)``, checked on adapters written for
the test model (``lora_files.write_lora``), whose effect on the logits is known exactly."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from lora_files import write_lora

import lloyal

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def files(model: lloyal.Model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("lora")
    return {
        "a": write_lora(model, d / "a.gguf", seed=1),
        # B halved: at scale 1.0 it adds what "a" adds at scale 0.5, bit for bit (halving is exact)
        "half": write_lora(model, d / "half.gguf", seed=1, b_factor=0.5),
        # alpha 8 at rank 4: llama.cpp scales by 8 / 4, so at scale 0.5 it adds what "a" adds at 1.0
        "alpha": write_lora(model, d / "alpha.gguf", seed=1, alpha=8.0),
        "zero": write_lora(model, d / "zero.gguf", seed=1, b_factor=0.0),
        "b": write_lora(model, d / "b.gguf", seed=2),
        "llama": write_lora(model, d / "llama.gguf", seed=1, arch="llama"),
    }


def prompt_logits(model: lloyal.Model, **options: object) -> np.ndarray:
    """The logits after the prompt, in a context of its own with ``options``."""
    with lloyal.Context(model, n_ctx=256, **options) as ctx:  # type: ignore[arg-type]
        b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
        b.prefill(ctx.tokenize(PROMPT))
        return np.array(b.logits)


@pytest.fixture(scope="module")
def base(model: lloyal.Model) -> np.ndarray:
    """The model's own logits, with the kernels an adapted context runs (not batch-invariant)."""
    return prompt_logits(model, batch_invariant=False)


def test_an_adapter_changes_the_logits_by_its_delta_times_its_scale(
    model: lloyal.Model, files: dict[str, Path], base: np.ndarray
) -> None:
    a = model.load_lora(files["a"])
    with_a = prompt_logits(model, lora=[a])
    assert np.abs(with_a - base).max() > 0.5  # applied
    # the scale multiplies the delta: B/2 at 1.0 is A's delta at 0.5, to the bit
    half = prompt_logits(model, lora=[files["half"]])
    assert np.array_equal(half, prompt_logits(model, lora=[(a, 0.5)]))
    assert not np.array_equal(half, with_a)
    # alpha / rank scales it too
    assert np.array_equal(prompt_logits(model, lora=[(files["alpha"], 0.5)]), with_a)
    # a zero delta, or a zero scale, leaves the model's logits exactly as they were
    assert np.array_equal(prompt_logits(model, lora=[files["zero"]]), base)
    assert np.array_equal(prompt_logits(model, lora=[(a, 0.0)]), base)
    # two adapters add up: each alone differs from both together
    both = prompt_logits(model, lora=[a, files["b"]])
    assert not np.array_equal(both, with_a)
    assert not np.array_equal(both, prompt_logits(model, lora=[files["b"]]))


def test_adapters_belong_to_their_context_alone(
    model: lloyal.Model, files: dict[str, Path], base: np.ndarray
) -> None:
    with lloyal.Context(model, n_ctx=256, lora=[files["a"]]) as adapted:
        assert [(x.path, s) for x, s in adapted.lora] == [(files["a"].resolve(), 1.0)]
        # a context of the same model made while the adapted one lives has no adapter
        assert np.array_equal(prompt_logits(model, batch_invariant=False), base)
    with lloyal.Context(model, n_ctx=64) as plain:
        assert plain.lora == []


def test_a_file_loads_once_per_model(model: lloyal.Model, files: dict[str, Path]) -> None:
    a = model.load_lora(files["a"])
    again = model.load_lora(str(files["a"]))
    assert a == again and hash(a) == hash(again)
    assert a != model.load_lora(files["b"])
    assert a.path == files["a"].resolve()
    assert (a.alpha, model.load_lora(files["alpha"]).alpha) == (0.0, 8.0)
    assert a.meta("adapter.type") == "lora" and a.meta("no.such.key") is None
    assert repr(a).startswith("LoraAdapter(path=")


def test_a_file_rewritten_in_place_loads_again(model: lloyal.Model, tmp_path: Path, base: np.ndarray) -> None:
    """A training loop writing checkpoints to one path gets the new weights, not the first
    file's (the cache of loaded adapters compares the file's size and modification time)."""
    path = write_lora(model, tmp_path / "ckpt.gguf", seed=3)
    first = model.load_lora(path)
    changed = prompt_logits(model, lora=[first])
    assert not np.array_equal(changed, base)
    write_lora(model, path, seed=3, b_factor=0.0)  # the same size: only the time differs
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    second = model.load_lora(path)
    assert second != first and model.load_lora(path) == second
    assert np.array_equal(prompt_logits(model, lora=[second]), base)
    assert np.array_equal(prompt_logits(model, lora=[first]), changed)  # the first still applies


def test_adapters_load_and_free_from_many_threads(
    model: lloyal.Model, files: dict[str, Path], tmp_path: Path
) -> None:
    """Loading and freeing change the model's set of adapters in llama.cpp (no lock there):
    two threads doing both at once corrupted the heap before lloyal held a lock of its own around
    them (a crash in about half of 20-second runs of this loop; a smoke test, not a proof)."""
    paths = [write_lora(model, tmp_path / f"t{i}.gguf", seed=i, rank=1, layers=1) for i in range(16)]
    errors: list[BaseException] = []
    deadline = time.monotonic() + 3.0

    def churn(k: int) -> None:
        try:
            while time.monotonic() < deadline:
                for path in paths[k::2]:
                    adapter = model.load_lora(path)  # the GIL released
                    del adapter  # the last holder: freed here, beside the other thread's load
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert np.array_equal(
        prompt_logits(model, lora=[files["zero"]]), prompt_logits(model, batch_invariant=False)
    )


def test_engine_generation_runs_under_the_adapter(model: lloyal.Model, files: dict[str, Path]) -> None:
    """Branch generation (the engine's ticks) and the flat path decode under the adapter: the
    same prompt gives the same logits both ways, and greedy text changes with the adapter."""

    def greedy(lora: list[Path]) -> list[int]:
        with lloyal.Context(model, n_ctx=256, n_seq_max=2, lora=lora) as ctx:
            root = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
            root.prefill(ctx.tokenize(PROMPT))
            return [t.token for t in root.generate(8)]

    adapted = greedy([files["a"]])
    assert adapted == greedy([files["a"]])
    assert adapted != greedy([])
    with lloyal.Context(model, n_ctx=256, lora=[files["a"]]) as ctx:
        ctx.decode(ctx.tokenize(PROMPT), 0)
        flat = np.array(ctx.get_logits())
    assert np.array_equal(flat, prompt_logits(model, lora=[files["a"]]))


def test_files_that_are_not_adapters_for_the_model_are_refused(
    model: lloyal.Model, files: dict[str, Path], model_path: Path, tmp_path: Path
) -> None:
    with pytest.raises(lloyal.ModelLoadError, match=r"no-such\.gguf"):
        model.load_lora(tmp_path / "no-such.gguf")
    with pytest.raises(lloyal.ModelLoadError, match=r"general\.type to be 'adapter'"):
        model.load_lora(model_path)  # a model, not an adapter
    with pytest.raises(lloyal.ModelLoadError, match="arch mismatch"):
        model.load_lora(files["llama"])
    (tmp_path / "text.gguf").write_text("not a gguf")
    with pytest.raises(lloyal.ModelLoadError, match=r"text\.gguf"):
        lloyal.Context(model, n_ctx=64, lora=[tmp_path / "text.gguf"])


def test_bad_lora_arguments_say_what_was_wrong(
    model: lloyal.Model, exact_model: lloyal.Model, model_path: Path, files: dict[str, Path]
) -> None:
    a = model.load_lora(files["a"])
    with pytest.raises(TypeError, match="a list of adapters"):
        lloyal.Context(model, n_ctx=64, lora=str(files["a"]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a list of adapters"):
        lloyal.Context(model, n_ctx=64, lora=a)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a list of adapters"):  # a dict's scales would be lost
        lloyal.Context(model, n_ctx=64, lora={a: 0.5})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"lora\[0\]: the scale 1e300 is beyond the range of a float32"):
        lloyal.Context(model, n_ctx=64, lora=[(a, 1e300)])
    with pytest.raises(TypeError, match=r"lora\[0\]: expected a LoraAdapter or a path, got int"):
        lloyal.Context(model, n_ctx=64, lora=[3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"lora\[0\]: a pair is"):
        lloyal.Context(model, n_ctx=64, lora=[(a, 1.0, 2.0)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"lora\[0\]: the scale must be a number"):
        lloyal.Context(model, n_ctx=64, lora=[(a, "x")])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"lora\[0\]: the scale .* must be a finite number"):
        lloyal.Context(model, n_ctx=64, lora=[(a, float("nan"))])
    with pytest.raises(ValueError, match=r"lora\[1\]: .* listed twice"):
        lloyal.Context(model, n_ctx=64, lora=[a, (files["a"], 0.5)])
    # an adapter loaded for other weights (the same file with other options is another model)
    repacked = lloyal.Model(model_path, repack=True)
    with pytest.raises(ValueError, match=r"lora\[0\]: .* was loaded for the model"):
        lloyal.Context(repacked, n_ctx=64, lora=[a])
    # adapters are float matrices: not batch-invariant (on the CPU, where nothing else says so)
    with pytest.raises(ValueError, match="LoRA adapters"):
        lloyal.Context(exact_model, n_ctx=64, lora=[exact_model.load_lora(files["a"])], batch_invariant=True)
    with lloyal.Context(model, n_ctx=64, lora=[a]) as ctx:
        assert ctx.batch_invariant is False
