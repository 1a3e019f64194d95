"""Write one tiny GGUF per family: byte-level BPE vocabulary, real special tokens and chat template."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

from . import templates

# Shapes: head size 32 (a q8_0 KV cache needs head size % 32 == 0), grouped-query attention.
N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER, N_CTX = 128, 4, 2, 256, 2, 4096
HEAD = N_EMBD // N_HEAD
N_MERGES = 400

# Text the BPE merges are learned from, so everyday words are a few tokens each.
CORPUS = """
The capital of France is Paris. The capital of Italy is Rome. And of Italy? What is the
capital of France? Hello, world! You are a helpful assistant. Write a short story about a
cat who learns to fly. The quick brown fox jumps over the lazy dog. Tell me a joke about
numbers: one two three four five six seven eight nine ten. system user assistant tool
function name arguments parameters weather city time search query answer question reply
"""


@dataclass(frozen=True)
class Family:
    """One tiny model: architecture, tokenizer pre-type, special tokens, chat template."""

    name: str
    arch: str
    pre: str
    template: str | None
    specials: tuple[str, ...]  # control tokens, appended after the BPE vocabulary
    bos: str
    eos: str
    eot: str | None = None
    add_bos: bool = True
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0
    pooling: int | None = None  # llama_pooling_type written as <arch>.pooling_type
    rope_base: float = 10000.0
    extra: dict[str, int] = field(default_factory=dict)


LLAMA3 = Family(
    "llama3",
    "llama",
    "llama-bpe",
    templates.LLAMA3,
    (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
    ),
    bos="<|begin_of_text|>",
    eos="<|end_of_text|>",
    eot="<|eot_id|>",
    rope_base=500000.0,
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2 = Family(
    "qwen2",
    "qwen2",
    "qwen2",
    templates.QWEN2,
    QWEN_SPECIALS,
    bos="<|endoftext|>",
    eos="<|im_end|>",
    eot="<|im_end|>",
    add_bos=False,
    rope_base=1000000.0,
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        LLAMA3,
        Family(
            "mistral",
            "llama",
            "tekken",
            templates.MISTRAL,
            ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
            bos="<s>",
            eos="</s>",
        ),
        QWEN2,
        replace(
            QWEN2,
            name="qwen3",
            arch="qwen3",
            template=templates.QWEN3,
            specials=(*QWEN_SPECIALS, "<think>", "</think>"),
        ),
        Family(
            "phi3",
            "phi3",
            "gpt-2",
            templates.PHI3,
            # llama.cpp looks these four up by text for any model named "phi3" (and gives every
            # other control token RSTRIP: the whitespace after it is part of the token).
            ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"),
            bos="<s>",
            eos="<|endoftext|>",
            eot="<|end|>",
        ),
        # Llama 3 with float weights: llama.cpp multiplies them with batch-size-dependent kernels
        replace(LLAMA3, name="llama3-f32", qtype=gguf.GGMLQuantizationType.F32),
        Family(
            "qwen3-embed",
            "qwen3",
            "qwen2",
            None,
            QWEN_SPECIALS,
            bos="<|endoftext|>",
            eos="<|endoftext|>",
            add_bos=False,
            qtype=gguf.GGMLQuantizationType.Q8_0,
            pooling=3,  # LLAMA_POOLING_TYPE_LAST, as Qwen3-Embedding ships
        ),
    ]
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level BPE vocabularies store)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _bpe_vocab() -> tuple[list[str], list[str]]:
    """256 byte tokens plus N_MERGES merges learned from CORPUS (ties broken by text): (tokens, merges)."""
    enc = _bytes_to_unicode()
    words: dict[tuple[str, ...], int] = {}
    for w in re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", CORPUS):
        key = tuple(enc[b] for b in w.encode())
        words[key] = words.get(key, 0) + 1
    tokens = [enc[b] for b in range(256)]
    merges: list[str] = []
    for _ in range(N_MERGES):
        pairs: dict[tuple[str, str], int] = {}
        for w, n in words.items():
            for a, b in itertools.pairwise(w):
                pairs[(a, b)] = pairs.get((a, b), 0) + n
        if not pairs:
            break
        (a, b), _count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        merged: dict[tuple[str, ...], int] = {}
        for w, n in words.items():
            out: list[str] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return tokens, merges


def _source_hash() -> str:
    here = Path(__file__).resolve().parent
    h = hashlib.sha256(gguf.__version__.encode() if hasattr(gguf, "__version__") else b"")
    for p in sorted(here.glob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "lloyal" / "gguf-families" / _source_hash()


def family_path(name: str) -> Path:
    """The GGUF of family ``name``, generated into the cache on first use."""
    path = cache_dir() / f"{name}.gguf"
    if not path.exists():
        _write(FAMILIES[name], path)
    return path


def generate_all() -> dict[str, Path]:
    return {name: family_path(name) for name in FAMILIES}


def _write(f: Family, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tokens, merges = _bpe_vocab()
    n_normal = len(tokens)
    tokens = tokens + list(f.specials)
    types = [gguf.TokenType.NORMAL] * n_normal + [gguf.TokenType.CONTROL] * len(f.specials)
    ids = {t: i for i, t in enumerate(tokens)}

    w = gguf.GGUFWriter(str(tmp), f.arch)
    w.add_name(f"lloyal-tiny-{f.name}")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD)
    w.add_value_length(HEAD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(HEAD)
    w.add_rope_freq_base(f.rope_base)
    w.add_vocab_size(len(tokens))
    file_type = {
        gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
        gguf.GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32,
        gguf.GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
    }[f.qtype]
    w.add_file_type(file_type)
    if f.pooling is not None:
        w.add_pooling_type(gguf.PoolingType(f.pooling))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(f.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(ids[f.bos])
    w.add_eos_token_id(ids[f.eos])
    if f.eot is not None:
        w.add_eot_token_id(ids[f.eot])
    w.add_add_bos_token(f.add_bos)
    if f.template is not None:
        w.add_chat_template(f.template)

    rng = np.random.default_rng(sum(f.name.encode()))
    n_vocab = len(tokens)
    kv = N_HEAD_KV * HEAD

    def matrix(name: str, rows: int, cols: int) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)
        if f.qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif f.qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, f.qtype), raw_dtype=f.qtype)

    def vector(name: str, n: int, value: float | None = None) -> None:
        if value is None:
            data = rng.standard_normal(n).astype(np.float32) * 0.02
        else:
            data = np.full(n, value, np.float32)
        w.add_tensor(name, data)

    matrix("token_embd.weight", n_vocab, N_EMBD)
    vector("output_norm.weight", N_EMBD, 1.0)
    matrix("output.weight", n_vocab, N_EMBD)
    for i in range(N_LAYER):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", N_EMBD, 1.0)
        vector(f"{b}.ffn_norm.weight", N_EMBD, 1.0)
        if f.arch == "phi3":
            matrix(f"{b}.attn_qkv.weight", N_EMBD + 2 * kv, N_EMBD)
            matrix(f"{b}.ffn_up.weight", 2 * N_FF, N_EMBD)
        else:
            matrix(f"{b}.attn_q.weight", N_EMBD, N_EMBD)
            matrix(f"{b}.attn_k.weight", kv, N_EMBD)
            matrix(f"{b}.attn_v.weight", kv, N_EMBD)
            matrix(f"{b}.ffn_gate.weight", N_FF, N_EMBD)
            matrix(f"{b}.ffn_up.weight", N_FF, N_EMBD)
        if f.arch == "qwen2":
            vector(f"{b}.attn_q.bias", N_EMBD)
            vector(f"{b}.attn_k.bias", kv)
            vector(f"{b}.attn_v.bias", kv)
        if f.arch == "qwen3":
            vector(f"{b}.attn_q_norm.weight", HEAD, 1.0)
            vector(f"{b}.attn_k_norm.weight", HEAD, 1.0)
        matrix(f"{b}.attn_output.weight", N_EMBD, N_EMBD)
        matrix(f"{b}.ffn_down.weight", N_EMBD, N_FF)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def vocab(name: str) -> list[str]:
    """The token texts of family ``name`` in id order (byte tokens, merges, then its specials)."""
    tokens, _ = _bpe_vocab()
    return tokens + list(FAMILIES[name].specials)


def token_id(name: str, text: str) -> int:
    """The id of a special token (or a byte-level token text) in family ``name``'s vocabulary."""
    return vocab(name).index(text)


if __name__ == "__main__":
    for name, p in generate_all().items():
        print(f"{name}: {p} ({p.stat().st_size} bytes)")
