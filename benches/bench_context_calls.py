"""What a context call that is not decode-bearing (a fork, a sampler change, a prune) costs, with
the engine idle and with a generation stream ticking beside it.

    python benches/bench_context_calls.py [calls]

- idle: ``calls`` fork + prune pairs on an idle engine (the call takes its turn at once);
- busy: a thread streams greedy tokens from another branch (the engine ticks back to back)
  while this one makes ``calls // 40`` admissions of a request: fork, ``set_sampling``, prune.
  Each admission waits for the tick in progress (queued, run by the engine when it ends), then
  its next calls take their turn in the gap the engine leaves; reported: the ticks that passed
  during each admission (1: only the tick it waited for) and the stream's tokens per second.

Prints one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import lloyal
from lloyal._model_path import default_model_path

GREEDY = lloyal.SamplingParams(temperature=0)


def idle(ctx: lloyal.Context, root: lloyal.Branch, calls: int) -> float:
    """Microseconds per fork + prune pair."""
    t0 = time.perf_counter()
    for _ in range(calls):
        root.fork().prune()
    return (time.perf_counter() - t0) / calls * 1e6


def busy(ctx: lloyal.Context, root: lloyal.Branch, admissions: int) -> dict[str, float]:
    """Admissions made while a stream ticks: ticks per admission, its wall time, the stream's rate."""
    stream = root.fork()
    stop = threading.Event()
    tokens: list[int] = []

    def run() -> None:
        while not stop.is_set():
            for tok in stream.generate(32):
                tokens.append(tok.token)
            stream.reseed([], [2, 105, 2364])  # back to the prompt: the cache never fills

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    ticks, walls = [], []
    params = lloyal.SamplingParams(temperature=0.7, top_k=40)
    n0, t0 = len(tokens), time.perf_counter()
    for i in range(admissions):
        time.sleep(0.013 * (i % 3))  # land anywhere in a tick
        before, w0 = ctx.engine_stats().ticks, time.perf_counter()
        child = root.fork()
        child.set_sampling(params, seed=i, logit_bias={7: -1.0})
        child.prune()
        walls.append((time.perf_counter() - w0) * 1e3)
        ticks.append(ctx.engine_stats().ticks - before)
    rate = (len(tokens) - n0) / (time.perf_counter() - t0)
    stop.set()
    t.join()
    stream.prune()
    return {
        "ticks_per_admission": statistics.mean(ticks),
        "most_ticks": max(ticks),
        "admission_ms_median": statistics.median(walls),
        "stream_tok_s": rate,
    }


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    model = lloyal.Model(default_model_path())
    with lloyal.Context(model, n_ctx=1024, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, 0, GREEDY)
        root.prefill([2, 105, 2364])
        out: dict[str, float] = {"idle_us_per_fork_prune": min(idle(ctx, root, calls) for _ in range(3))}
        out.update(busy(ctx, root, max(calls // 40, 10)))
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))


if __name__ == "__main__":
    main()
