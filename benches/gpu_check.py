"""A GPU build's smoke check: greedy tokens and a 4-way fork on ``n_gpu_layers`` offloaded layers.

    python benches/gpu_check.py --ngl 99 [--model PATH]   # then --ngl 0 to compare with the CPU

Prints one JSON line: the 24 greedy tokens of one prompt and their text, the positions of four
forks after 16 lockstep steps, the ``llama_decode`` calls those steps took (one per step) and the
forks' perplexities; then ``lloyal.system_info()`` (a CUDA build lists ``CUDA : ARCHS = ...``).
Greedy tokens agree with the CPU's for the first tokens and may part later: the GPU kernels
round differently.
"""

from __future__ import annotations

import argparse
import json

import lloyal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ngl", type=int, default=99, help="layers offloaded (0: CPU only)")
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    model = lloyal.Model(a.model or lloyal.default_model_path(), n_gpu_layers=a.ngl)
    with lloyal.Context(model, n_ctx=1024, n_seq_max=5) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0))
        root.prefill(ctx.tokenize("The capital of France is"))
        probe = root.fork()
        greedy = [t.token for t in probe.generate(24)]
        probe.prune()
        kids = [root.fork() for _ in range(4)]
        for i, k in enumerate(kids):
            k.set_sampling(lloyal.SamplingParams(temperature=0.9), seed=100 + i)
        before = ctx.engine_stats().decode_calls
        for _ in range(16):
            store.commit([(k, p.token) for k, p in zip(kids, store.produce_all(kids), strict=True)])
        report = {
            "ngl": a.ngl,
            "greedy": greedy,
            "text": ctx.detokenize(greedy),
            "fork_positions": [k.position for k in kids],
            "lockstep_decode_calls": ctx.engine_stats().decode_calls - before,
            "perplexities": [round(k.perplexity, 3) for k in kids],
        }
    print(json.dumps(report))
    print(lloyal.system_info())


if __name__ == "__main__":
    main()
