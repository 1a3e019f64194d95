"""The GIL is released during model calls; one context serialises callers; contexts run in parallel."""

from __future__ import annotations

import threading
import time

import lloyal


def test_other_thread_progresses_during_long_decode(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=2048) as ctx:
        tokens = [1000 + (i * 7) % 3000 for i in range(1500)]
        done = threading.Event()
        worker = threading.Thread(target=lambda: (ctx.decode(tokens, 0), done.set()))
        ticks = 0
        worker.start()
        while not done.is_set():
            ticks += 1
            time.sleep(0)  # a pure-Python loop: runs only while the decode has released the GIL
        worker.join()
        assert ctx.kv_cache_size() == 1499
        assert ticks > 1000, f"main thread only ran {ticks} iterations during the decode"


def branch_greedy(ctx: lloyal.Context, prompt: str, n: int = 8) -> list[int]:
    b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
    b.prefill(ctx.tokenize(prompt))
    out = []
    for _ in range(n):
        t = b.sample()
        b.commit(t)
        out.append(t)
    b.prune()
    return out


def test_threads_sharing_one_context_get_correct_results(model: lloyal.Model) -> None:
    prompts = ["The capital of France is", "Water boils at", "My favourite colour is", "Rust is a"]
    with lloyal.Context(model, n_ctx=1024, n_seq_max=4) as ref:
        expected = [branch_greedy(ref, p) for p in prompts]
    with lloyal.Context(model, n_ctx=1024, n_seq_max=4) as ctx:
        results: dict[int, list[int]] = {}
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, branch_greedy(ctx, prompts[i])))
            for i in range(len(prompts))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert lloyal.BranchStore(ctx).available == 4
    assert [results[i] for i in range(len(prompts))] == expected


def test_two_contexts_decode_concurrently(model: lloyal.Model) -> None:
    tokens = [1000 + i for i in range(300)]
    with (
        lloyal.Context(model, n_ctx=512, n_threads=1) as a,
        lloyal.Context(model, n_ctx=512, n_threads=1) as b,
    ):
        errors: list[BaseException] = []

        def work(c: lloyal.Context) -> None:
            try:
                c.decode(tokens, 0)
                c.decode([5], len(tokens))
            except BaseException as e:  # reported below
                errors.append(e)

        ts = [threading.Thread(target=work, args=(c,)) for c in (a, b)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors
        assert a.kv_cache_size() == b.kv_cache_size() == 300
        assert (a.get_logits() == b.get_logits()).all()
