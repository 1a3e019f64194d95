"""Ctrl-C (SIGINT) during a long prefill or generation raises ``KeyboardInterrupt`` after at most
the n_batch chunk being decoded, rolls the call back, and leaves the context working.

The signal comes from a timer thread (``os.kill(getpid(), SIGINT)``), as a terminal's Ctrl-C
would: Python's C-level handler only sets a flag, and the main thread, inside a native call
with the GIL released, runs the handler between two chunks."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from helpers import exact_model_fixture, produce_commit

import lloyal

# On the CPU on a GPU run too: these tests need decodes long enough to watch (0.06 s on a GPU).
model = exact_model_fixture()


N_BATCH = 32
LONG = [1000 + (i * 7) % 3000 for i in range(3072)]  # 96 chunks of 32: ~20 s if never interrupted


@contextmanager
def sigint_after(seconds: float) -> Iterator[list[float]]:
    """Send SIGINT to this process after ``seconds``; yields a list that receives the send time."""
    sent: list[float] = []

    def fire() -> None:
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(seconds, fire)
    timer.start()
    try:
        yield sent
    finally:
        timer.cancel()
        timer.join()


def interrupted(call: Callable[[], object]) -> float:
    """Run ``call`` with a SIGINT arriving 0.6 s in; return the latency of the interrupt."""
    with sigint_after(0.6) as sent, pytest.raises(KeyboardInterrupt):
        call()
    latency = time.perf_counter() - sent[0]
    # One 32-token chunk takes ~0.2 s on 2 cores; the whole call ~20 s. Generous bound: a few
    # chunks, far below the uninterrupted call.
    assert latency < 5.0, f"KeyboardInterrupt came {latency:.1f} s after the signal"
    return latency


def test_flat_decode_is_interrupted_and_rolled_back(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=4096, n_batch=N_BATCH, n_seq_max=2) as ctx:
        ctx.decode(LONG[:8], 0, seq_id=1)
        interrupted(lambda: ctx.decode(LONG, 0, seq_id=0))
        assert ctx.kv_seq_pos_max(0) == -1  # every chunk written before the signal is gone
        assert ctx.kv_seq_pos_max(1) == 7  # another sequence is untouched
        ctx.decode(LONG[:40], 0, seq_id=0)  # the context keeps working
        assert ctx.kv_seq_pos_max(0) == 39


def test_branch_reseed_is_interrupted_and_puts_the_old_cells_back(model: lloyal.Model) -> None:
    """A reseed with a lease free and room for both parks the old cells while the new ones are
    written (an engine prefill): Ctrl-C part-way puts the branch back as it was."""
    with lloyal.Context(model, n_ctx=4096, n_batch=N_BATCH, n_seq_max=2) as ctx:
        store = lloyal.BranchStore(ctx)
        with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0)) as b:
            b.prefill(ctx.tokenize("The capital of France is"))
            before = (b.position, b.logits.copy(), store.kv_pressure.cells_used)
            interrupted(lambda: b.reseed(LONG[:4], LONG[4:]))
            assert b.position == before[0] == ctx.kv_seq_pos_max(b.seq_id) + 1
            assert np.array_equal(b.logits, before[1])
            assert store.kv_pressure.cells_used == before[2] and store.available == 1
            assert b.reseed(LONG[:4], LONG[4:40]) == 40  # the context keeps working
            assert ctx.kv_seq_pos_max(b.seq_id) == 39 and store.available == 1


def test_branch_prefill_is_interrupted_and_leaves_the_branch_as_before(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=4096, n_batch=N_BATCH, n_seq_max=2) as ctx:
        store = lloyal.BranchStore(ctx)
        with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0)) as b:
            b.prefill(ctx.tokenize("The capital of France is"))
            before = (b.position, b.logits.copy(), store.kv_pressure.cells_used)
            interrupted(lambda: b.prefill(LONG))
            assert b.position == before[0] == ctx.kv_seq_pos_max(b.seq_id) + 1
            assert np.array_equal(b.logits, before[1])
            assert store.kv_pressure.cells_used == before[2]
            [token] = produce_commit(b, 1)  # decoding goes on from the old position
            assert b.position == before[0] + 1
            assert token == int(np.argmax(before[1]))


def test_store_prefill_of_two_branches_is_interrupted_all_or_nothing(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=8192, n_batch=N_BATCH, n_seq_max=2) as ctx:
        store = lloyal.BranchStore(ctx)
        a = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0))
        b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0))
        store.prefill([(a, [2, 651]), (b, [2, 818, 5279])])
        interrupted(lambda: store.prefill([(a, LONG), (b, LONG)]))
        assert (a.position, b.position) == (2, 3)
        assert (ctx.kv_seq_pos_max(a.seq_id), ctx.kv_seq_pos_max(b.seq_id)) == (1, 2)
        assert store.kv_pressure.cells_used == 5
        store.prefill([(a, [1000]), (b, [1001])])
        assert (a.position, b.position) == (3, 4)
        store.retain_only(a)
        a.prune()


def test_generation_is_interrupted_between_tokens_with_consistent_state(model: lloyal.Model) -> None:
    params = lloyal.SamplingParams(temperature=0.8, seed=3)
    with lloyal.Context(model, n_ctx=4096, n_seq_max=1) as ctx, lloyal.Branch.create(ctx, 0, params) as b:
        b.prefill(ctx.tokenize("Once upon a time"))
        start = b.position
        seen: list[int] = []

        def run() -> None:
            for tok in b.generate(3000):
                seen.append(tok.token)

        interrupted(run)
        assert seen, "some tokens were generated before the signal"
        # commit-before-yield: at most the one token committed while the signal arrived is
        # not yet yielded; KV and position agree either way
        assert b.position - start in (len(seen), len(seen) + 1)
        assert b.position == ctx.kv_seq_pos_max(b.seq_id) + 1
        more = [t.token for t in b.generate(3)]
        assert len(more) == 3 and b.position == ctx.kv_seq_pos_max(b.seq_id) + 1


def test_worker_thread_calls_are_not_interrupted_by_signals_meant_for_the_main_thread(
    model: lloyal.Model,
) -> None:
    """Only the main thread runs signal handlers: a prefill in a worker thread completes while
    the main thread receives (and handles) the Ctrl-C."""
    with lloyal.Context(model, n_ctx=1024, n_batch=N_BATCH) as ctx:
        done = threading.Event()
        worker = threading.Thread(target=lambda: (ctx.decode(LONG[:256], 0), done.set()))
        with sigint_after(0.3), pytest.raises(KeyboardInterrupt):
            worker.start()
            while not done.wait(0.01):
                pass
        worker.join(60)
        assert done.is_set()
        assert ctx.kv_seq_pos_max(0) == 255


def test_verify_is_interrupted_and_leaves_the_branch_exactly_as_before(model: lloyal.Model) -> None:
    """Ctrl-C during the draft decode stops the call before its bonus decode; the drafts the
    sampler already accepted are rolled back with everything else."""
    greedy = lloyal.SamplingParams(temperature=0.0)
    with lloyal.Context(model, n_ctx=1024, n_batch=512, n_seq_max=1) as ctx:
        store = lloyal.BranchStore(ctx)
        prompt = ctx.tokenize("The capital of France is Paris. The capital of Germany is")
        with lloyal.Branch.create(ctx, 0, greedy) as g:
            g.prefill(prompt)
            expected = [t.token for t in g.generate(6)]
        # Six drafts the sampler agrees with, then filler: decoding ~300 rows with logits takes
        # far longer than the signal's delay, so the signal lands during the draft decode.
        drafts = expected + LONG[:300]
        with lloyal.Branch.create(ctx, 0, greedy) as b:
            b.prefill(prompt)

            def state() -> tuple[object, ...]:
                cells = store.kv_pressure.cells_used
                return (b.position, b.last_token, b.perplexity, b.logits.tobytes(), cells)

            before = state()
            with sigint_after(0.15), pytest.raises(KeyboardInterrupt):
                b.verify(drafts)
            assert state() == before
            assert ctx.kv_seq_pos_max(b.seq_id) == b.position - 1
            # The sampler history is as before too: greedy verification goes on from the prompt.
            assert b.verify(expected[:5]) == 5 and b.last_token == expected[5]
