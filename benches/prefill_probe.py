"""Where a 512-token prefill spends its time, path by path (issue 30's prefill gap on a GPU).

On an H200, lloyal's warm 512-token prefill took ~15 ms against ~9 ms for llama-batched-bench
on the same ggml, while on a CPU the two match (0.98x). This times the same prompt, on one
context of the side-by-side bench's shape, through:

- ``branch``: ``Branch.prefill`` (the engine's tick: one ``llama_decode``), with the engine's
  own ``decode_seconds`` beside the wall time, so the gap shows as inside or outside llama.cpp;
- ``flat``: ``Context.decode`` on the flat path (no branch, no engine thread);
- ``branch, n_seq_max 1`` and ``branch, n_ctx 4096``: the same on contexts of another shape.

Each row is the median of ``--rounds`` prefills after one warm-up, in milliseconds.
``python benches/prefill_probe.py [--ngl 99] [--threads 8] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import lloyal

PP = 512


def _median_ms(rounds: int, once: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """Median wall and in-``llama_decode`` milliseconds of ``once`` (after a warm-up)."""
    once()
    runs = [once() for _ in range(rounds)]
    return 1e3 * statistics.median(r[0] for r in runs), 1e3 * statistics.median(r[1] for r in runs)


def branch_prefill(ctx: lloyal.Context, prompt: list[int]) -> tuple[float, float]:
    """One ``Branch.prefill`` of ``prompt``: wall seconds and the engine's decode seconds."""
    b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0))
    before = ctx.engine_stats().decode_seconds
    t0 = time.perf_counter()
    b.prefill(prompt)
    wall = time.perf_counter() - t0
    decode = ctx.engine_stats().decode_seconds - before
    b.prune()
    return wall, decode


def flat_prefill(ctx: lloyal.Context, prompt: list[int]) -> tuple[float, float]:
    """One flat-path ``Context.decode`` of ``prompt`` on a cleared cache (no decode split)."""
    ctx.kv_cache_clear()
    t0 = time.perf_counter()
    ctx.decode(prompt, 0)
    return time.perf_counter() - t0, float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ngl", type=int, default=0, help="layers offloaded to a GPU")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    model = lloyal.Model(args.model or lloyal.default_model_path(), n_gpu_layers=args.ngl)
    prompt = [1000 + (i * 7) % 3000 for i in range(PP)]
    # the side-by-side bench's context at B=16 (pp 512, tg 128), and two other shapes
    shapes = {"": (PP + 16 * 128 + 16, 16), ", n_seq_max 1": (PP + 128 + 16, 1), ", n_ctx 4096": (4096, 16)}
    print(f"{PP}-token prefill, ngl {args.ngl}, {args.rounds} rounds, medians; {lloyal.system_info()}")
    print("| path | wall ms | in llama_decode ms |")
    print("|---|---|---|")
    for name, (n_ctx, n_seq) in shapes.items():
        opts = {"n_ctx": n_ctx, "n_batch": 512, "n_seq_max": n_seq, "n_threads": args.threads}
        with lloyal.Context(model, **opts) as ctx:
            wall, inside = _median_ms(args.rounds, lambda: branch_prefill(ctx, prompt))
            print(f"| branch{name} | {wall:.2f} | {inside:.2f} |", flush=True)
            if not name:
                wall, _ = _median_ms(args.rounds, lambda: flat_prefill(ctx, prompt))
                print(f"| flat | {wall:.2f} | - |", flush=True)


if __name__ == "__main__":
    main()
