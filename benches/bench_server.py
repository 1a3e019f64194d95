"""Load generator for OpenAI-compatible servers: `lloyal serve`, llama-server, llama-cpp-python's server.

Each server is its own process started with a clean environment (``batched_side_by_side.
clean_env``: PATH, HOME and where Python packages, libraries and GPUs are; nothing lloyal sets in
its own process, such as ``GGML_CPU_TILED_MM=0``, reaches a peer), on the same model
(``lloyal.default_model_path()``) and thread count. Every request is streamed
(``/v1/completions``, ``stream: true``) from httpx async clients; the time to first token (TTFT)
is the time to the first chunk with a token, aggregate tok/s is every
streamed token of a run over the run's wall time.

Loads: shared-prefix (the same ~1000-token system text + a distinct one-line question),
distinct prompts (32-512 tokens, nothing shared), each at concurrency 1, 4, 16 with 64 new
tokens; ``n=8`` in one request on a prompt of the shared load's length that no server has seen
(cold everywhere); and on lloyal the TTFT of a prefix-cache hit against a miss.

    python benches/bench_server.py --full          # `make bench-server`: every load, full size
    python benches/bench_server.py                 # smoke size (what `pytest benches` runs)
    python benches/bench_server.py --full --rounds 5 --loads distinct --only lloyal,llama-server
                                                   # paired: both up, interleaved rounds, per-round ratios

Peers are skipped when absent: llama-server from ``$LLAMA_SERVER`` (default
``target/peers/build/bin/llama-server``, built by ``make bench-peers-cpp``), llama-cpp-python's
server when ``llama_cpp.server`` imports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from batched_side_by_side import clean_env

import lloyal

ROOT = Path(__file__).resolve().parent.parent
THREADS = int(os.environ.get("LLOYAL_BENCH_THREADS", str(os.cpu_count() or 2)))
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", ROOT / "target/peers/build/bin/llama-server"))
SLOTS = 16  # the highest concurrency: llama-server -np, lloyal --parallel
LOGS = ROOT / "target" / "bench-server"  # each server's output


@dataclass
class Size:
    system_tokens: int
    concurrencies: tuple[int, ...]
    requests_per_level: int  # requests per concurrency level = max(this, concurrency)
    max_tokens: int
    n: int
    distinct: tuple[int, int]  # prompt token range for the distinct-prompt load


FULL = Size(1000, (1, 4, 16), 2, 64, 8, (32, 512))
SMOKE = Size(120, (1, 2), 2, 8, 2, (16, 48))


# -- servers ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerSpec:
    name: str
    cmd: list[str]
    n_native: bool  # answers n choices from one request


_LLOYAL_ARGS = ["--parallel", str(SLOTS), "-t", str(THREADS), "--port", "{port}"]
_LLAMA_SERVER_ARGS = [
    "-np",
    str(SLOTS),
    "--kv-unified",
    "-t",
    str(THREADS),
    "--port",
    "{port}",
    "--host",
    "127.0.0.1",
]
_LLAMA_CPP_PYTHON_ARGS = [
    "--n_ctx",
    "2048",
    "--n_threads",
    str(THREADS),
    "--port",
    "{port}",
    "--host",
    "127.0.0.1",
]


def servers(
    model: Path, n_ctx: int, invariant: bool = False, extra: Sequence[str] = (), ngl: int = 0
) -> list[ServerSpec]:
    """The servers present here, each with the same model, threads and ``ngl`` layers on a GPU
    (``extra``: more ``lloyal serve`` options)."""
    py = sys.executable
    gpu = ["-ngl", str(ngl)] if ngl else []
    lloyal_cmd = [
        *[py, "-m", "lloyal.cli", "--model", str(model), "serve", "--n-ctx", str(n_ctx)],
        *_LLOYAL_ARGS,
        *gpu,
        *extra,
    ]
    out = [ServerSpec("lloyal serve", lloyal_cmd, True)]
    if invariant:  # per-row kernels (the default is the peers' kernels: repacked weights, f16 K cache)
        out.append(ServerSpec("lloyal serve --batch-invariant", [*lloyal_cmd, "--batch-invariant"], True))
    if LLAMA_SERVER.exists():
        out.append(
            ServerSpec(
                "llama-server",
                [str(LLAMA_SERVER), "-m", str(model), "-c", str(n_ctx), *_LLAMA_SERVER_ARGS, *gpu],
                False,
            )
        )
    # llama_cpp.server ships with llama-cpp-python but imports its [server] extra's packages.
    server_extra = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
    if all(importlib.util.find_spec(m) for m in server_extra):
        out.append(
            ServerSpec(
                "llama-cpp-python server",
                [py, "-m", "llama_cpp.server", "--model", str(model), *_LLAMA_CPP_PYTHON_ARGS],
                False,
            )
        )
    return out


@contextlib.contextmanager
def running(spec: ServerSpec) -> Iterator[str]:
    """Start ``spec`` on a free loopback port; yield its base URL once it serves the model."""
    port = _free_port()
    cmd = [c.replace("{port}", str(port)) for c in spec.cmd]
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"{spec.name.replace(' ', '_')}.log", "wb")  # noqa: SIM115
    p = subprocess.Popen(cmd, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"{spec.name} exited with {p.returncode}: see {log.name}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{spec.name} did not start in 180 s: see {log.name}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()


# -- prompts ---------------------------------------------------------------------------------

WORDS = [
    *("harbour", "lantern", "copper", "meadow", "granite", "willow", "orbit", "velvet", "cedar"),
    *("signal", "quartz", "ember", "falcon", "tundra", "marble", "saffron", "glacier", "pepper"),
    *("canyon", "violet", "thunder", "plume", "anchor", "juniper"),
]


def _fit(ctx: lloyal.Context, words: list[str], n_tokens: int) -> str:
    """The longest prefix of ``words`` (joined) that is at most ``n_tokens`` tokens."""
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(ctx.tokenize(" ".join(words[:mid]))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def system_text(ctx: lloyal.Context, n_tokens: int, salt: str = "") -> str:
    rules = [
        f"Rule {i}{salt}: the {WORDS[i % len(WORDS)]} office answers questions about the "
        f"{WORDS[(i * 7) % len(WORDS)]} account within {i % 9 + 1} days."
        for i in range(400)
    ]
    return _fit(ctx, " ".join(rules).split(), n_tokens)


def shared_prompts(system: str, count: int) -> list[str]:
    return [
        f"{system}\nQuestion {i}: what does the {WORDS[i % len(WORDS)]} office do?\nAnswer:"
        for i in range(count)
    ]


def distinct_prompts(ctx: lloyal.Context, count: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        words = [f"Story {seed}-{i} ({rng.randrange(10**6)}):"] + [rng.choice(WORDS) for _ in range(hi * 2)]
        out.append(_fit(ctx, words, rng.randint(lo, hi)))
    return out


# -- load ------------------------------------------------------------------------------------


@dataclass
class Result:
    server: str
    load: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def ttft(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _body(prompt: str, max_tokens: int, n: int = 1, seed: int = 0) -> dict[str, Any]:
    return {
        "model": "m",  # lloyal checks it: replaced by the served id
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8 if n > 1 else 0.0,
        "seed": seed,
        "n": n,
        "stream": True,
        "ignore_eos": True,  # llama-server; the others ignore it
        "logit_bias": {"1": -100, "106": -100},  # Gemma's <eos> and <end_of_turn>: run to max_tokens
    }


async def stream_one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[float, int, set[int]]:
    """(TTFT, tokens streamed, choice indices seen) of one streamed completion."""
    t0 = time.perf_counter()
    ttft, tokens, indices = float("nan"), 0, set()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            for c in chunk.get("choices") or []:
                if c.get("finish_reason") and not c.get("text"):
                    continue
                tokens += 1
                indices.add(int(c.get("index", 0)))
                if tokens == 1:
                    ttft = time.perf_counter() - t0
    return ttft, tokens, indices


async def run_load(
    server: str, url: str, load: str, prompts: list[str], concurrency: int, max_tokens: int, model: str
) -> Result:
    sem = asyncio.Semaphore(concurrency)
    res = Result(server, load, concurrency, len(prompts), 0, 0.0)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def one(i: int, p: str) -> None:
            async with sem:
                body = _body(p, max_tokens, seed=i) | {"model": model}
                ttft, tokens, _ = await stream_one(client, url, body)
                res.ttft_s.append(ttft)
                res.tokens += tokens

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        res.wall_s = time.perf_counter() - t0
    return res


async def run_n(
    server: str, url: str, prompt: str, n: int, max_tokens: int, model: str, native: bool
) -> Result:
    """``n`` completions of one prompt: one request with ``n`` where the server answers it,
    else (the peers answer one choice) ``n`` concurrent requests, which is what a user does."""
    res = Result(server, f"n={n}", n if not native else 1, 1 if native else n, 0, 0.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        t0 = time.perf_counter()
        if native:
            ttft, tokens, idx = await stream_one(
                client, url, _body(prompt, max_tokens, n=n) | {"model": model}
            )
            assert idx == set(range(n)), f"{server} answered choices {sorted(idx)} for n={n}"
            res.ttft_s, res.tokens, res.note = [ttft], tokens, f"one request, n={n}"
        else:
            outs = await asyncio.gather(
                *(
                    stream_one(client, url, _body(prompt, max_tokens, seed=i) | {"model": model})
                    for i in range(n)
                )
            )
            res.ttft_s = [o[0] for o in outs]
            res.tokens = sum(o[1] for o in outs)
            res.note = f"{n} concurrent requests (no n)"
        res.wall_s = time.perf_counter() - t0
    return res


async def cache_hit_vs_miss(
    url: str, ctx: lloyal.Context, size: Size, model: str, server: str = "lloyal serve"
) -> list[Result]:
    """TTFT of a new ~system_tokens prompt (miss) and of the same prompt + another question (hit)."""
    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for k in range(3):
            system = system_text(ctx, size.system_tokens, salt=f"-{k}-{time.time_ns()}")
            q1, q2 = shared_prompts(system, 2)
            for load, p in (("cache miss", q1), ("cache hit", q2)):
                t0 = time.perf_counter()
                ttft, tokens, _ = await stream_one(client, url, _body(p, 4) | {"model": model})
                r = Result(server, load, 1, 1, tokens, time.perf_counter() - t0, [ttft])
                out.append(r)
    return out


def _served_model(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


LOADS = ("shared-prefix", "distinct", "n", "cache")


def bench(
    size: Size,
    only: set[str] | None = None,
    invariant: bool = False,
    extra: Sequence[str] = (),
    loads: Sequence[str] = LOADS,
    ngl: int = 0,
) -> list[Result]:
    model = lloyal.default_model_path()
    with lloyal.Context(model, n_ctx=4096) as ctx:
        system = system_text(ctx, size.system_tokens)
        most = max(size.requests_per_level, *size.concurrencies)
        shared = shared_prompts(system, most)
        # Fresh prompts per concurrency level: nothing shared, nothing seen by an earlier level.
        distinct = {c: distinct_prompts(ctx, most, *size.distinct, seed=c) for c in size.concurrencies}
        n_ctx = SLOTS * (max(size.system_tokens, size.distinct[1]) + size.max_tokens + 64)
        results: list[Result] = []
        (ROOT / "benches" / "results").mkdir(exist_ok=True)
        for spec in servers(model, n_ctx, invariant, extra, ngl):
            if only and spec.name.split()[0] not in only:
                continue
            with running(spec) as url:
                served = _served_model(url)
                warm = run_load(spec.name, url, "warm-up", ["Hello there"], 1, 4, served)
                asyncio.run(warm)  # graph allocation, first-touch of the weights: not measured
                for load in ("shared-prefix", "distinct"):
                    if load not in loads:
                        continue
                    for c in size.concurrencies:
                        count = max(size.requests_per_level, c)
                        prompts = (shared if load == "shared-prefix" else distinct[c])[:count]
                        r = asyncio.run(run_load(spec.name, url, load, prompts, c, size.max_tokens, served))
                        print(_row(r), flush=True)
                        results.append(r)
                if "n" in loads:
                    # A prompt of the shared load's length that no server has seen: every server
                    # starts cold (llama-server keeps earlier prompts in its host-memory prompt
                    # cache, lloyal in its prefix cache; either would measure the cache instead).
                    fresh = system_text(ctx, size.system_tokens, salt=f"-n-{time.time_ns()}")
                    r = asyncio.run(
                        run_n(
                            spec.name,
                            url,
                            shared_prompts(fresh, 1)[0],
                            size.n,
                            size.max_tokens,
                            served,
                            spec.n_native,
                        )
                    )
                    print(_row(r), flush=True)
                    results.append(r)
                if spec.name.startswith("lloyal serve") and "cache" in loads:
                    for r in asyncio.run(cache_hit_vs_miss(url, ctx, size, served, spec.name)):
                        print(_row(r), flush=True)
                        results.append(r)
    return results


def paired(
    size: Size,
    rounds: int,
    only: set[str] | None = None,
    extra: Sequence[str] = (),
    loads: Sequence[str] = ("distinct",),
    ngl: int = 0,
) -> list[Result]:
    """Every server up at once; each round runs every (load, concurrency) on each server in turn,
    the order rotating by round, on prompts no server has seen (fresh per round): ratios are then
    taken round by round (:func:`paired_ratios`), so a noisy stretch of the machine hits both."""
    model = lloyal.default_model_path()
    with lloyal.Context(model, n_ctx=4096) as ctx, contextlib.ExitStack() as stack:
        n_ctx = SLOTS * (max(size.system_tokens, size.distinct[1]) + size.max_tokens + 64)
        specs = [s for s in servers(model, n_ctx, False, extra, ngl) if not only or s.name.split()[0] in only]
        urls = {s.name: stack.enter_context(running(s)) for s in specs}
        served = {name: _served_model(url) for name, url in urls.items()}
        for name, url in urls.items():
            asyncio.run(run_load(name, url, "warm-up", ["Hello there"], 1, 4, served[name]))
        most = max(size.requests_per_level, *size.concurrencies)
        results: list[Result] = []
        for k in range(rounds):
            for load in [ld for ld in ("shared-prefix", "distinct") if ld in loads]:
                for c in size.concurrencies:
                    count = max(size.requests_per_level, c)
                    if load == "distinct":
                        prompts = distinct_prompts(ctx, most, *size.distinct, seed=1000 * k + c)[:count]
                    else:
                        system = system_text(ctx, size.system_tokens, salt=f"-r{k}-c{c}")
                        prompts = shared_prompts(system, most)[:count]
                    names = list(urls)
                    names = names[k % len(names) :] + names[: k % len(names)]
                    for name in names:
                        before = engine_counters(urls[name])
                        r = asyncio.run(
                            run_load(name, urls[name], load, prompts, c, size.max_tokens, served[name])
                        )
                        r.note = f"round {k}{engine_note(before, engine_counters(urls[name]))}"
                        print(_row(r), flush=True)
                        results.append(r)
    return results


_ENGINE_KEYS = ("ticks", "rows", "tick_seconds", "decode_seconds")


def engine_counters(url: str) -> dict[str, float] | None:
    """`lloyal serve`'s engine counters (``/metrics``), None from another server."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = {}
    for key in _ENGINE_KEYS:
        m = re.search(rf"^lloyal_engine_{key}_total (\S+)$", text, re.M)
        if m is None:
            return None
        values[key] = float(m.group(1))
    return values


def engine_note(before: dict[str, float] | None, after: dict[str, float] | None) -> str:
    """What a run cost lloyal's engine: ticks, rows, ms a tick inside ``llama_decode`` and
    around it (where a step's time goes on a GPU, whose decode is short)."""
    if before is None or after is None:
        return ""
    d = {k: after[k] - before[k] for k in _ENGINE_KEYS}
    if d["ticks"] <= 0:
        return ""
    per = 1000 / d["ticks"]
    host = d["tick_seconds"] - d["decode_seconds"]
    return (
        f"; engine: {d['ticks']:.0f} ticks, {d['rows']:.0f} rows, {d['decode_seconds'] * per:.2f} ms a tick "
        f"in llama_decode + {host * per:.2f} around it"
    )


def paired_ratios(results: list[Result]) -> list[str]:
    """Per (load, concurrency): the median and range of lloyal ÷ llama-server tok/s over rounds."""
    by: dict[tuple[str, int, str], dict[str, Result]] = {}
    for r in results:
        by.setdefault((r.load, r.concurrency, r.note), {})[r.server] = r
    ratios_: dict[tuple[str, int], list[float]] = {}
    ttfts: dict[tuple[str, int], list[float]] = {}
    for (load, c, _), rs in by.items():
        mine, peer = rs.get("lloyal serve"), rs.get("llama-server")
        if mine and peer and peer.tok_s:
            ratios_.setdefault((load, c), []).append(mine.tok_s / peer.tok_s)
            ttfts.setdefault((load, c), []).append(
                statistics.median(mine.ttft_s) / statistics.median(peer.ttft_s)
            )
    return [
        f"| {load} | {c} | {len(xs)} | {statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f}) | "
        f"{statistics.median(ttfts[(load, c)]):.2f}x |"
        for (load, c), xs in sorted(ratios_.items())
    ]


# -- report ----------------------------------------------------------------------------------


def _row(r: Result) -> str:
    return (
        f"| {r.server} | {r.load} | {r.concurrency} | {r.requests} | {r.tokens} | {r.wall_s:.2f} | "
        f"{r.tok_s:.1f} | {statistics.median(r.ttft_s):.3f} | {r.ttft(0.9):.3f} | {r.note} |"
    )


HEADER = (
    "| server | load | concurrency | requests | tokens | wall s | tok/s | TTFT median s | TTFT p90 s "
    "| note |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def ratios(results: list[Result]) -> list[str]:
    """lloyal against llama-server, load by load (same run)."""
    by = {(r.server, r.load, r.concurrency): r for r in results}
    out = []
    for (server, load, c), r in sorted(by.items()):
        mine = server.startswith("lloyal serve")
        peer = by.get(("llama-server", load, c)) if mine else None
        if peer is None and mine and load.startswith("n="):
            peer = next((p for (s, ld, _), p in by.items() if s == "llama-server" and ld == load), None)
        if peer is None:
            continue
        out.append(
            f"| {server} | {load} | {c} | {r.tok_s / peer.tok_s:.2f}x | "
            f"{statistics.median(r.ttft_s) / statistics.median(peer.ttft_s):.2f}x |"
        )
    hits = [r for r in results if r.load == "cache hit" and r.server == "lloyal serve"]
    misses = [r for r in results if r.load == "cache miss" and r.server == "lloyal serve"]
    if hits and misses:
        h = statistics.median(x.ttft_s[0] for x in hits)
        m = statistics.median(x.ttft_s[0] for x in misses)
        out.append(f"| lloyal serve | cache hit / miss TTFT | 1 | | {h / m:.2f}x ({h:.3f} s / {m:.3f} s) |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--full", action="store_true", help="full sizes (default: smoke sizes)")
    ap.add_argument(
        "--only", default="", help="comma-separated first words of server names (lloyal,llama-server,...)"
    )
    ap.add_argument("--invariant", action="store_true", help="also run `lloyal serve --batch-invariant`")
    ap.add_argument("--lloyal-args", default="", help="more `lloyal serve` options, e.g. '--prefill-chunk 0'")
    ap.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated subset of {','.join(LOADS)}")
    ap.add_argument("--json", default=str(ROOT / "benches/results/server.json"))
    ap.add_argument("--ngl", type=int, default=0, help="layers on a GPU, both servers (-ngl)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="paired mode: every server up at once, this many interleaved rounds of the "
        "shared-prefix/distinct loads, per-round ratios (median and range)",
    )
    ap.add_argument(
        "--concurrency", default="", help="comma-separated subset of the size's concurrency levels (e.g. 1)"
    )
    args = ap.parse_args(argv)
    loads = [x for x in args.loads.split(",") if x]
    if unknown := set(loads) - set(LOADS):
        ap.error(f"unknown --loads {sorted(unknown)}: choose from {','.join(LOADS)}")
    size = FULL if args.full else SMOKE
    if args.concurrency:
        levels = tuple(int(c) for c in args.concurrency.split(",") if c)
        if not set(levels) <= set(size.concurrencies):
            ap.error(f"--concurrency {levels}: choose from {size.concurrencies}")
        size = replace(size, concurrencies=levels)
    print(f"threads={THREADS} size={asdict(size)}\n{HEADER}", flush=True)
    only = {x for x in args.only.split(",") if x} or None
    if args.rounds > 0:
        results = paired(size, args.rounds, only, shlex.split(args.lloyal_args), loads, args.ngl)
        print("\n| load | concurrency | rounds | lloyal ÷ llama-server tok/s, median (range) | TTFT median |")
        print("| --- | --- | --- | --- | --- |")
        print("\n".join(paired_ratios(results)))
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
        return 0
    results = bench(size, only, args.invariant, shlex.split(args.lloyal_args), loads, args.ngl)
    print("\n| lloyal | load | concurrency | ÷ llama-server tok/s | ÷ llama-server TTFT median |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(ratios(results)))
    Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


# -- smoke (pytest benches) --------------------------------------------------------------------


def test_server_bench_smoke() -> None:
    """Every load once at smoke size against lloyal and the peers present: all tokens arrive."""
    results = bench(SMOKE)
    loads = [(r.load, r.concurrency) for r in results if r.server == "lloyal serve"]
    assert loads[: 2 * len(SMOKE.concurrencies)] == [
        (ld, c) for ld in ("shared-prefix", "distinct") for c in SMOKE.concurrencies
    ]
    for r in results:
        assert all(t > 0 for t in r.ttft_s), r
        if r.server != "lloyal serve":  # llama-cpp-python's server cuts a stream short when another comes
            assert r.tokens > 0, r
            continue
        want = r.requests * SMOKE.max_tokens * (SMOKE.n if r.note.startswith("one request") else 1)
        assert r.tokens == (4 if r.load.startswith("cache") else want), r
    assert ratios(results) and ratios(results)[-1].startswith("| lloyal serve | cache hit / miss TTFT")


if __name__ == "__main__":
    raise SystemExit(main())
