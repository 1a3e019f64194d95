"""The portable wheel against the native source build, paired round by round (issue 18, target 3).

    python benches/wheel_vs_source.py --wheel-python target/portable/venv/bin/python [--rounds 5]

Both run ``batched_side_by_side.py``'s lloyal worker (default kernels: prefill of ``--pp`` tokens,
then decode at B=1 and B=8, and one sampled stream) in their own process with a clean
environment: the source build with this interpreter (``make build``: ``-C target-cpu=native``),
the wheel with ``--wheel-python`` (``make wheel-portable``: baseline x86-64 plus one CPU backend
module per level, the best picked at run time). Each round runs both in a shuffled order; the
figure is the median of the per-round ratios wheel / source with their range.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from batched_side_by_side import clean_env

HERE = Path(__file__).resolve().parent
MEASURES = (("s_pp", "prefill", 1), ("s_tg", "decode B=1", 1), ("s_tg_sampled", "sampled B=1", 1))


def worker(python: str, pp: int, tg: int, batch: int, threads: int, model: str) -> dict[str, float]:
    """One measurement in a fresh process of ``python`` (run from outside the source tree)."""
    cmd = [python, str(HERE / "batched_side_by_side.py"), "--worker", "lloyal"]
    cmd += ["--pp", str(pp), "--tg", str(tg), "--batch", str(batch), "--threads", str(threads)]
    cmd += ["--model", model]
    out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, check=True, cwd="/").stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def info(python: str) -> str:
    code = "import lloyal; print(lloyal._lloyal.PORTABLE, lloyal.system_info())"
    out = subprocess.run([python, "-c", code], env=clean_env(), capture_output=True, text=True, cwd="/")
    return out.stdout.strip() or out.stderr.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheel-python", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    import lloyal

    model = a.model or str(lloyal.default_model_path())
    # Absolute, not resolved: a venv's python is a symlink whose location makes the venv.
    kinds = {"source": sys.executable, "wheel": os.path.abspath(a.wheel_python)}
    got: dict[tuple[str, int], list[dict[str, float]]] = {(k, b): [] for k in kinds for b in (1, 8)}
    rng = random.Random(0)
    for r in range(a.rounds):
        for b in (1, 8):
            order = list(kinds)
            rng.shuffle(order)
            for k in order:
                got[(k, b)].append(worker(kinds[k], a.pp, a.tg, b, a.threads, model))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    for k, py in kinds.items():
        print(f"{k}: {py}: portable, system_info = {info(py)}")
    print(f"pp={a.pp} tg={a.tg} threads={a.threads} rounds={a.rounds}; median of per-round ratios (range)")
    print("| measure | source t/s | wheel t/s | wheel ÷ source |")
    print("|---|---|---|---|")
    for key, label, b in (*MEASURES, ("s_tg", "decode B=8", 8)):
        src = [x[key] for x in got[("source", b)]]
        whl = [x[key] for x in got[("wheel", b)]]
        ratios = [w / s for w, s in zip(whl, src, strict=True)]
        print(
            f"| {label} | {statistics.median(src):.1f} | {statistics.median(whl):.1f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
