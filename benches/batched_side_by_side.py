"""lloyal against llama.cpp's own ``llama-batched-bench``, paired round by round.

    python benches/batched_side_by_side.py [--rounds 7] [--pp 512] [--tg 64] [--batch 1,8]
                                           [--bin target/peers/build/bin/llama-batched-bench]
                                           [--ngl 99] [--modes lloyal,lloyal-invariant]

What is measured (decode only, no sampling, as ``llama-batched-bench -pps`` does): a prompt of
``--pp`` tokens prefilled once (S_PP, tokens/s), then ``B`` sequences sharing it each decode
``--tg`` tokens in lockstep, one ``llama_decode`` of ``B`` rows per step (S_TG, aggregate
tokens/s). lloyal does the same with ``Branch.prefill``, ``fork`` and ``BranchStore.commit``,
in its default mode (llama.cpp's fastest kernels, repacked weights), with
``batch_invariant=True`` (per-row kernels) and with ``LLOYAL_DEVICE_ROWS=1``
(``lloyal-device-rows``: rows summarised by the decode, on the GPU, rather than on the host) and
with ``LLOYAL_SPIN_US=0`` (``lloyal-no-spin``: no spinning between engine calls on a spare core).
lloyal's sampled row adds what a user runs: the same ``B`` streams sampling their tokens
(temperature 0.8, top-k 40, top-p 0.95) with ``produce`` / ``produce_all`` before each commit,
against the peer's decode-only step.

Every measurement runs in its own process with a clean environment (no ``GGML_*`` variables:
lloyal's process-wide ``GGML_CPU_TILED_MM=0`` never reaches the peer), each after its own
warm-up. Each round runs the peer and both lloyal modes back to back in a shuffled order; the
printed figure for a measure is the median of the per-round ratios lloyal / llama.cpp with
their range, so a noisy machine moves both sides of a ratio together.

The peer is built by ``make bench-peers-cpp`` from the llama.cpp inside llama-cpp-python's
source distribution; its version is printed next to lloyal's. ``--ngl N`` offloads N layers to
a GPU on both sides (lloyal's ``Model(n_gpu_layers=N)``, the peer's ``-ngl N``), for a build
with a GPU backend.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BIN = ROOT / "target" / "peers" / "build" / "bin" / "llama-batched-bench"
MODES = {"lloyal": None, "lloyal-invariant": True, "lloyal-device-rows": None, "lloyal-no-spin": None}
# Modes whose worker runs with LLOYAL_DEVICE_ROWS set: rows summarised by the decode on the
# device that holds the output layer (Context.device_rows) instead of on the host; and with
# LLOYAL_SPIN_US=0: the engine thread and its callers sleep between calls even with a spare
# core (the default spins there, engine/spin.rs).
MODE_ENV = {"lloyal-device-rows": {"LLOYAL_DEVICE_ROWS": "1"}, "lloyal-no-spin": {"LLOYAL_SPIN_US": "0"}}


def lloyal_worker(
    mode: str, pp: int, tg: int, batch: int, threads: int, model: str, ngl: int
) -> dict[str, float]:
    import lloyal

    n_ctx = pp + batch * tg + 16
    ctx = lloyal.Context(
        lloyal.Model(model, n_gpu_layers=ngl, repack=MODES[mode] is None),
        n_ctx=n_ctx,
        n_batch=512,
        n_seq_max=max(batch, 1),
        n_threads=threads,
        batch_invariant=MODES[mode],
    )
    store = lloyal.BranchStore(ctx)
    prompt = [1000 + (i * 7) % 3000 for i in range(pp)]

    def once() -> tuple[float, float]:
        root = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0))
        t0 = time.perf_counter()
        root.prefill(prompt)
        t_pp = time.perf_counter() - t0
        branches = [root] + [root.fork() for _ in range(batch - 1)]
        t0 = time.perf_counter()
        for step in range(tg):
            store.commit([(b, 2000 + (step * 13 + i) % 3000) for i, b in enumerate(branches)])
        t_tg = time.perf_counter() - t0
        root.prune_subtree()
        return t_pp, t_tg

    def sampled() -> float:
        """``batch`` streams as a user runs them: ``produce`` (temperature 0.8, top-k 40, top-p
        0.95, one seed per stream) then ``commit``, per token, the streams forked from one
        prompt and stepped in lockstep (best-of-B: ``produce_all`` + one ``commit``); the end of
        generation banned so every step decodes."""
        params = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)
        root = lloyal.Branch.create(ctx, 0, params)
        stops = {t for t in range(300) if ctx.is_stop_token(t)} | {ctx.eog_token}
        root.set_logit_bias({t: float("-inf") for t in stops})
        root.prefill(prompt)
        streams = [root] + [root.fork() for _ in range(batch - 1)]
        for i, b in enumerate(streams[1:]):
            b.reseed_sampler(8 + i)
        t0 = time.perf_counter()
        for _ in range(tg):
            if batch == 1:
                root.commit(root.produce().token)
            else:
                store.commit(list(zip(streams, [p.token for p in store.produce_all(streams)], strict=True)))
        t = time.perf_counter() - t0
        root.prune_subtree()
        return t

    def generated() -> float:
        """The same ``batch`` streams, each iterating ``Branch.generate`` in a thread of its own
        (the engine batches them and draws their tokens on the decode's threads)."""
        params = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
        root = lloyal.Branch.create(ctx, 0, params)
        root.prefill(prompt)
        streams = [root] + [root.fork() for _ in range(batch - 1)]
        stops = {t for t in range(300) if ctx.is_stop_token(t)} | {ctx.eog_token}
        for i, b in enumerate(streams):
            b.set_sampling(params, seed=8 + i, logit_bias={t: float("-inf") for t in stops})
        made = [0] * batch
        # The clock starts when every thread holds its iterator, as the peer's batch is whole
        # at its first step: 16 threads started under a running decode take ~9 ticks of a
        # 2-vCPU host's to come in (1, 1, 1, 4, 5, 5, 8, 10, 15 rows), and as many to leave.
        start = threading.Barrier(batch + 1)

        def run(i: int) -> None:
            it = streams[i].generate(tg)
            start.wait()
            made[i] = sum(1 for _ in it)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        t = time.perf_counter() - t0
        root.prune_subtree()
        assert sum(made) == batch * tg, made
        return t

    once()  # warm-up, as llama-batched-bench does
    t_pp, t_tg = once()
    out = {"s_pp": pp / t_pp, "s_tg": batch * tg / t_tg}
    sampled()
    out["s_tg_sampled"] = batch * tg / sampled()
    generated()
    out["s_tg_generate"] = batch * tg / generated()
    return out


def peer_worker(
    binary: str, pp: int, tg: int, batch: int, threads: int, model: str, ngl: int
) -> dict[str, float]:
    cmd = [
        binary,
        "-m",
        model,
        "-c",
        str(pp + batch * tg + 16),
        "-b",
        "512",
        "-ub",
        "512",
        "-npp",
        f"{pp},{pp}",  # twice, the second taken: its warm-up decodes 16 tokens, not a prompt
        "-ntg",
        str(tg),
        "-npl",
        str(batch),
        "-pps",
        "--kv-unified",  # one KV buffer for all sequences, as lloyal's contexts (else n_ctx is split)
        "-t",
        str(threads),
        "-ngl",
        str(ngl),
    ]
    out = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == str(pp) and cells[2] == str(batch):
            rows.append({"s_pp": float(cells[5]), "s_tg": float(cells[7])})
    if not rows:
        raise RuntimeError(f"no result row in llama-batched-bench output:\n{out}")
    return rows[-1]


def clean_env() -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")
    keep += ("LLOYAL_ROW_KERNELS",)  # make bench-avx2: lloyal's row kernels held to the build's
    return {k: v for k, v in os.environ.items() if k in keep}


def peer_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], env=clean_env(), capture_output=True, text=True)
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0] if text else "unknown"


def run_worker(kind: str, a: argparse.Namespace, batch: int, model: str) -> dict[str, float]:
    if kind == "llama.cpp":
        return peer_worker(str(a.bin), a.pp, a.tg, batch, a.threads, model, a.ngl)
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--pp",
        str(a.pp),
        "--tg",
        str(a.tg),
        "--batch",
        str(batch),
        "--threads",
        str(a.threads),
        "--model",
        model,
        "--ngl",
        str(a.ngl),
    ]
    env = {**clean_env(), **MODE_ENV.get(kind, {})}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bin", type=Path, default=Path(os.environ.get("LLAMA_BATCHED_BENCH", DEFAULT_BIN)))
    ap.add_argument("--worker", choices=sorted(MODES))
    ap.add_argument("--model", default=None)
    ap.add_argument("--ngl", type=int, default=0, help="layers offloaded to a GPU (both sides)")
    ap.add_argument("--modes", default="lloyal,lloyal-invariant", help=f"lloyal modes, of {sorted(MODES)}")
    ap.add_argument("--json", default=None, help="write every round's figures here")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(lloyal_worker(a.worker, a.pp, a.tg, int(a.batch), a.threads, a.model, a.ngl)))
        return
    import lloyal

    if not a.bin.exists():
        sys.exit(f"{a.bin} not found: build it with `make bench-peers-cpp` (or pass --bin)")
    model = a.model or str(lloyal.default_model_path())
    batches = [int(b) for b in a.batch.split(",")]
    modes = [m for m in a.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        sys.exit(f"unknown --modes {unknown}: choose from {sorted(MODES)}")
    kinds = ["llama.cpp", *modes]
    got: dict[tuple[str, int], list[dict[str, float]]] = {(k, b): [] for k in kinds for b in batches}
    rng = random.Random(0)
    for r in range(a.rounds):
        for b in batches:
            order = kinds[:]
            rng.shuffle(order)
            for k in order:
                got[(k, b)].append(run_worker(k, a, b, model))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(f"peer: llama-batched-bench {peer_version(str(a.bin))}; lloyal {lloyal.__version__}")
    print(
        f"pp={a.pp} tg={a.tg} threads={a.threads} ngl={a.ngl} rounds={a.rounds}; "
        "median of per-round ratios (range)"
    )
    names = {
        "lloyal": "lloyal",
        "lloyal-invariant": "invariant",
        "lloyal-device-rows": "device rows",
        "lloyal-no-spin": "no spin",
    }
    head = ["measure", "llama.cpp t/s"]
    for k in modes:
        head += [f"{names[k]} t/s", f"{names[k]} ÷ llama.cpp"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))

    def row(label: str, b: int, key: str, peer_key: str, peer_note: str = "") -> None:
        peer = [x[peer_key] for x in got[("llama.cpp", b)]]
        cells = [f"{statistics.median(peer):.1f}{peer_note}"]
        for k in modes:
            mine = [x[key] for x in got[(k, b)]]
            ratios = [m / p for m, p in zip(mine, peer, strict=True)]
            cells.append(f"{statistics.median(mine):.1f}")
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})")
        print(f"| {label} | " + " | ".join(cells) + " |")

    sampling = "temp 0.8 top-k 40 top-p 0.95"
    for b in batches:
        if b == batches[0]:
            row(f"prefill {a.pp} (B={b})", b, "s_pp", "s_pp")
        row(f"decode B={b}", b, "s_tg", "s_tg")
        # lloyal sampling its tokens (issues 18, 29, 30) against the peer's decode only
        lockstep = "single stream, produce + commit" if b == 1 else f"best-of-{b}, produce_all + commit"
        row(f"{lockstep}, {sampling}", b, "s_tg_sampled", "s_tg", " (decode only)")
        row(f"{b} x Branch.generate, a thread each, {sampling}", b, "s_tg_generate", "s_tg", " (decode only)")
    if a.json:
        Path(a.json).write_text(json.dumps({f"{k}@{b}": v for (k, b), v in got.items()}, indent=1))


if __name__ == "__main__":
    main()
