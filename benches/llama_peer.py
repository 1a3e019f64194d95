"""The llama-cpp-python peer for benchmarks: its high-level API and a raw llama.cpp loop
through its low-level bindings (bench-only; never a runtime or test dependency)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest


def import_llama_cpp() -> Any:
    """The llama_cpp module, or skip (install with `pip install 'lloyal[bench]'`)."""
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python not installed (pip install 'lloyal[bench]')"
    )


def high_level(model_path: Path, n_ctx: int, threads: int) -> Any:
    llama_cpp = import_llama_cpp()
    return llama_cpp.Llama(str(model_path), n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False)


class RawLoop:
    """Greedy/sampled decoding straight on llama.cpp's C API (llama_batch + sampler chains)."""

    def __init__(self, model_path: Path, n_ctx: int, n_seq: int, threads: int) -> None:
        self.ll = import_llama_cpp()
        ll = self.ll
        ll.llama_backend_init()
        mp = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(str(model_path).encode(), mp)
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 512, 512, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified, cp.swa_full = True, True
        self.ctx = ll.llama_init_from_model(self.model, cp)
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.batch = ll.llama_batch_init(512, 0, 1)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, pos, seq_id, want_logits)."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(rows)
        rc = self.ll.llama_decode(self.ctx, b)
        assert rc == 0, f"llama_decode returned {rc}"

    def sampler(self, seed: int, temperature: float, top_k: int, top_p: float, min_p: float) -> Any:
        ll = self.ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if temperature <= 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
            return chain
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(top_k))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(top_p, 1))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(min_p, 1))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(temperature))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))
        return chain

    def sample(self, chain: Any, row: int) -> int:
        return int(self.ll.llama_sampler_sample(chain, self.ctx, row))

    def seq_cp(self, src: int, dst: int) -> None:
        mem = self.ll.llama_get_memory(self.ctx)
        self.ll.llama_memory_seq_cp(mem, src, dst, -1, -1)

    def seq_rm(self, seq: int) -> None:
        mem = self.ll.llama_get_memory(self.ctx)
        self.ll.llama_memory_seq_rm(mem, seq, -1, -1)

    def clear(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def is_eog(self, token: int) -> bool:
        return bool(self.ll.llama_vocab_is_eog(self.vocab, ctypes.c_int32(token)))

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)
