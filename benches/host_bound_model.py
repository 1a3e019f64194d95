"""A Gemma 3 model whose decode is as short as a GPU's, for measuring host work on a CPU.

    python benches/host_bound_model.py [OUT]   (default ~/.cache/lloyal/host-bound-gemma3.gguf)

Gemma 3 270M's tokenizer and vocabulary (262,144 tokens, copied from the default model) on one
transformer block of width 64 with random Q8_0 weights. A decode step's logits rows are as
large as the real model's, so sampling, the row summaries and every copy cost what they cost
there, while the step itself takes about a millisecond on two CPU threads instead of ~20: the
share of host work that a GPU leaves. ``batched_side_by_side.py --model`` runs lloyal and
``llama-batched-bench`` on it (``make bench-host-bound``). The text it writes is noise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

N_EMBD, N_FF, N_HEAD, HEAD = 64, 128, 1, 64
DEFAULT_OUT = Path.home() / ".cache" / "lloyal" / "host-bound-gemma3.gguf"
# Keys the writer sets itself, and the shapes this model changes.
SKIP = ("GGUF.", "general.architecture")
SHAPE = {
    "gemma3.embedding_length": N_EMBD,
    "gemma3.block_count": 1,
    "gemma3.feed_forward_length": N_FF,
    "gemma3.attention.head_count": N_HEAD,
    "gemma3.attention.head_count_kv": N_HEAD,
    "gemma3.attention.key_length": HEAD,
    "gemma3.attention.value_length": HEAD,
}


def weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights: rows of logits spread like the real model's (the median ~25 nats below
    the maximum, the best few within a few nats of each other)."""
    norm = np.ones(N_EMBD, np.float32)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    return {
        "token_embd.weight": mat(262144, N_EMBD, 0.1),
        # untied: with the input embeddings as the output, a token would predict itself
        "output.weight": mat(262144, N_EMBD, 0.68),
        "output_norm.weight": norm,
        "blk.0.attn_norm.weight": norm,
        "blk.0.attn_q.weight": mat(N_HEAD * HEAD, N_EMBD, 0.1),
        "blk.0.attn_k.weight": mat(N_HEAD * HEAD, N_EMBD, 0.1),
        "blk.0.attn_v.weight": mat(N_HEAD * HEAD, N_EMBD, 0.1),
        "blk.0.attn_q_norm.weight": np.ones(HEAD, np.float32),
        "blk.0.attn_k_norm.weight": np.ones(HEAD, np.float32),
        "blk.0.attn_output.weight": mat(N_EMBD, N_HEAD * HEAD, 0.1),
        "blk.0.post_attention_norm.weight": norm,
        "blk.0.ffn_norm.weight": norm,
        "blk.0.ffn_gate.weight": mat(N_FF, N_EMBD, 0.1),
        "blk.0.ffn_up.weight": mat(N_FF, N_EMBD, 0.1),
        "blk.0.ffn_down.weight": mat(N_EMBD, N_FF, 0.1),
        "blk.0.post_ffw_norm.weight": norm,
    }


def write(source: Path, out: Path) -> Path:
    """Write the model to ``out`` with ``source``'s tokenizer and metadata."""
    reader = gguf.GGUFReader(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    w = gguf.GGUFWriter(part, "gemma3")
    for field in reader.fields.values():
        if field.name.startswith(SKIP):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = SHAPE.get(field.name, field.contents())
        w.add_key_value(field.name, value, vtype, sub)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, data in weights(np.random.default_rng(0)).items():
        if data.ndim == 1:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    part.replace(out)
    return out


def main() -> None:
    from lloyal._model_path import default_model_path

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    print(write(Path(default_model_path()), out))


if __name__ == "__main__":
    main()
