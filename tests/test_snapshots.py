"""A branch's logits snapshot is read where llama.cpp wrote it and copied out only when a
decode may overwrite it. Whatever runs in between (other branches' prefills and commits, the
flat path, forks, a reseed, a failed commit of its own), a branch reads the same logits, draws
the same token and keeps its perplexity."""

from __future__ import annotations

import threading

import numpy as np
from helpers import GREEDY, context_fixture, prefilled, wait_until

import lloyal

PROMPT = "The capital of France is"
SAMPLED = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95)

ctx4 = context_fixture(n_ctx=1024, n_seq_max=4)


def same(branch: lloyal.Branch, logits: np.ndarray, token: int, ppl: float) -> None:
    assert np.array_equal(branch.logits, logits)
    assert branch.sample() == token
    assert branch.perplexity == ppl


def test_a_generated_branch_reads_the_same_logits_after_other_work(ctx4: lloyal.Context) -> None:
    a = prefilled(ctx4, PROMPT, SAMPLED)
    a.reseed_sampler(7)
    assert len(list(a.generate(4))) == 4  # its last snapshot is a row of the engine's last decode
    logits, token, ppl = a.logits.copy(), a.sample(), a.perplexity
    assert logits.shape == (ctx4.model.n_vocab,) and np.isfinite(ppl)

    b = prefilled(ctx4, "Once upon a time")  # another branch's prefill
    same(a, logits, token, ppl)
    b.commit(b.sample())  # another branch's commit
    same(a, logits, token, ppl)
    ctx4.decode(ctx4.tokenize("Flat path tokens"), 0, 3)  # the flat path on a free sequence
    same(a, logits, token, ppl)
    child = a.fork()  # the fork shares the snapshot, then decodes on its own
    assert np.array_equal(child.logits, logits)
    child.commit(child.sample())
    same(a, logits, token, ppl)
    assert not np.array_equal(child.logits, logits)
    position = a.position
    a.commit(token)  # the token drawn before everything else is still the one committed
    assert (a.position, a.last_token) == (position + 1, token)


def test_a_branch_that_stops_first_keeps_its_snapshot_while_others_go_on(ctx4: lloyal.Context) -> None:
    """Two branches generate in the same ticks; the one that stops first reads the same
    logits after the other's further ticks as when it stopped."""
    root = prefilled(ctx4, PROMPT)
    short, long = root.fork(), root.fork()
    seen: dict[str, object] = {}

    def stop_early() -> None:
        seen["tokens"] = [t.token for t in short.generate(2)]
        seen["long_at_stop"] = long.position
        seen["logits"] = short.logits.copy()

    threads = [threading.Thread(target=stop_early), threading.Thread(target=lambda: list(long.generate(8)))]
    ctx4.pause_engine()  # both requests start in the same tick
    for t in threads:
        t.start()
    wait_until(lambda: ctx4.engine_stats().queue_depth == 2)
    ctx4.resume_engine()
    for t in threads:
        t.join()
    assert seen["long_at_stop"] < root.position + 8  # type: ignore[operator]
    assert long.position == root.position + 8 and short.position == root.position + 2
    assert np.array_equal(short.logits, seen["logits"])
    assert len(seen["tokens"]) == 2  # type: ignore[arg-type]


def test_a_commit_llama_cpp_refuses_leaves_the_snapshot_it_was_to_replace(model: lloyal.Model) -> None:
    """The flat path fills the cache to one free cell behind the ledger's back (room checks
    told not to count those cells, as they do by default): a's next commit
    takes it, and the one after is refused inside ``llama_decode`` ("no contiguous free
    cells"). Its snapshot (a row of the decode before, still read in place) is unchanged."""
    with lloyal.Context(model, n_ctx=256, n_batch=64, n_seq_max=3) as ctx:
        ctx._count_flat_cells = False  # else the room check refuses the commit first
        a = prefilled(ctx, PROMPT, GREEDY)
        free = 256 - a.position - 1
        ctx.decode([1000 + i % 500 for i in range(free)], 0, 2)
        a.commit(a.sample())  # the last free cell
        logits, token, ppl, pos = a.logits.copy(), a.sample(), a.perplexity, a.position
        try:
            a.commit(token)
        except lloyal.KvCacheFullError as e:
            assert "no contiguous free cells" in str(e)
        else:
            raise AssertionError("the commit found a free cell")
        assert a.position == pos
        same(a, logits, token, ppl)
        ctx.kv_cache_remove(2, 0)  # room again: the same token commits
        a.commit(token)
        assert a.position == pos + 1
