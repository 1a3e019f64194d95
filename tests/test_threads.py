"""docs/api.md ("Threads and the GIL"): model calls release the GIL; one context serialises its
callers (one lock per context); different contexts run in parallel."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import exact_model_fixture

import lloyal

# On the CPU on a GPU run too: these tests need decodes long enough to watch (0.06 s on a GPU).
model = exact_model_fixture()


PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "Water boils at a temperature of one hundred degrees and freezes at",
]


def run_threads(*targets: Callable[[], object]) -> list[BaseException]:
    """Run each target in its own thread; return the exceptions they raised."""
    errors: list[BaseException] = []

    def wrap(f: Callable[[], object]) -> Callable[[], None]:
        def inner() -> None:
            try:
                f()
            except BaseException as e:  # reported by the caller
                errors.append(e)

        return inner

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung"
    return errors


def test_other_thread_progresses_during_long_decode(model: lloyal.Model) -> None:
    """A tight pure-Python loop in the main thread keeps running while another thread decodes
    1024 tokens. Were the GIL held during the decode, the loop would stall for the whole decode:
    (almost) no iterations, and one gap as long as the decode. The loop watches the first
    second of the decode (the decode takes several seconds on 2 CPU cores), then waits."""
    with lloyal.Context(model, n_ctx=2048, n_batch=512) as ctx:
        tokens = [1000 + (i * 7) % 3000 for i in range(1024)]
        started, done = threading.Event(), threading.Event()
        span: list[float] = []

        def work() -> None:
            started.set()
            t0 = time.perf_counter()
            ctx.decode(tokens, 0)
            span.append(time.perf_counter() - t0)
            done.set()

        worker = threading.Thread(target=work)
        worker.start()
        assert started.wait(30)
        ticks = 0
        first = last = time.perf_counter()
        max_gap = 0.0
        while not done.is_set() and last - first < 1.0:
            now = time.perf_counter()
            max_gap = max(max_gap, now - last)
            last = now
            ticks += 1
        still_decoding = not done.is_set()
        watched = last - first
        worker.join()
        (decode_s,) = span
        assert ctx.kv_cache_size() == 1023
        assert still_decoding or decode_s > 0.2, f"the decode took only {decode_s:.2f}s: too short to tell"
        assert ticks > 1000, f"main thread ran {ticks} loops in {watched:.2f}s of a {decode_s:.1f}s decode"
        assert max_gap < min(0.5, decode_s / 3), f"main stalled {max_gap:.2f}s ({decode_s:.1f}s decode)"


def flat_greedy(ctx: lloyal.Context, seq_id: int, prompt: str, n: int, lock: threading.Lock) -> list[int]:
    """Greedy generation on one sequence with the flat path. The flat path keeps one logits
    snapshot per context, so each decode+sample pair is made atomic with ``lock``."""
    toks = ctx.tokenize(prompt)
    out: list[int] = []
    with lock:
        ctx.decode(toks, 0, seq_id)
        t = ctx.sample(temperature=0)
    pos = len(toks)
    for _ in range(n):
        out.append(t)
        with lock:
            ctx.decode([t], pos, seq_id)
            t = ctx.sample(temperature=0)
        pos += 1
    return out


def test_two_threads_share_one_context_on_their_own_sequences(model: lloyal.Model) -> None:
    n = 6
    with lloyal.Context(model, n_ctx=512, n_seq_max=2) as ref:
        lock = threading.Lock()
        expected = [flat_greedy(ref, s, PROMPTS[s], n, lock) for s in (0, 1)]
        assert expected[0] != expected[1]

    with lloyal.Context(model, n_ctx=512, n_seq_max=2) as ctx:
        lock = threading.Lock()
        results: dict[int, list[int]] = {}
        gate = threading.Barrier(2)

        def job(s: int) -> None:
            gate.wait()
            results[s] = flat_greedy(ctx, s, PROMPTS[s], n, lock)

        errors = run_threads(lambda: job(0), lambda: job(1))
        assert not errors, errors
        assert [results[0], results[1]] == expected
        for s in (0, 1):
            assert ctx.kv_seq_pos_max(s) == len(ctx.tokenize(PROMPTS[s])) + n - 1


def test_concurrent_calls_on_one_context_are_serialised(model: lloyal.Model) -> None:
    """Without any lock of ours, two threads decode prompts on seqs 0 and 1 and tokenize in a
    loop at the same time: the context's own lock keeps every call whole."""
    with lloyal.Context(model, n_ctx=512, n_seq_max=2) as ctx:
        prompts = [ctx.tokenize(p) for p in PROMPTS]
        assert all(len(p) > 8 for p in prompts)
        gate = threading.Barrier(2)
        seen: dict[int, set[tuple[int, ...]]] = {0: set(), 1: set()}

        def job(s: int) -> None:
            gate.wait()
            for i in range(4):
                ctx.decode(prompts[s][i * 2 : i * 2 + 2], i * 2, s)
                seen[s].add(tuple(ctx.tokenize(PROMPTS[s])))

        errors = run_threads(lambda: job(0), lambda: job(1))
        assert not errors, errors
        assert seen == {0: {tuple(prompts[0])}, 1: {tuple(prompts[1])}}
        assert ctx.kv_seq_pos_max(0) == ctx.kv_seq_pos_max(1) == 7
        # Each sequence holds exactly its own tokens: finishing the prompts sequentially gives
        # the same greedy token as a context that never saw threads.
        got = []
        for s in (0, 1):
            ctx.decode(prompts[s][8:], 8, s)
            got.append(ctx.sample(temperature=0))
    with lloyal.Context(model, n_ctx=512) as ref:
        want = []
        for p in prompts:
            ref.kv_cache_clear()
            ref.decode(p, 0)
            want.append(ref.sample(temperature=0))
    assert got == want


def branch_greedy(ctx: lloyal.Context, prompt: str, n: int = 6, prune: bool = True) -> list[int]:
    b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
    b.prefill(ctx.tokenize(prompt))
    out = []
    for _ in range(n):
        t = b.sample()
        b.commit(t)
        out.append(t)
    if prune:
        b.prune()
    return out


def test_threads_with_branches_on_one_context_get_correct_results(model: lloyal.Model) -> None:
    """Branches keep their own logits, so threads need no lock of their own. The branches are
    pruned only after every thread is done: a prune mid-run frees cells that a still-running
    branch may then write into ahead of its own, which can move its logits (README "Numerics")."""
    prompts = ["The capital of France is", "Water boils at", "My favourite colour is", "Rust is a"]
    with lloyal.Context(model, n_ctx=1024, n_seq_max=4) as ref:
        expected = [branch_greedy(ref, p) for p in prompts]
    with lloyal.Context(model, n_ctx=1024, n_seq_max=4) as ctx:
        results: dict[int, list[int]] = {}
        errors = run_threads(
            *[
                lambda i=i: results.__setitem__(i, branch_greedy(ctx, prompts[i], prune=False))
                for i in range(len(prompts))
            ]
        )
        assert not errors, errors
        assert lloyal.BranchStore(ctx).available == 0  # all four still live; close() prunes them
    assert [results[i] for i in range(len(prompts))] == expected


def test_two_contexts_decode_in_parallel(model: lloyal.Model) -> None:
    """While context A runs a long decode, context B finishes a whole short generation:
    the contexts do not wait on each other."""
    long_tokens = [1000 + (i * 11) % 4000 for i in range(200)]
    with (
        lloyal.Context(model, n_ctx=512, n_threads=1) as a,
        lloyal.Context(model, n_ctx=512, n_threads=1) as b,
    ):
        prompt = b.tokenize(PROMPTS[0])
        b.decode(prompt, 0)
        pos, expected = len(prompt), []
        for _ in range(4):
            expected.append(b.sample(temperature=0))
            b.decode([expected[-1]], pos)
            pos += 1
        b.kv_cache_clear()

        a_started = threading.Event()
        finished: dict[str, float] = {}
        got: list[int] = []

        def long_job() -> None:
            a_started.set()
            a.decode(long_tokens, 0)
            finished["a"] = time.perf_counter()

        def short_job() -> None:
            assert a_started.wait(30)
            time.sleep(0.2)  # let A get into its decode
            b.decode(prompt, 0)
            p = len(prompt)
            for _ in range(4):
                got.append(b.sample(temperature=0))
                b.decode([got[-1]], p)
                p += 1
            finished["b"] = time.perf_counter()

        errors = run_threads(long_job, short_job)
        assert not errors, errors
        assert got == expected
        assert a.kv_cache_size() == 199
        assert finished["b"] < finished["a"], "B waited for A's decode: contexts are not parallel"


def thread_ids(name: str | None = None) -> set[str]:
    """The ids of this process's threads, or of those named ``name`` (``lloyal-engine``: the
    contexts' engine threads and the OpenMP workers of their decodes, which take the name of the
    thread that started them)."""
    return {t.name for t in Path("/proc/self/task").iterdir() if name is None or _comm(t) == name}


def _comm(task: Path) -> str | None:
    """A thread's name, or None when it ended since its task was listed (it is not alive)."""
    try:
        return (task / "comm").read_text().strip()
    except FileNotFoundError:
        return None


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_decode_threads_live_on_the_engine_thread_and_end_when_it_idles(model: lloyal.Model) -> None:
    """Every decode runs on the context's engine thread (the flat path's too), whose OpenMP
    workers end after 0.1 s without work: a context left open but idle keeps no pool that
    would make libgomp throttle the decodes of the others (docs/performance.md)."""
    # Engine threads of contexts other tests left to the garbage collector are not this one's.
    others = thread_ids("lloyal-engine")
    with lloyal.Context(model, n_ctx=256, n_seq_max=2, n_threads=2) as ctx:
        before = thread_ids()
        ctx.decode(ctx.tokenize("The capital of France is"), 0)
        busy = thread_ids("lloyal-engine") - others
        assert len(busy) == 2, busy  # the engine thread and the decode's second thread
        time.sleep(0.4)
        idle = thread_ids()
        (engine,) = busy & idle  # the worker ended; no pool on this (the caller's) thread either
        assert idle - before == {engine}
        branch = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
        prompt = ctx.tokenize("Water boils at")
        branch.prefill(prompt)
        again = thread_ids("lloyal-engine") - others
        assert engine in again and len(again) == 2, again  # a new worker for the new decode
        assert branch.position == len(prompt)
