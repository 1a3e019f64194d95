"""Ray Data path against the direct engine, one actor: tokens/s of ``lloyal.ray.generate`` over
the same rows run in-process by the same ``RowGenerator`` (same engine code, no Ray).

Both timings include loading the model and creating the context (an actor does both), not
``ray.init``. Target: Ray >= 0.9x the direct engine at full size. The smoke run
(``pytest benches``) is 8 prompts x 8 tokens; ``make bench`` or ``LLOYAL_BENCH_RAY_PROMPTS`` /
``LLOYAL_BENCH_RAY_TOKENS`` set the full size (default 64 prompts x 64 tokens).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import lloyal

ray = pytest.importorskip("ray", reason="the ray extra: pip install 'lloyal[ray]'")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")


def test_ray_data_against_the_direct_engine(model_path: Path, full: bool) -> None:
    from lloyal.ray.data import RowGenerator, generate

    prompts_n = int(os.environ.get("LLOYAL_BENCH_RAY_PROMPTS", "64" if full else "8"))
    tokens = int(os.environ.get("LLOYAL_BENCH_RAY_TOKENS", "64" if full else "8"))
    threads = int(os.environ.get("LLOYAL_BENCH_THREADS", "1"))
    rows = [{"prompt": f"Write about topic number {i}:"} for i in range(prompts_n)]
    opts = {"n_ctx": 4096, "n_threads": threads}
    greedy = lloyal.SamplingParams(temperature=0)
    t0 = time.perf_counter()
    gen = RowGenerator(str(model_path), "prompt", 1, 1, greedy, None, None, tokens, 1, 16, opts)
    direct = gen({"prompt": np.array([r["prompt"] for r in rows], dtype=object)})
    direct_s = time.perf_counter() - t0
    direct_tokens = sum(c[0] for c in direct["completion_tokens"])

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        t0 = time.perf_counter()
        out = generate(
            rows, model_path, max_tokens=tokens, batch_size=prompts_n, rows_at_once=16, concurrency=1, **opts
        ).take_all()
        ray_s = time.perf_counter() - t0
    finally:
        ray.shutdown()
    ray_tokens = sum(r["completion_tokens"][0] for r in out)
    assert ray_tokens == direct_tokens  # greedy: the same rows give the same tokens
    ratio = (ray_tokens / ray_s) / (direct_tokens / direct_s)
    print(
        f"\nray data vs direct, {prompts_n} prompts x {tokens} tokens: direct {direct_tokens / direct_s:.1f} "
        f"tok/s ({direct_s:.2f} s), ray {ray_tokens / ray_s:.1f} tok/s ({ray_s:.2f} s), ratio {ratio:.2f}x"
    )
