"""Host work per sampled row: what a tick costs outside ``llama_decode``, per row it decodes.

``B`` branches forked from one prompt each iterate ``Branch.generate`` in a thread of their own
(temperature 0.8, top-k 40, top-p 0.95, a logit bias). The engine's own counters
(``Context.engine_stats()``) split each tick: ``tick_seconds - decode_seconds`` is the host
work (sampling, snapshot copies, stop checks, planning, publishing), divided by the rows
decoded. ``pytest benches`` runs it once at a small size;
``python benches/bench_host_work.py [STEPS B...]`` prints a table (default 64 steps, B = 1 8 16):
the median of three rounds, each running every B on a context that keeps sampling perplexity
(the default) and then on one made with ``sampling_perplexity=False``, with the ratio per round.
``--sampler top-p`` (top-p 0.95 without top-k), ``temperature`` (OpenAI's default: the whole
vocabulary) or ``greedy`` replaces the issue's sampler; the bias stays.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import lloyal

SAMPLING = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0)
SAMPLERS = {
    "issue": SAMPLING,
    "top-p": lloyal.SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
    "temperature": lloyal.SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
    "greedy": lloyal.SamplingParams(temperature=0.0),
}
BIAS = {13: -2.0, 236764: 1.5}  # a newline pushed down, one more token pulled up


def host_round(
    ctx: lloyal.Context, b: int, steps: int, sampling: lloyal.SamplingParams = SAMPLING
) -> dict[str, float]:
    """``b`` threads, each generating ``steps`` tokens drawn with ``sampling`` on its own fork."""
    root = lloyal.Branch.create(ctx, 0, sampling)
    root.prefill(ctx.tokenize("The history of the harbour town of Aldermoor begins"))
    kids = [root.fork() for _ in range(b)]
    for i, k in enumerate(kids):
        k.set_sampling(sampling, seed=100 + i, logit_bias=BIAS)
    made = [0] * b

    def one(i: int) -> None:
        made[i] = sum(1 for _ in kids[i].generate(steps))

    before = ctx.engine_stats()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.05)  # the last tick adds its time after waking its callers
    after = ctx.engine_stats()
    root.prune_subtree()
    rows = after.rows - before.rows
    ticks = after.ticks - before.ticks
    tick = after.tick_seconds - before.tick_seconds
    decode = after.decode_seconds - before.decode_seconds
    return {
        "made": float(sum(made)),
        "ticks": float(ticks),
        "rows_per_tick": rows / ticks,
        "host_ms_per_tick": 1e3 * (tick - decode) / ticks,
        "decode_ms_per_tick": 1e3 * decode / ticks,
        "host_ms_per_row": 1e3 * (tick - decode) / rows,
        "sample_ms_per_row": 1e3 * (after.sample_seconds - before.sample_seconds) / rows,
    }


@pytest.mark.parametrize("kept", [True, False], ids=["sampling_ppl_kept", "sampling_ppl_off"])
def test_host_work_per_row(benchmark: Any, model_path: Path, full: bool, kept: bool) -> None:
    b, steps = (16, 64) if full else (2, 3)
    with lloyal.Context(model_path, n_ctx=4096, n_seq_max=b + 1, sampling_perplexity=kept) as ctx:
        r = benchmark.pedantic(lambda: host_round(ctx, b, steps), rounds=1)
        assert r["made"] == b * steps and r["host_ms_per_row"] > 0
        if full:
            print("\n" + fmt(b, r, "kept" if kept else "off"))


def fmt(b: int, r: dict[str, float], ppl: str = "kept") -> str:
    return (
        f"| {b} | {ppl} | {r['rows_per_tick']:.1f} | {r['host_ms_per_tick']:.3f} "
        f"| {r['decode_ms_per_tick']:.1f} | {r['host_ms_per_row']:.3f} | {r['sample_ms_per_row']:.3f} |"
    )


def main() -> None:
    argv = sys.argv[1:]
    name = "issue"
    if "--sampler" in argv:
        at = argv.index("--sampler")
        name = argv[at + 1]
        del argv[at : at + 2]
    sampling = SAMPLERS[name]
    args = [int(a) for a in argv]
    steps, bs = (args[0], args[1:]) if args else (64, [])
    bs = bs or [1, 8, 16]
    rounds = 3
    print(f"{steps} steps, {rounds} interleaved rounds (median), sampler {name}, {lloyal.system_info()}")
    print(
        "| B | sampling perplexity | rows/tick | host ms/tick | decode ms/tick | host ms/row "
        "| of it sampling ms/row |"
    )
    print("|---|---|---|---|---|---|---|")
    path = lloyal.default_model_path()
    opts: dict[str, Any] = {"n_ctx": 4096, "n_seq_max": max(bs) + 1}
    with lloyal.Context(path, **opts) as on, lloyal.Context(path, **opts, sampling_perplexity=False) as off:
        runs: dict[tuple[int, bool], list[dict[str, float]]] = {}
        for ctx in (on, off):
            host_round(ctx, max(bs), 4, sampling)  # warm-up
        for _ in range(rounds):
            for b in bs:
                for ctx in (on, off):
                    time.sleep(0.15)  # the other context's engine hands back its OpenMP team (idle 0.1 s)
                    run = host_round(ctx, b, steps, sampling)
                    runs.setdefault((b, ctx.sampling_perplexity), []).append(run)
        for b in bs:
            for kept in (True, False):
                rs = runs[(b, kept)]
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                print(fmt(b, med, "kept" if kept else "off"), flush=True)
            each = [
                f"{off_r['host_ms_per_row'] / on_r['host_ms_per_row']:.2f}"
                for on_r, off_r in zip(runs[(b, True)], runs[(b, False)], strict=True)
            ]
            print(f"|   | off / kept, host ms/row by round: {', '.join(each)} | | | | | |")


if __name__ == "__main__":
    main()
