"""Any GGUF, not only Gemma 3: the model-independent behaviour on tiny models of the common families.

Each family (Llama 3, Mistral, Qwen 2.5, Qwen 3, Phi-3, and a pooled Qwen 3 embedder) is a
random-weight GGUF written by ``gguf_families`` with a byte-level BPE vocabulary, the family's
real special tokens and its published chat template. Output quality is irrelevant; the
behaviour is asserted exactly (token ids, positions, cell and lease counts, logits bit for bit).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf_families import FAMILIES, Family, family_path, token_id, vocab
from helpers import exact_model_fixture, prefilled, run_example_jsonl

import lloyal
from lloyal import Branch, BranchStore, SamplingParams

# Batch invariance is a CPU feature: this module runs on the CPU on a GPU run too.
pytestmark = pytest.mark.usefixtures("on_cpu")
model = exact_model_fixture()


GREEDY = SamplingParams(temperature=0)
CHAT = ["llama3", "mistral", "qwen2", "qwen3", "phi3"]
QUESTION = {"role": "user", "content": "What is the capital of France?"}
FOLLOW_UP = {"role": "user", "content": "And of Italy?"}
ANSWER = "Paris."
PROMPT = "The quick brown fox jumps over the lazy dog."

# What each family's own template renders for [QUESTION] with add_generation_prompt.
FIRST_PROMPT = {
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    "What is the capital of France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "<s>[INST] What is the capital of France? [/INST]",
    "qwen2": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "phi3": "<|user|>\nWhat is the capital of France?<|end|>\n<|assistant|>\n",
}
# The follow-up turn as format_chat_turn renders it (after the turn separator).
TURN_PROMPT = {
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\nAnd of Italy?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "[INST] And of Italy? [/INST]",
    "qwen2": "<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
    "phi3": "<|user|>\nAnd of Italy?<|end|>\n<|assistant|>\n",
}
# Special-token texts of the turn separator and of format_chat's stop tokens, in order.
SEPARATOR = {
    "llama3": ["<|eot_id|>"],
    "mistral": ["</s>"],
    "qwen2": ["<|im_end|>", "Ċ"],  # "Ċ" is the byte-level BPE text of "\n"
    "qwen3": ["<|im_end|>", "Ċ"],
    "phi3": ["<|end|>"],  # llama.cpp gives Phi-3's control tokens RSTRIP: "<|end|>\n" is one token
}
STOPS = {
    "llama3": ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"],
    "mistral": ["</s>"],
    "qwen2": ["<|im_end|>"],
    "qwen3": ["<|im_end|>"],
    "phi3": ["<|end|>", "<|endoftext|>"],
}


@dataclass
class Fam:
    name: str
    spec: Family
    path: Path
    model: lloyal.Model

    def id(self, text: str) -> int:
        return token_id(self.name, text)


_models: dict[str, Fam] = {}


def load(name: str) -> Fam:
    if name not in _models:
        path = family_path(name)
        _models[name] = Fam(name, FAMILIES[name], path, lloyal.Model(path, repack=False))
    return _models[name]


@pytest.fixture(params=CHAT)
def fam(request: pytest.FixtureRequest) -> Fam:
    return load(request.param)


@pytest.fixture
def ctx(fam: Fam) -> Iterator[lloyal.Context]:
    with lloyal.Context(fam.model, n_ctx=512, n_batch=64, n_seq_max=4) as c:
        yield c


def encode(ctx: lloyal.Context, prompt: str) -> list[int]:
    return ctx.tokenize(prompt, add_special=False, parse_special=True)


# --------------------------------------------------------------------------- model and tokens


def test_metadata_and_special_tokens(fam: Fam, ctx: lloyal.Context) -> None:
    m = fam.model
    assert m.architecture == fam.spec.arch
    assert m.chat_template == fam.spec.template
    assert m.n_vocab == len(vocab(fam.name)) == ctx.n_vocab
    assert (m.n_embd, m.n_layer) == (128, 2)
    assert ctx.bos_token == fam.id(fam.spec.bos)
    # The end-of-generation token is EOT where the family has one (Llama 3, Phi-3), else EOS.
    assert ctx.eog_token == fam.id(fam.spec.eot or fam.spec.eos)
    assert ctx.batch_invariant  # Q8_0 weights: llama.cpp's per-row kernels


TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "  two  spaces\n\nnew lines\tand a tab ",
    "héllo wörld ✓ 日本語 🚀",
    "numbers 1234567890 and symbols <>{}[]",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_detokenize_round_trip(fam: Fam, ctx: lloyal.Context, text: str) -> None:
    tokens = ctx.tokenize(text, add_special=False)
    assert ctx.detokenize(tokens) == text
    with_bos = ctx.tokenize(text)
    assert with_bos == ([fam.id(fam.spec.bos)] if fam.spec.add_bos else []) + tokens


def test_merges_apply_and_specials_parse(fam: Fam, ctx: lloyal.Context) -> None:
    capital = ctx.tokenize(" capital", add_special=False)
    assert len(capital) == 1  # a word of the merge corpus is one token
    assert vocab(fam.name)[capital[0]] == "Ġcapital"
    for text in FAMILIES[fam.name].specials:
        assert ctx.tokenize(text, add_special=False, parse_special=True) == [fam.id(text)]
        assert len(ctx.tokenize(text, add_special=False, parse_special=False)) > 1
        assert ctx.token_to_text(fam.id(text), special=True) == text
        assert ctx.token_to_text(fam.id(text)) == ""


# --------------------------------------------------------------------------- decode and branches


def test_decode_gives_one_row_of_logits(fam: Fam, ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize(PROMPT)
    ctx.decode(tokens, 0)
    logits = ctx.get_logits()
    assert logits.shape == (fam.model.n_vocab,) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert ctx.kv_seq_pos_max(0) == len(tokens) - 1
    assert ctx.sample(temperature=0) == int(np.argmax(logits))


def test_fork_commit_prune_retain_only_counts(ctx: lloyal.Context) -> None:
    store = BranchStore(ctx)
    tokens = ctx.tokenize(PROMPT)
    n = len(tokens)
    root = Branch.create(ctx, 0, GREEDY)
    root.prefill(tokens)
    assert (root.position, store.kv_pressure.cells_used, store.available) == (n, n, 3)
    a, b = root.fork(), root.fork()
    assert store.available == 1
    assert store.kv_pressure.cells_used == n  # forks share the prefix cells
    assert np.array_equal(a.logits, root.logits)
    ta, tb = a.produce().token, b.produce().token
    assert ta == tb == int(np.argmax(root.logits))
    store.commit([(a, ta), (b, tb)])
    assert (a.position, b.position, root.position) == (n + 1, n + 1, n)
    assert store.kv_pressure.cells_used == n + 2
    a.commit(a.produce().token)
    assert store.kv_pressure.cells_used == n + 3
    with pytest.raises(lloyal.TopologyError):
        root.prune()  # RESTRICT: live children
    a.prune()
    assert a.disposed and store.available == 2
    assert store.kv_pressure.cells_used == n + 1
    store.retain_only(b)
    assert root.disposed and not b.disposed and b.parent is None
    assert (store.available, b.position, store.kv_pressure.cells_used) == (3, n + 1, n + 1)
    assert ctx.kv_seq_pos_max(b.seq_id) == n
    b.prune()
    assert (store.available, store.kv_pressure.cells_used) == (4, 0)


def batched_and_single_logits(ctx: lloyal.Context) -> list[tuple[np.ndarray, np.ndarray]]:
    """Three forks of a greedy root on PROMPT commit one word each: per word, its logits when the
    three are committed in one batch, and when its fork is committed alone."""
    root = prefilled(ctx, PROMPT)
    nexts = [ctx.tokenize(w, add_special=False)[0] for w in (" cat", " dog", " fox")]
    batched = [root.fork() for _ in nexts]
    BranchStore(ctx).commit(list(zip(batched, nexts, strict=True)))
    rows = [b.logits for b in batched]
    for b in batched:
        b.prune()
    pairs = []
    for t, row in zip(nexts, rows, strict=True):
        single = root.fork()
        single.commit(t)
        pairs.append((row, single.logits))
        single.prune()
    root.prune()
    return pairs


def test_batched_commit_equals_single_commits(ctx: lloyal.Context) -> None:
    for batched, single in batched_and_single_logits(ctx):
        assert np.array_equal(single, batched)  # bit for bit


def test_greedy_output_does_not_depend_on_n_batch(fam: Fam, ctx: lloyal.Context) -> None:
    tokens = ctx.tokenize(PROMPT * 3)
    outs = []
    for n_batch in (7, 64):
        with lloyal.Context(fam.model, n_ctx=256, n_batch=n_batch) as c, Branch.create(c, 0, GREEDY) as b:
            b.prefill(tokens)
            outs.append(([b.produce().token], b.logits))
    assert outs[0][0] == outs[1][0]
    assert np.array_equal(outs[0][1], outs[1][1])


def test_branch_state_round_trip(fam: Fam, ctx: lloyal.Context) -> None:
    with Branch.create(ctx, 0, GREEDY) as b:
        b.prefill(ctx.tokenize(PROMPT))
        b.commit(b.produce().token)
        data = b.save_state()
        expected = [b.produce().token]
        logits = b.logits
    with lloyal.Context(fam.model, n_ctx=512) as other, Branch.load_state(other, data) as restored:
        assert restored.position == len(ctx.tokenize(PROMPT)) + 1
        assert np.array_equal(restored.logits, logits)
        assert [restored.produce().token] == expected
        assert other.kv_seq_pos_max(restored.seq_id) == restored.position - 1


def test_grammar_constrains_generation(ctx: lloyal.Context) -> None:
    gbnf = 'root ::= "yes" | "no"'
    with Branch.create(ctx, 0, GREEDY, grammar=gbnf) as b:
        b.prefill(ctx.tokenize("Answer:"))
        out = [t.token for t in b.generate(10)]
        assert ctx.detokenize(out) in ("yes", "no")
        assert b.produce().is_stop
        bad = ctx.tokenize(" maybe", add_special=False)[0]
        pos = b.position
        with pytest.raises(lloyal.GrammarError, match="not allowed"):
            b.commit(bad)
        assert b.position == pos


# --------------------------------------------------------------------------- chat


def test_format_chat_uses_the_gguf_template(fam: Fam, ctx: lloyal.Context) -> None:
    chat = ctx.format_chat([QUESTION])
    assert chat.template_source == "model"
    assert chat.prompt == FIRST_PROMPT[fam.name]
    assert list(chat.stop_tokens) == [fam.id(t) for t in STOPS[fam.name]]
    assert all(ctx.is_stop_token(t) for t in chat.stop_tokens)


def test_turn_separator_and_stop_tokens(fam: Fam, ctx: lloyal.Context) -> None:
    assert ctx.turn_separator == [fam.id(t) for t in SEPARATOR[fam.name]]
    eos = fam.id(fam.spec.eos)
    assert ctx.is_stop_token(eos) and ctx.is_stop_token(ctx.eog_token)
    if fam.spec.eot is not None and fam.spec.eot != fam.spec.eos:
        assert ctx.eog_token != eos  # EOS differs from EOT: both end generation
    # A branch forced onto a stop token stops: produce says so and generate yields nothing.
    for stop in {eos, ctx.eog_token}:
        with Branch.create(ctx, 0, GREEDY) as b:
            b.prefill(ctx.tokenize(PROMPT))
            b.set_logit_bias({stop: 1e4})
            p = b.produce()
            assert (p.token, p.is_stop) == (stop, True)
            assert list(b.generate(5)) == []
            assert b.position == len(ctx.tokenize(PROMPT))


def test_warm_multi_turn_equals_cold_prefill(fam: Fam, ctx: lloyal.Context) -> None:
    first = encode(ctx, ctx.format_chat([QUESTION]).prompt)
    answer = ctx.tokenize(ANSWER, add_special=False)
    turn = ctx.format_chat_turn(FOLLOW_UP)
    assert turn.prompt == TURN_PROMPT[fam.name]
    delta = ctx.turn_separator + encode(ctx, turn.prompt)
    full_chat = ctx.format_chat([QUESTION, {"role": "assistant", "content": ANSWER}, FOLLOW_UP])
    full = encode(ctx, full_chat.prompt)
    assert full == first + answer + delta  # token for token
    with Branch.create(ctx, 0, GREEDY) as warm:
        warm.prefill(first)
        for t in answer:
            warm.commit(t)
        warm.prefill(delta)
        assert warm.position == len(full)
        warm_logits = warm.logits
        warm_tokens = [t.token for t in warm.generate(4)]
    with Branch.create(ctx, 0, GREEDY) as cold:
        cold.prefill(full)
        assert np.array_equal(cold.logits, warm_logits)
        cold_tokens = [t.token for t in cold.generate(4)]
    assert warm_tokens == cold_tokens


# --------------------------------------------------------------------------- embeddings and the CLI


def test_pooled_model_embeds_with_its_own_pooling() -> None:
    fam = load("qwen3-embed")
    texts = ["The capital of France is Paris.", "Hello, world!"]
    results = {}
    for pooling in (None, "last", "mean"):
        with lloyal.Context(fam.model, n_ctx=256, embeddings=True, pooling=pooling) as c:
            assert c.embedding_dimension == 128
            results[pooling] = c.embed(texts)
    assert results[None].shape == (2, 128)
    assert np.allclose(np.linalg.norm(results[None], axis=1), 1.0, atol=1e-5)
    # The GGUF declares last-token pooling (as Qwen3-Embedding does); the default follows it.
    assert np.array_equal(results[None], results["last"])
    assert not np.allclose(results[None], results["mean"], atol=1e-3)


def test_unpooled_model_defaults_to_mean_pooling(fam: Fam) -> None:
    text = "Hello, world!"
    with lloyal.Context(fam.model, n_ctx=256, embeddings=True) as c:
        default = c.embed(text)
    with lloyal.Context(fam.model, n_ctx=256, embeddings=True, pooling="mean") as c:
        assert np.array_equal(default, c.embed(text))


def test_chat_example_runs_warm_on_each_family(fam: Fam, ctx: lloyal.Context) -> None:
    """examples/chat.py --model: the second turn prefills only the separator and the new turn."""
    hello, again = "Hello there", "And again?"
    args = ["--model", str(fam.path), "--max-tokens", "4", "--seed", "1"]
    events = run_example_jsonl("chat", *args, stdin=f"{hello}\n{again}\n")
    turns = [e for e in events if e["event"] == "turn"]
    assert [t["user"] for t in turns] == [hello, again]
    first = encode(ctx, ctx.format_chat([{"role": "user", "content": hello}]).prompt)
    turn = ctx.format_chat_turn({"role": "user", "content": again}).prompt
    second = ctx.turn_separator + encode(ctx, turn)
    assert (turns[0]["prefilled"], turns[1]["prefilled"]) == (len(first), len(second))
    for before, t in zip([0, turns[0]["position"]], turns, strict=True):
        assert 0 <= t["reply_tokens"] <= 4
        assert t["position"] == before + t["prefilled"] + t["reply_tokens"]


@pytest.mark.parametrize("name", [*CHAT, "qwen3-embed"])
def test_cli_info(name: str) -> None:
    path = family_path(name)
    proc = subprocess.run(
        [sys.executable, "-m", "lloyal", "info", "--model", str(path), "--jsonl"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    spec = FAMILIES[name]
    assert facts["architecture"] == spec.arch
    assert facts["name"] == f"lloyal-tiny-{name}"
    assert (facts["n_vocab"], facts["n_embd"], facts["n_layer"]) == (len(vocab(name)), 128, 2)
    assert facts["chat_template"] is (spec.template is not None)


def test_float_weights_are_not_batch_invariant() -> None:
    """F32/F16/BF16 weights go through llamafile's sgemm for 2+ rows, a dot product for one:
    the context says so (batch_invariant resolves to False, True is refused with the reason)."""
    fam = load("llama3-f32")
    with pytest.raises(ValueError, match="weights are F32"):
        lloyal.Context(fam.model, n_ctx=256, batch_invariant=True)
    with lloyal.Context(fam.model, n_ctx=256, n_batch=64, n_seq_max=4) as c:
        assert not c.batch_invariant and c.type_k == "f16"
        pairs = batched_and_single_logits(c)
        for batched, alone in pairs:
            assert np.allclose(alone, batched, atol=1e-4)  # the same maths, other rounding
        assert any(not np.array_equal(alone, batched) for batched, alone in pairs)
