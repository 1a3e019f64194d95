"""Flat KV state (docs/api.md, "Context", State): kv_cache_save/load and write_file/read_file round
trips onto fresh contexts and other sequences, and rejection of truncated, corrupt, random
and foreign bytes (target left empty, other sequences untouched). Real default model."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

import lloyal
from lloyal import Branch, SamplingParams

PROMPT = "The capital of France is Paris. The capital of Germany is"
HEADER_LEN = 84


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def reseal(data: bytes, offset: int, field: bytes) -> bytes:
    """Overwrite a header field and recompute the trailing checksum."""
    body = bytearray(data[:-8])
    body[offset : offset + len(field)] = field
    return bytes(body) + struct.pack("<Q", fnv1a64(bytes(body)))


def continuation(ctx: lloyal.Context, tokens: list[int], seq_id: int, n: int = 5) -> list[int]:
    """Decode the prompt's last token, then ``n`` greedy tokens on ``seq_id``."""
    pos = len(tokens) - 1
    ctx.decode([tokens[-1]], pos, seq_id)
    out = []
    for _ in range(n):
        t = ctx.sample(temperature=0)
        out.append(t)
        pos += 1
        ctx.decode([t], pos, seq_id)
    return out


@pytest.fixture
def saved(model: lloyal.Model) -> tuple[list[int], bytes, list[int]]:
    """(prompt tokens, state of all but the last token on seq 0, greedy continuation)."""
    with lloyal.Context(model, n_ctx=512) as c:
        tokens = c.tokenize(PROMPT)
        c.decode(tokens[:-1], 0)
        data = c.kv_cache_save(0)
        assert data[:8] == b"LLOYALKV"
        assert struct.unpack_from("<iiI", data, 64) == (0, len(tokens) - 2, 0)
        return tokens, data, continuation(c, tokens, 0)


def test_load_into_fresh_context_and_other_sequence(
    model: lloyal.Model, saved: tuple[list[int], bytes, list[int]]
) -> None:
    tokens, data, expected = saved
    with lloyal.Context(model, n_ctx=512) as c:
        c.kv_cache_load(0, data)
        assert c.kv_seq_pos_max(0) == len(tokens) - 2
        assert continuation(c, tokens, 0) == expected
    with lloyal.Context(model, n_ctx=512, n_seq_max=2) as c:
        other = c.tokenize("Unrelated text on seq zero")
        c.decode(other, 0, seq_id=0)
        c.kv_cache_load(1, data)
        assert c.kv_seq_pos_max(1) == len(tokens) - 2
        assert c.kv_seq_pos_max(0) == len(other) - 1, "seq 0 untouched"
        assert continuation(c, tokens, 1) == expected
        # Loading over a non-empty sequence replaces it.
        c.kv_cache_load(1, data)
        assert c.kv_seq_pos_max(1) == len(tokens) - 2


def test_file_round_trip(
    model: lloyal.Model, saved: tuple[list[int], bytes, list[int]], tmp_path: Path
) -> None:
    tokens, data, expected = saved
    path = tmp_path / "state.lkv"
    with lloyal.Context(model, n_ctx=512) as c:
        c.kv_cache_load(0, data)
        c.kv_cache_write_file(0, path, tokens[:-1])
        assert not [p for p in tmp_path.iterdir() if p != path], "no temporary file left behind"
    with lloyal.Context(model, n_ctx=512, n_seq_max=2) as c:
        assert c.kv_cache_read_file(1, str(path)) == tokens[:-1]
        assert c.kv_seq_pos_max(1) == len(tokens) - 2
        assert continuation(c, tokens, 1) == expected
        with pytest.raises(FileNotFoundError, match=r"missing\.lkv") as missing:
            c.kv_cache_read_file(0, tmp_path / "missing.lkv")
        assert missing.value.filename == str(tmp_path / "missing.lkv")  # as open() names it
        with pytest.raises(FileNotFoundError, match="no-such-dir"):
            c.kv_cache_write_file(0, tmp_path / "no-such-dir" / "x.lkv", tokens[:-1])
        with pytest.raises(lloyal.InvalidTokenError):
            c.kv_cache_write_file(0, path, [10**7])


def test_threads_writing_one_path_each_write_whole_files(
    model: lloyal.Model, saved: tuple[list[int], bytes, list[int]], tmp_path: Path
) -> None:
    """Each write has a temporary file of its own (they shared one per process: a rename took
    another thread's file, FileNotFoundError in 14 of 30 writes)."""
    import threading

    tokens, data, _ = saved
    path = tmp_path / "same.lkv"
    errors: list[BaseException] = []
    with lloyal.Context(model, n_ctx=512) as c:
        c.kv_cache_load(0, data)

        def write() -> None:
            try:
                for _ in range(15):
                    c.kv_cache_write_file(0, path, tokens[:5])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and [p.name for p in tmp_path.iterdir()] == ["same.lkv"]
        assert c.kv_cache_read_file(0, path) == tokens[:5]


def test_a_load_into_a_full_cache_is_kv_cache_full(
    model: lloyal.Model, saved: tuple[list[int], bytes, list[int]]
) -> None:
    """Other sequences hold the cells: the data was fine, so not StateError; the target is left
    empty and the others untouched."""
    tokens, data, _ = saved
    with lloyal.Context(model, n_ctx=256, n_seq_max=2) as c:
        filler = (tokens * 100)[: c.n_ctx - 3]  # fewer free cells than the state holds
        c.decode(filler, 0, seq_id=1)
        with pytest.raises(lloyal.KvCacheFullError, match="no run of"):
            c.kv_cache_load(0, data)
        assert c.kv_cache_size(0) == -1 and c.kv_seq_pos_max(1) == len(filler) - 1


def bad_inputs(data: bytes) -> dict[str, bytes]:
    rng = random.Random(7)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    n_embd = struct.unpack_from("<i", data, 16)[0]
    return {
        "truncated": data[:-1],
        "header only": data[:HEADER_LEN],
        "empty": b"",
        "flipped payload byte": bytes(flipped),
        "random": rng.randbytes(len(data)),
        "random with magic": b"LLOYALKV" + rng.randbytes(200),
        "trailing byte": data + b"\0",
        "other n_embd": reseal(data, 16, struct.pack("<i", n_embd + 128)),
        "other architecture": reseal(data, 32, b"llama".ljust(32, b"\0")),
        "version 2": reseal(data, 8, struct.pack("<I", 2)),
    }


def test_bad_bytes_leave_target_empty_and_others_untouched(
    model: lloyal.Model, saved: tuple[list[int], bytes, list[int]], tmp_path: Path
) -> None:
    _, data, _ = saved
    with lloyal.Context(model, n_ctx=512, n_seq_max=2) as c:
        other = c.tokenize("Another sequence")
        c.decode(other, 0, seq_id=0)
        for name, bad in bad_inputs(data).items():
            c.kv_cache_load(1, data)  # the target holds cells before each failed load
            with pytest.raises(lloyal.StateError):
                c.kv_cache_load(1, bad)
            assert c.kv_seq_pos_max(1) == -1, name
            assert c.kv_seq_pos_max(0) == len(other) - 1, name
        path = tmp_path / "bad.lkv"
        path.write_bytes(data[:-3])
        c.kv_cache_load(1, data)
        with pytest.raises(lloyal.StateError, match="truncated"):
            c.kv_cache_read_file(1, path)
        assert c.kv_seq_pos_max(1) == -1
        assert c.kv_seq_pos_max(0) == len(other) - 1


def test_error_messages(model: lloyal.Model, saved: tuple[list[int], bytes, list[int]]) -> None:
    _, data, _ = saved
    bad = bad_inputs(data)
    with lloyal.Context(model, n_ctx=512) as c:
        for name, pattern in [
            ("truncated", "truncated"),
            ("random", "magic"),
            ("flipped payload byte", "checksum"),
            ("other n_embd", "different model"),
            ("other architecture", "different model"),
            ("version 2", "version 2"),
        ]:
            with pytest.raises(lloyal.StateError, match=pattern):
                c.kv_cache_load(0, bad[name])


def test_cache_type_mismatch_is_rejected_by_llama(
    model: lloyal.Model, saved: tuple[list[int], bytes, list[int]]
) -> None:
    _, data, _ = saved
    # Saved from a default context (batch-invariant: q8_0 K; on a GPU: f16); this one keeps K in
    # the other type.
    with lloyal.Context(model, n_ctx=64) as probe:
        other = "f16" if probe.type_k == "q8_0" else "q8_0"
    with lloyal.Context(model, n_ctx=512, type_k=other, type_v="f16") as c:
        with pytest.raises(lloyal.StateError, match=r"llama\.cpp rejected"):
            c.kv_cache_load(0, data)
        assert c.kv_seq_pos_max(0) == -1


def test_leased_sequence_and_range(model: lloyal.Model, saved: tuple[list[int], bytes, list[int]]) -> None:
    tokens, data, _ = saved
    with lloyal.Context(model, n_ctx=512, n_seq_max=2) as c:
        branch = Branch.create(c, 0, SamplingParams(temperature=0))
        branch.prefill(tokens[:3])
        with pytest.raises(lloyal.SeqLeasedError):
            c.kv_cache_load(0, data)
        assert c.kv_seq_pos_max(0) == 2, "the branch's cells are untouched"
        assert c.kv_cache_save(0)[:8] == b"LLOYALKV", "saving a branch's sequence is allowed"
        with pytest.raises(ValueError, match="n_seq_max"):
            c.kv_cache_load(5, data)
        with pytest.raises(ValueError, match="n_seq_max"):
            c.kv_cache_save(-1)
        branch.prune()
    c2 = lloyal.Context(model, n_ctx=512)
    c2.close()
    with pytest.raises(lloyal.ContextClosedError):
        c2.kv_cache_save(0)
    with pytest.raises(lloyal.ContextClosedError):
        c2.kv_cache_load(0, data)


def test_empty_sequence_round_trip(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256) as c:
        data = c.kv_cache_save(0)
        c.decode(c.tokenize("x"), 0)
        c.kv_cache_load(0, data)
        assert c.kv_seq_pos_max(0) == -1
