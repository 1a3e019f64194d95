"""Context: properties, lifecycle, closed-context errors, option validation."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import THP_COLLAPSE

import lloyal
from lloyal import _lloyal


def test_properties(exact_model: lloyal.Model) -> None:
    with lloyal.Context(exact_model, n_ctx=768, n_batch=128, n_seq_max=3, n_threads=1) as ctx:
        assert (ctx.n_ctx, ctx.n_batch, ctx.n_seq_max, ctx.n_threads) == (768, 128, 3, 1)
        assert ctx.n_vocab == ctx.vocab_size == exact_model.n_vocab == 262144
        # Batch-invariant by default: q8_0 K (8 blocks of 34 bytes per 256-wide head) and f16 V
        # (2 * 256 bytes), 1 KV head, 18 layers per cell.
        assert (ctx.batch_invariant, ctx.type_k, ctx.type_v) == (True, "q8_0", "f16")
        assert ctx.memory_size == 768 * (8 * 34 + 2 * 256) * 18
        assert ctx.closed is False
        assert ctx.flash_attn and not ctx.embeddings
        assert ctx.model.architecture == "gemma3"
        assert ctx.model.path == exact_model.path
        assert "n_ctx=768" in repr(ctx)
    assert ctx.closed is True


def test_defaults(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256) as ctx:
        assert ctx.n_batch == 256  # llama.cpp caps n_batch at n_ctx
        assert ctx.n_seq_max == 1
        assert ctx.n_threads >= 1
    with lloyal.Context(model, n_ctx=1024) as ctx:
        assert ctx.n_batch == 512


def test_memory_size_follows_cache_type(model: lloyal.Model) -> None:
    with (
        lloyal.Context(model, n_ctx=256, type_k="f16", type_v="f16") as f16,
        lloyal.Context(model, n_ctx=256, type_k="f32", type_v="f32") as f32,
        lloyal.Context(model, n_ctx=512) as big,
    ):
        assert f16.memory_size > 0
        # f16 K and V, 256-wide heads, 1 KV head, 18 layers: 2 * 2 * 256 * 18 bytes per cell.
        assert f16.memory_size == 256 * 2 * 2 * 256 * 18
        assert f32.memory_size == 2 * f16.memory_size
        assert big.memory_size == 2 * lloyal.Context(model, n_ctx=256).memory_size


def test_context_manager_closes_on_exception(model: lloyal.Model) -> None:
    with pytest.raises(RuntimeError, match="boom"), lloyal.Context(model, n_ctx=256) as ctx:
        assert ctx.closed is False
        raise RuntimeError("boom")  # the exception is not swallowed
    assert ctx.closed is True


def calls_after_close(ctx: lloyal.Context) -> list[Callable[[], object]]:
    return [
        lambda: ctx.decode([5], 2),
        lambda: ctx.decode([], 0),
        lambda: ctx.sample(),
        lambda: ctx.sample(temperature=0),
        lambda: ctx.reset_sampler(),
        lambda: ctx.get_logits(),
        lambda: ctx.tokenize("x"),
        lambda: ctx.detokenize([5]),
        lambda: ctx.token_to_text(5),
        lambda: ctx.text_stream(),
        lambda: ctx.is_stop_token(5),
        lambda: ctx.kv_cache_size(),
        lambda: ctx.kv_seq_pos_max(0),
        lambda: ctx.kv_cache_clear(),
        lambda: ctx.kv_cache_remove(0, 0),
        lambda: ctx.kv_seq_copy(0, 0),
        lambda: ctx.kv_seq_keep(0),
        lambda: ctx.model_entropy(),
        lambda: ctx.model_surprisal(5),
        lambda: ctx.clear_and_reseed([2], [100]),
        lambda: ctx.memory_size,
        lambda: lloyal.Branch.create(ctx),
        lambda: lloyal.BranchStore(ctx),  # refused as it is made, not at first use
        lambda: _lloyal.PrefixCache(ctx),
        lambda: _lloyal.Admission(ctx, 4),
    ]


def test_close_is_idempotent_and_everything_after_raises(model: lloyal.Model) -> None:
    ctx = lloyal.Context(model, n_ctx=256)
    ctx.decode([2, 100], 0)
    ctx.close()
    assert ctx.closed is True
    ctx.close()
    with ctx:  # entering a closed context is harmless; exiting closes again (idempotent)
        pass
    assert ctx.closed is True
    for i, call in enumerate(calls_after_close(ctx)):
        with pytest.raises(lloyal.ContextClosedError, match="closed") as exc:
            call()
        assert isinstance(exc.value, lloyal.LloyalError), i
    # Facts fixed at creation stay readable.
    assert ctx.n_ctx == 256 and ctx.n_vocab == 262144


def test_create_perplexity_tracker_after_close_raises(model: lloyal.Model) -> None:
    ctx = lloyal.Context(model, n_ctx=256)
    ctx.close()
    with pytest.raises(lloyal.ContextClosedError):
        ctx.create_perplexity_tracker()


def test_a_text_stream_outlives_its_context(model: lloyal.Model) -> None:
    ctx = lloyal.Context(model, n_ctx=256)
    tokens = ctx.tokenize("🦙!", add_special=False)
    stream = ctx.text_stream()
    ctx.close()
    assert "".join(stream.push(t) for t in tokens) == "🦙!"


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"n_seq_max": 0}, "n_seq_max"),
        ({"n_seq_max": 300}, "n_seq_max"),
        ({"n_seq_max": 257}, "n_seq_max"),
        ({"type_k": "f8"}, "type_k"),
        ({"type_v": "zz"}, "type_v"),
        ({"pooling": "max"}, "pooling"),
        ({"n_batch": 0}, "n_batch"),
        ({"n_ctx": 4}, "n_ctx"),
        ({"n_threads": 0}, "n_threads"),
        ({"type_v": "q8_0", "flash_attn": False}, "flash_attn"),
    ],
)
def test_bad_options_raise_value_error(model: lloyal.Model, options: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        lloyal.Context(model, **{"n_ctx": 256, **options})  # type: ignore[arg-type]
    assert needle in str(exc.value)


@pytest.mark.parametrize("option", ["n_seq_max", "n_ctx", "n_batch"])
def test_negative_sizes_raise_value_error(model: lloyal.Model, option: str) -> None:
    with pytest.raises(ValueError, match=option):
        lloyal.Context(model, **{option: -1})  # type: ignore[arg-type]


def test_a_cache_too_large_to_allocate_raises_out_of_memory(model: lloyal.Model) -> None:
    """A hundred million cells (hundreds of GB of KV cache): llama.cpp's failed allocation is an
    ``OutOfMemoryError`` (also a ``MemoryError``) naming the shape and what to shrink, and the
    process goes on making contexts."""
    with pytest.raises(lloyal.OutOfMemoryError, match=r"n_ctx=100000000,.*try a smaller n_ctx") as e:
        lloyal.Context(model, n_ctx=10**8)  # fails at once (10**7 took 47 s to fail here)
    assert isinstance(e.value, MemoryError) and isinstance(e.value, lloyal.LloyalError)
    with lloyal.Context(model, n_ctx=256) as ctx:
        ctx.decode(ctx.tokenize("Hello"), 0)
        assert ctx.kv_cache_size() > 0


def test_edge_options_are_accepted(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256, n_seq_max=256) as ctx:
        assert ctx.n_seq_max == 256
    with lloyal.Context(model, n_ctx=256, type_k="q8_0", type_v="q8_0") as ctx:
        ctx.decode([2, 100], 0)
        assert ctx.kv_cache_size() == 1


def test_create_context_and_path(model: lloyal.Model, model_path: Path) -> None:
    with lloyal.create_context(n_ctx=256) as ctx:
        assert ctx.n_ctx == 256
        assert ctx.model.path == model.path
    with lloyal.create_context(model_path, n_ctx=256, n_seq_max=2) as ctx:
        assert ctx.n_seq_max == 2
    with lloyal.create_context(str(model_path), n_ctx=256) as ctx:
        toks = ctx.tokenize("Hello")
        ctx.decode(toks, 0)
        assert ctx.kv_cache_size() == len(toks) - 1
    with lloyal.Context(str(model_path), n_ctx=256) as ctx:
        assert ctx.model.n_vocab == 262144
    with lloyal.Context(model_path, n_ctx=256) as ctx:
        assert ctx.model.architecture == "gemma3"
    with lloyal.Context.from_path(model_path, n_ctx=256) as ctx:
        assert ctx.n_ctx == 256
    with pytest.raises(ValueError, match="n_seq_max"):
        lloyal.create_context(n_ctx=256, n_seq_max=0)


def test_two_contexts_are_independent(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256) as a, lloyal.Context(model, n_ctx=512) as b:
        assert a.model.path == b.model.path
        ta = a.tokenize("The capital of France is")
        a.decode(ta, 0)
        assert b.kv_cache_size() == -1  # b's cache is its own
        with pytest.raises(lloyal.LloyalError):
            b.get_logits()  # and so are its logits
        tb = b.tokenize("Once upon a time")
        b.decode(tb, 0)
        assert a.kv_cache_size() == len(ta) - 1
        assert b.kv_cache_size() == len(tb) - 1
        assert not (a.get_logits() == b.get_logits()).all()
        a.close()
        assert a.closed and not b.closed
        b.decode([5], len(tb))  # b survives a's close
        assert b.kv_cache_size() == len(tb)


_HUGE_LOGITS = """
import json, sys
from pathlib import Path
import lloyal

def anon_huge():
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) << 10
    return 0

model = lloyal.Model(sys.argv[1], repack=False, n_gpu_layers=0)
before = anon_huge()
with lloyal.Context(model, n_ctx=256, n_seq_max=8) as c:
    made, made_huge = c.huge_page_bytes, anon_huge()
    c.decode(c.tokenize("Hello"), 0)
    decoded = c.huge_page_bytes
    b = lloyal.Branch.create(c, 0, lloyal.SamplingParams())
    b.score(c.tokenize("One two three four five six seven eight nine ten eleven twelve"))
    print(json.dumps([before, made, made_huge, decoded, c.huge_page_bytes, c.n_vocab]))
"""


def test_logits_buffer_is_put_on_huge_pages(model_path: Path) -> None:
    """As the context is made, llama.cpp's logits buffer (every sequence's row, one MiB each
    for Gemma 3) is put on 2 MiB pages where the kernel can collapse them: all but the partial
    huge pages at its two ends, as /proc/self/smaps_rollup shows (in a fresh process, where no
    freed memory already on huge pages can back the buffer). Not in the first decode, whose
    time would then be the collapse's. A decode with more output rows than sequences (a scored
    prompt) moves the buffer: again only its first ``n_seq_max`` rows are collapsed."""
    argv = [sys.executable, "-c", _HUGE_LOGITS, str(model_path)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    before, made, made_huge, decoded, scored, n_vocab = json.loads(run.stdout.splitlines()[-1])
    if not THP_COLLAPSE:
        assert made == decoded == scored == 0
        return
    rows = 8 * n_vocab * 4
    assert rows - 4 * 2**20 <= made <= rows  # with the context, before any decode
    assert made_huge - before >= made
    assert decoded == made  # the same buffer at the first decode: nothing more to do
    assert rows - 4 * 2**20 <= scored <= rows  # the moved buffer: its first 8 rows only
