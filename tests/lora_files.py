"""LoRA adapter files for the tests, written with ``gguf`` (llama.cpp's own GGUF writer) for the
test model: no adapter for Gemma 3 270M can be downloaded here, and a made one lets a test know
exactly what the adapter adds.

An adapter for a weight ``W`` (ggml shape ``[n_in, n_out]``) is ``W.lora_a`` (``[n_in, rank]``)
and ``W.lora_b`` (``[rank, n_out]``); llama.cpp adds ``scale * B @ (A @ x)`` to ``W @ x``, where
``scale`` is the context's scale, times ``alpha / rank`` when the file's alpha is not 0.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

import lloyal

__all__ = ["write_lora"]


def _shapes(model: lloyal.Model) -> dict[str, tuple[int, int]]:
    """``(n_in, n_out)`` of each layer's query projection and FFN up projection, from the
    model's metadata (reading the GGUF's tensor list takes seconds: its vocabulary is large)."""
    arch = model.architecture

    def meta(key: str) -> int | None:
        value = model.meta(f"{arch}.{key}")
        return int(value) if value is not None else None

    n_embd = model.n_embd
    n_head = meta("attention.head_count") or 1
    head_dim = meta("attention.key_length") or n_embd // n_head
    n_ff = meta("feed_forward_length")
    shapes = {"attn_q": (n_embd, n_head * head_dim)}
    if n_ff:
        shapes["ffn_up"] = (n_embd, n_ff)
    return shapes


def write_lora(
    model: lloyal.Model,
    out: Path,
    *,
    seed: int = 0,
    rank: int = 4,
    std: float = 0.05,
    b_factor: float = 1.0,
    alpha: float = 0.0,
    arch: str | None = None,
    layers: int | None = None,
) -> Path:
    """Write a random LoRA adapter for ``model`` to ``out``: each layer's query and FFN up
    projections get float32 A and B (normal, ``std``; the same for the same ``seed`` and
    ``rank``), B multiplied by ``b_factor`` (0: an adapter that adds nothing). ``arch``
    overrides the architecture the file declares; ``layers`` keeps the first layers only."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(out, arch or model.architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    shapes = _shapes(model)
    for layer in range(model.n_layer if layers is None else layers):
        for target, (n_in, n_out) in shapes.items():
            a = rng.normal(0.0, std, size=(rank, n_in)).astype(np.float32)
            b = (rng.normal(0.0, std, size=(n_out, rank)) * b_factor).astype(np.float32)
            writer.add_tensor(f"blk.{layer}.{target}.weight.lora_a", a)
            writer.add_tensor(f"blk.{layer}.{target}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
