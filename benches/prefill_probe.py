"""Where lloyal's GPU decode loses to llama-batched-bench: prefill and decode steps, by variant.

On an H200, lloyal's warm 512-token prefill took ~15 ms against ~9 ms for llama-batched-bench
on the same ggml, and a 16-row decode step ~4.2 ms inside ``llama_decode`` against the peer's
whole step of ~3.1 ms, while on a CPU the two match. This times, on one context shape
(``n_ctx`` 1552, ``n_seq_max`` 16: a 512-token prompt and 16 x 64 tokens):

- lloyal: ``Branch.prefill`` (one engine tick, one ``llama_decode``) wall and inside
  ``llama_decode`` (``EngineStats.decode_seconds``); the flat path; decode steps of 1 and 16
  rows (``BranchStore.commit``) per step, wall and inside; the prefill with flash attention off
  and with 1 thread;
- the same lloyal rows in a child process under ``GGML_CUDA_DISABLE_GRAPHS=1`` and under
  ``LLAMA_GRAPH_REUSE_DISABLE=1`` (if lloyal's figures do not move where the peer's do, lloyal
  does not get that feature);
- with ``--bin`` (or ``$LLAMA_BATCHED_BENCH``), llama-batched-bench on the same shape: as is,
  with ``--swa-full`` (lloyal's contexts keep a full-size sliding-window cache), with ``-fa
  off``, and under the two variables above;
- with ``--debug-dir``, one prefill and 8 steps of each side under ``GGML_SCHED_DEBUG=1``: how
  many graphs each builds (ggml prints a graph's splits when it schedules a new one, not when
  llama.cpp reuses the last) and how many splits a graph has.

Milliseconds, medians of ``--rounds`` after a warm-up.
``python benches/prefill_probe.py [--ngl 99] [--threads 8] [--rounds 7] [--bin PATH] [--debug-dir D]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PP, TG, B = 512, 64, 16
N_CTX = PP + B * TG + 16
VARIABLES = ("GGML_CUDA_DISABLE_GRAPHS", "LLAMA_GRAPH_REUSE_DISABLE")


def _median_ms(rounds: int, once: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """Median wall and in-``llama_decode`` milliseconds of ``once`` (after a warm-up)."""
    once()
    runs = [once() for _ in range(rounds)]
    return 1e3 * statistics.median(r[0] for r in runs), 1e3 * statistics.median(r[1] for r in runs)


def lloyal_rows(ngl: int, threads: int | None, rounds: int, model_path: str | None) -> dict[str, list[float]]:
    """lloyal's rows: name -> [wall ms, inside ``llama_decode`` ms] (nan where not counted)."""
    import lloyal

    model = lloyal.Model(model_path or lloyal.default_model_path(), n_gpu_layers=ngl)
    prompt = [1000 + (i * 7) % 3000 for i in range(PP)]
    rows: dict[str, list[float]] = {}

    def prefill(ctx: lloyal.Context) -> tuple[float, float]:
        b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0))
        before = ctx.engine_stats().decode_seconds
        t0 = time.perf_counter()
        b.prefill(prompt)
        wall = time.perf_counter() - t0
        inside = ctx.engine_stats().decode_seconds - before
        b.prune()
        return wall, inside

    def steps(ctx: lloyal.Context, batch: int) -> tuple[float, float]:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0))
        root.prefill(prompt)
        branches = [root] + [root.fork() for _ in range(batch - 1)]
        s0 = ctx.engine_stats()
        t0 = time.perf_counter()
        for step in range(TG):
            store.commit([(b, 2000 + (step * 13 + i) % 3000) for i, b in enumerate(branches)])
        wall = time.perf_counter() - t0
        s1 = ctx.engine_stats()
        root.prune_subtree()
        return wall / TG, (s1.decode_seconds - s0.decode_seconds) / max(1, s1.decode_calls - s0.decode_calls)

    def flat(ctx: lloyal.Context) -> tuple[float, float]:
        ctx.kv_cache_clear()
        t0 = time.perf_counter()
        ctx.decode(prompt, 0)
        return time.perf_counter() - t0, float("nan")

    opts = {"n_ctx": N_CTX, "n_batch": PP, "n_seq_max": B, "n_threads": threads}
    with lloyal.Context(model, **opts) as ctx:  # type: ignore[arg-type]
        rows["prefill 512"] = list(_median_ms(rounds, lambda: prefill(ctx)))
        rows["decode step, 1 row"] = list(_median_ms(max(3, rounds // 2), lambda: steps(ctx, 1)))
        rows[f"decode step, {B} rows"] = list(_median_ms(max(3, rounds // 2), lambda: steps(ctx, B)))
        rows["prefill 512, flat path"] = list(_median_ms(rounds, lambda: flat(ctx)))
    for name, extra in (("flash_attn=False", {"flash_attn": False}), ("n_threads=1", {"n_threads": 1})):
        with lloyal.Context(model, **{**opts, **extra}) as ctx:  # type: ignore[arg-type]
            rows[f"prefill 512, {name}"] = list(_median_ms(rounds, lambda: prefill(ctx)))
    return rows


def peer_rows(binary: str, ngl: int, threads: int, flags: list[str], env: dict[str, str]) -> dict[str, float]:
    """llama-batched-bench on the same shape: prefill ms (its second prompt) and step ms at B=1/16."""
    cmd = [binary, "-m", os.environ.get("LLOYAL_MODEL", ""), "-c", str(N_CTX), "-b", str(PP), "-ub", str(PP)]
    cmd += ["-npp", f"{PP},{PP}", "-ntg", str(TG), "-npl", f"1,{B}", "-pps", "--kv-unified"]
    cmd += ["-t", str(threads), "-ngl", str(ngl), *flags]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    got: dict[str, float] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == str(PP):
            got["prefill 512"] = 1e3 * PP / float(cells[5])
            rows = f"{cells[2]} row{'s' if cells[2] != '1' else ''}"
            got[f"decode step, {rows}"] = 1e3 * int(cells[2]) / float(cells[7])
    return got


def clean_env(**extra: str) -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "PYTHONPATH", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "LLOYAL_MODEL")
    return {**{k: v for k, v in os.environ.items() if k in keep}, **extra}


def child(args: argparse.Namespace, env: dict[str, str]) -> dict[str, list[float]]:
    """lloyal's rows in a fresh process under ``env`` (the variables are read once, at start)."""
    cmd = [sys.executable, __file__, "--child", "--ngl", str(args.ngl), "--rounds", str(args.rounds)]
    cmd += ["--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def graph_counts(text: str) -> str:
    """Graphs scheduled (ggml prints split #0 once a graph) and the most splits one had."""
    splits = [int(m) for m in re.findall(r"## SPLIT #(\d+)", text)]
    return f"{splits.count(0)} graphs scheduled, at most {max(splits, default=-1) + 1} splits"


def debug_runs(args: argparse.Namespace, out: Path) -> None:
    """One prefill and 8 steps of 16 rows on each side under GGML_SCHED_DEBUG=1."""
    out.mkdir(parents=True, exist_ok=True)
    code = (
        "import lloyal, sys\n"
        f"m = lloyal.Model(lloyal.default_model_path(), n_gpu_layers={args.ngl})\n"
        f"c = lloyal.Context(m, n_ctx={N_CTX}, n_batch={PP}, n_seq_max={B}, n_threads={args.threads})\n"
        "s = lloyal.BranchStore(c)\n"
        "r = lloyal.Branch.create(c, 0, lloyal.SamplingParams(temperature=0.0))\n"
        f"r.prefill([1000 + (i * 7) % 3000 for i in range({PP})])\n"
        f"bs = [r] + [r.fork() for _ in range({B - 1})]\n"
        "sys.stderr.write('== steps\\n')\n"
        "for k in range(8): s.commit([(b, 2000 + k + i) for i, b in enumerate(bs)])\n"
    )
    env = clean_env(GGML_SCHED_DEBUG="1", LLOYAL_LOG="1")
    lo = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stderr
    (out / "sched_lloyal.txt").write_text(lo)
    after = graph_counts(lo.split("== steps")[-1])
    print(f"lloyal, GGML_SCHED_DEBUG: {graph_counts(lo)}; after the prefill: {after}")
    if args.bin:
        cmd = [args.bin, "-m", os.environ.get("LLOYAL_MODEL", ""), "-c", str(N_CTX)]
        cmd += ["-b", str(PP), "-ub", str(PP), "-npp", str(PP), "-ntg", "8", "-npl", str(B), "-pps"]
        cmd += ["--kv-unified", "-t", str(args.threads)]
        cmd += ["-ngl", str(args.ngl), "-v"]
        pe = subprocess.run(cmd, env=clean_env(GGML_SCHED_DEBUG="1"), capture_output=True, text=True)
        (out / "sched_peer.txt").write_text(pe.stderr + pe.stdout)
        print(f"llama-batched-bench, GGML_SCHED_DEBUG: {graph_counts(pe.stderr + pe.stdout)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ngl", type=int, default=0, help="layers offloaded to a GPU")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default=None)
    ap.add_argument("--bin", default=os.environ.get("LLAMA_BATCHED_BENCH"), help="llama-batched-bench")
    ap.add_argument("--debug-dir", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(lloyal_rows(args.ngl, args.threads, args.rounds, args.model)))
        return
    if args.model:
        os.environ["LLOYAL_MODEL"] = args.model
    if not os.environ.get("LLOYAL_MODEL"):
        import lloyal

        os.environ["LLOYAL_MODEL"] = str(lloyal.default_model_path())
    columns: dict[str, dict[str, list[float]]] = {"lloyal": child(args, clean_env())}
    for var in VARIABLES:
        columns[f"lloyal, {var}=1"] = child(args, clean_env(**{var: "1"}))
    if args.bin:
        peers: dict[str, tuple[list[str], dict[str, str]]] = {"peer": ([], {})}
        peers["peer --swa-full"] = (["--swa-full"], {})
        peers["peer -fa off"] = (["-fa", "off"], {})
        peers.update({f"peer, {var}=1": ([], {var: "1"}) for var in VARIABLES})
        for name, (flags, extra) in peers.items():
            got = peer_rows(args.bin, args.ngl, args.threads, flags, clean_env(**extra))
            columns[name] = {k: [v, float("nan")] for k, v in got.items()}
    names = list(columns["lloyal"])
    shape = f"ngl {args.ngl}, {args.threads} threads, n_ctx {N_CTX}, medians of {args.rounds}"
    print(f"{shape}; ms (wall / inside llama_decode)")
    print("| row | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row in names:
        cells = []
        for col in columns.values():
            wall, inside = col.get(row, [float("nan"), float("nan")])
            text = "-" if wall != wall else f"{wall:.2f}"  # nan: not measured on that side
            cells.append(text + ("" if inside != inside else f" / {inside:.2f}"))
        print(f"| {row} | " + " | ".join(cells) + " |", flush=True)
    if args.debug_dir:
        debug_runs(args, args.debug_dir)


if __name__ == "__main__":
    main()
