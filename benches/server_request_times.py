"""Where a concurrency-1 round's time goes: each request's TTFT and its ms per token after the
first, lloyal serve against llama-server (and optional llama-server variants), servers
alternating round by round.

A round is bench_server.py's shared-prefix load at concurrency 1: a ~1000-token prompt no server
has seen (a miss), then a second prompt on the same system text (a hit on its prefix), each
streaming 64 tokens. Medians per server:

    python benches/server_request_times.py --rounds 6
    python benches/server_request_times.py --rounds 6 --variant=--swa-full \\
        --variant-server target/peers/same-ggml-server/build/bin/llama-server

``--variant ARGS`` adds llama-server with ARGS (leading ``NAME=VALUE`` words set its
environment), ``--lloyal-variant ARGS`` lloyal serve with ARGS; ``--variant-server PATH`` adds
another llama-server binary (``benches/cpu_peer_server.sh`` builds one on lloyal's own llama.cpp).
Weights in huge pages on both sides (lloyal's default, llama-server's with glibc's THP tunable):

    python benches/server_request_times.py --rounds 6 --lloyal-variant=--mmap \
        --variant="GLIBC_TUNABLES=glibc.malloc.hugetlb=1 -lm none"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import statistics
import time
from typing import Any

import bench_server as bs
import httpx

import lloyal


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, float, float]:
    """(TTFT s, ms per token after the first, total s) of one streamed completion."""
    t0 = time.perf_counter()
    first, n, _ = await bs.stream_one(client, url, body)
    total = time.perf_counter() - t0
    return first, (total - first) * 1000 / max(1, n - 1), total


Times = tuple[float, float, float]


async def _round(url: str, model: str, prompts: list[str], max_tokens: int) -> list[Times]:
    """Each prompt in turn, one at a time."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        bodies = [bs._body(p, max_tokens, seed=i) | {"model": model} for i, p in enumerate(prompts)]
        return [await _one(client, url, body) for body in bodies]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--variant", action="append", default=[], help="llama-server with these extra args")
    ap.add_argument("--variant-server", action="append", default=[], help="another llama-server binary")
    ap.add_argument("--lloyal-variant", action="append", default=[], help="lloyal serve with these args")
    a = ap.parse_args(argv)
    size = bs.FULL
    model = lloyal.default_model_path()
    n_ctx = bs.SLOTS * (max(size.system_tokens, size.distinct[1]) + size.max_tokens + 64)
    specs = [s for s in bs.servers(model, n_ctx) if s.name in ("lloyal serve", "llama-server")]
    peer = next((s for s in specs if s.name == "llama-server"), None)
    if peer is None:
        raise SystemExit(f"no llama-server at {bs.LLAMA_SERVER}: run make bench-peers-cpp")
    for args in a.variant:
        words = args.split()
        env = [w for w in words if "=" in w and not w.startswith("-")]
        rest = [w for w in words if w not in env]
        cmd = [*(["env", *env] if env else []), *peer.cmd, *rest]
        specs.append(dataclasses.replace(peer, name=f"llama-server {args}", cmd=cmd))
    mine = next(s for s in specs if s.name == "lloyal serve")
    for args in a.lloyal_variant:
        specs.append(dataclasses.replace(mine, name=f"lloyal serve {args}", cmd=[*mine.cmd, *args.split()]))
    for i, path in enumerate(a.variant_server, 2):
        print(f"llama-server #{i}: {path}")
        specs.append(dataclasses.replace(peer, name=f"llama-server #{i}", cmd=[path, *peer.cmd[1:]]))
    with lloyal.Context(model, n_ctx=4096) as ctx, contextlib.ExitStack() as stack:
        urls = {s.name: stack.enter_context(bs.running(s)) for s in specs}
        served = {name: bs._served_model(url) for name, url in urls.items()}
        for name, url in urls.items():
            asyncio.run(_round(url, served[name], ["Hello there"], 4))
        times: dict[str, list[list[Times]]] = {name: [] for name in urls}
        for k in range(a.rounds):
            prompts = bs.shared_prompts(bs.system_text(ctx, size.system_tokens, salt=f"-t{k}"), 2)
            names = list(urls)
            for name in names[k % len(names) :] + names[: k % len(names)]:
                times[name].append(asyncio.run(_round(urls[name], served[name], prompts, size.max_tokens)))
    print("| server | miss TTFT s | hit TTFT s | ms/token (miss) | ms/token (hit) | round s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rounds in times.items():
        med = [statistics.median(r[j][i] for r in rounds) for j in (0, 1) for i in (0, 1)]
        whole = statistics.median(r[0][2] + r[1][2] for r in rounds)
        print(f"| {name} | {med[0]:.3f} | {med[2]:.3f} | {med[1]:.2f} | {med[3]:.2f} | {whole:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
