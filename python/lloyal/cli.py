"""The ``lloyal`` command line (also ``python -m lloyal``): demo, generate, best-of-n, bench, info.

Every command uses the embedded Gemma 3 270M unless ``--model`` (or ``LLOYAL_MODEL``) names a GGUF;
``--jsonl`` prints machine-readable JSON lines instead of text. Progress bars (model assembly on
first use, long prefills, demo steps, best-of-n tokens) go to stderr, and only when stderr is a terminal.

Example:
    $ lloyal demo                               # 4 branches from one prompt, decoded in lockstep
    $ lloyal generate "Once upon a time" -n 40  # streamed text
    $ lloyal best-of-n "The sea was" -n 8 --tree tree.html
    $ lloyal info                               # architecture, vocab, context, chat template
    $ lloyal bench -b 1,2,4,8                   # batched throughput table (B, S_PP, S_TG)

The same from Python (``main`` returns the exit status):
    >>> main(["info", "--jsonl"])  # doctest: +ELLIPSIS
    {"path": "...", "name": ..., "architecture": "gemma3", "n_vocab": 262144, ...}
    0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import lloyal
from lloyal import _lloyal, progress, strategies
from lloyal.scheduling import Done, GenSpec, Scheduler, TokenEvent
from lloyal.tree_html import TreeNode, write_tree_html

__all__ = ["main"]

DEMO_PROMPT = "The old lighthouse keeper opened the door and saw"


def _model_path(arg: str | None) -> Path:
    """``--model`` if given, else ``LLOYAL_MODEL``, else the embedded model (assembled with a bar)."""
    return Path(arg) if arg else lloyal.default_model_path(stream=sys.stderr)


def _json_float(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)


def _open(
    path: Path, prompt: str, new_cells: int, n_seq_max: int, threads: int | None
) -> tuple[lloyal.Context, list[int]]:
    """A context sized for ``prompt`` plus ``new_cells`` generated cells, and the prompt's tokens."""
    model = lloyal.Model(path)
    with lloyal.Context(model, n_ctx=256) as probe:
        tokens = probe.tokenize(prompt)
    if not tokens:
        raise ValueError("the prompt is empty")
    need = len(tokens) + new_cells + 8
    if need > model.n_ctx_train:
        raise ValueError(
            f"the prompt ({len(tokens)} tokens) plus {new_cells} generated tokens exceed the model's "
            f"context of {model.n_ctx_train}: shorten the prompt or lower --max-tokens / -n"
        )
    n_ctx = max(512, -(-need // 256) * 256)
    return lloyal.Context(model, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=threads), tokens


class _Candidate(NamedTuple):
    """One best-of-n candidate as the CLI prints it."""

    branch: int
    tokens: int
    text: str
    perplexity: float
    stopped: bool  # ended on a stop token (otherwise it reached max_tokens)


@dataclass(frozen=True)
class _BestOfNRun:
    """Best-of-n candidates (in the order their branches were made), the winner, and what the
    CLI reports: prompt, decodes, wall time."""

    prompt: str
    prompt_tokens: int
    candidates: list[_Candidate]
    winner: int
    steps: int  # generation steps: the longest candidate's tokens
    decode_calls: int  # llama_decode calls while generating (the prompt's excepted)
    seconds: float

    @property
    def generated(self) -> int:
        """Tokens generated over all candidates."""
        return sum(c.tokens for c in self.candidates)

    def tree(self) -> TreeNode:
        """The branch tree as plain data for :mod:`lloyal.tree_html`."""
        kids = tuple(
            TreeNode(f"branch {c.branch}", c.text, c.tokens, c.perplexity, c.branch == self.winner)
            for c in self.candidates
        )
        return TreeNode("prompt", self.prompt, self.prompt_tokens, children=kids)


def _lockstep_best_of_n(
    ctx: lloyal.Context, prompt: str, prompt_tokens: Sequence[int], n: int, max_tokens: int, seed: int
) -> _BestOfNRun:
    """:func:`lloyal.strategies.best_of_n` (one ``BranchStore.commit`` per step) with a step
    bar, for the demo; the winner is pruned afterwards."""
    params = lloyal.SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed)
    start = time.perf_counter()
    with progress.Progress(max_tokens, "best-of-n", unit="steps") as bar:
        best = strategies.best_of_n(
            ctx,
            prompt_tokens,
            n,
            params,
            max_tokens,
            seed=seed,
            on_step=lambda live: bar.update(note=f"{live}/{n} live"),
        )
    seconds = time.perf_counter() - start
    best.branch.prune()
    b = best
    kids = [_Candidate(i, len(b.tokens[i]), b.texts[i], b.perplexities[i], b.stopped[i]) for i in range(n)]
    return _BestOfNRun(prompt, len(prompt_tokens), kids, b.index, b.steps, b.steps, seconds)


def _scheduled_best_of_n(
    ctx: lloyal.Context,
    prompt: str,
    prompt_tokens: Sequence[int],
    n: int,
    max_tokens: int,
    params: lloyal.SamplingParams,
    seed: int,
) -> _BestOfNRun:
    """One request of ``best_of=n`` choices on :class:`lloyal.scheduling.Scheduler` (the
    best-of-N of the OpenAI server and Ray Data: the choices generate together in the engine,
    candidate ``i`` seeded ``seed + 1 + i``), with a token bar."""
    spec = GenSpec(list(prompt_tokens), params, max_tokens, n=n, best_of=n, seed=seed + 1, rank=True)

    async def run(bar: progress.Progress) -> Done:
        sched = Scheduler(ctx, max_running=n, cache_cells=0, reserve=True)
        try:
            async for ev in sched.generate(spec):
                if isinstance(ev, Done):
                    return ev
                if isinstance(ev, TokenEvent):
                    bar.update(int(ev.token >= 0))
        finally:
            await sched.stop()
        raise RuntimeError("the scheduler ended the request without its result")  # pragma: no cover

    start = time.perf_counter()
    with progress.Progress(n * max_tokens, "best-of-n", unit="tokens") as bar:
        prompt_calls = -(-len(prompt_tokens) // ctx.n_batch)
        before = ctx.engine_stats().decode_calls + prompt_calls
        done = asyncio.run(run(bar))
    seconds = time.perf_counter() - start
    kids = [
        _Candidate(i, done.lengths[i], done.texts[i], done.perplexities[i], done.finish_reasons[i] == "stop")
        for i in range(n)
    ]
    calls = ctx.engine_stats().decode_calls - before
    return _BestOfNRun(prompt, len(prompt_tokens), kids, done.choices[0], max(done.lengths), calls, seconds)


def _best_of_n_summary(r: _BestOfNRun) -> dict[str, Any]:
    return {
        "winner": r.winner,
        "perplexity": _json_float(r.candidates[r.winner].perplexity),
        "text": r.candidates[r.winner].text,
        "n": len(r.candidates),
        "prompt_tokens": r.prompt_tokens,
        "steps": r.steps,
        "decode_calls": r.decode_calls,
        "tokens": r.generated,
        "seconds": r.seconds,
        "tokens_per_s": r.generated / r.seconds if r.seconds > 0 else 0.0,
    }


def best_of_n(
    model: str | None,
    prompt: str,
    n: int,
    max_tokens: int,
    temperature: float,
    seed: int,
    tree: str | None,
    jsonl: bool,
    threads: int | None = None,
) -> int:
    """``lloyal best-of-n``: candidates and the winner (JSON lines with ``--jsonl``), optional HTML tree."""
    if not 1 <= n <= 255 or max_tokens < 1:
        raise ValueError("-n must be in 1..255 and --max-tokens at least 1")
    # the choices fork a root that holds the prompt: n + 1 leases
    ctx, toks = _open(_model_path(model), prompt, n * max_tokens, n + 1, threads)
    with ctx:
        params = lloyal.SamplingParams(temperature=temperature, top_k=40, top_p=0.95, seed=seed)
        r = _scheduled_best_of_n(ctx, prompt, toks, n, max_tokens, params, seed)
    if tree:
        subtitle = (
            f"best of {n} (winner: lowest perplexity) · up to {max_tokens} tokens · "
            f"temperature {temperature} · seed {seed}"
        )
        write_tree_html(tree, r.tree(), title="lloyal best-of-n", subtitle=subtitle)
    summary = {**_best_of_n_summary(r), "tree": tree}
    if jsonl:
        for c in r.candidates:
            _emit(
                {
                    "event": "candidate",
                    "branch": c.branch,
                    "tokens": c.tokens,
                    "perplexity": _json_float(c.perplexity),
                    "stopped": c.stopped,
                    "winner": c.branch == r.winner,
                    "text": c.text,
                }
            )
        _emit({"event": "summary", **summary})
        return 0
    for c in r.candidates:
        mark = "  <- winner" if c.branch == r.winner else ""
        end = "stop token" if c.stopped else "max tokens"
        print(f"--- branch {c.branch}  tokens {c.tokens}  perplexity {c.perplexity:.2f}  ({end}){mark}")
        print(prompt + c.text)
    print(
        f"\nwinner: branch {r.winner} of {n} (perplexity {r.candidates[r.winner].perplexity:.2f}); "
        f"{r.generated} tokens in {r.decode_calls} decodes, {summary['tokens_per_s']:.1f} tok/s"
    )
    if tree:
        print(f"tree: {tree}")
    return 0


def demo(
    model: str | None, prompt: str, n: int, max_tokens: int, jsonl: bool, threads: int | None = None
) -> int:
    """Fork ``n`` branches from one prompt, decode them in lockstep (one decode per step)."""
    if not 1 <= n <= 255 or max_tokens < 1:
        raise ValueError("-n must be in 1..255 and --max-tokens at least 1")
    ctx, toks = _open(_model_path(model), prompt, n * max_tokens, n, threads)
    with ctx:
        r = _lockstep_best_of_n(ctx, prompt, toks, n, max_tokens, seed=7)
    summary = _best_of_n_summary(r)
    for c in r.candidates:
        if jsonl:
            ppl = _json_float(c.perplexity)
            _emit({"branch": c.branch, "perplexity": ppl, "tokens": c.tokens, "text": c.text})
        else:
            mark = "  <- winner" if c.branch == r.winner else ""
            print(f"--- branch {c.branch}  perplexity {c.perplexity:.2f}  tokens {c.tokens}{mark}")
            print(prompt + c.text)
    if jsonl:
        keys = ("winner", "perplexity", "steps", "decode_calls", "tokens", "tokens_per_s")
        _emit({"summary": {k: summary[k] for k in keys}})
    else:
        print(
            f"\nwinner: branch {r.winner} (perplexity {r.candidates[r.winner].perplexity:.2f}); "
            f"{r.generated} tokens in {r.steps} lockstep decodes, {summary['tokens_per_s']:.1f} tok/s"
        )
    return 0


def generate(
    model: str | None,
    prompt: str,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    jsonl: bool,
    threads: int | None = None,
) -> int:
    """Stream one completion of ``prompt`` (text, or one JSON line per token and a summary)."""
    if max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    ctx, toks = _open(_model_path(model), prompt, max_tokens, 1, threads)
    with ctx:
        params = lloyal.SamplingParams(temperature=temperature, seed=seed)
        with lloyal.Branch.create(ctx, 0, params) as b:
            progress.prefill(b, toks)
            if not jsonl:
                sys.stdout.write(prompt)
            pieces: list[str] = []
            start = time.perf_counter()
            for i, tok in enumerate(b.generate(max_tokens)):
                pieces.append(tok.text)
                if jsonl:
                    _emit({"event": "token", "index": i, "token": tok.token, "text": tok.text})
                else:
                    sys.stdout.write(tok.text)
                    sys.stdout.flush()
            seconds = time.perf_counter() - start
            if jsonl:
                _emit(
                    {
                        "event": "summary",
                        "prompt_tokens": len(toks),
                        "tokens": len(pieces),
                        "stopped": len(pieces) < max_tokens,
                        "perplexity": _json_float(b.perplexity),
                        "seconds": seconds,
                        "tokens_per_s": len(pieces) / seconds if seconds > 0 else 0.0,
                        "text": "".join(pieces),
                    }
                )
            else:
                sys.stdout.write("\n")
    return 0


def info(model: str | None, jsonl: bool) -> int:
    """Print a model's architecture, vocabulary, context and chat template (``--jsonl``: one object)."""
    m = lloyal.Model(_model_path(model))
    template = m.chat_template
    facts: dict[str, Any] = {
        "path": os.fspath(m.path),
        "name": m.meta("general.name"),
        "architecture": m.architecture,
        "n_vocab": m.n_vocab,
        "n_ctx_train": m.n_ctx_train,
        "n_embd": m.n_embd,
        "n_layer": m.n_layer,
        "n_params": m.n_params,
        "size_bytes": m.size,
        "chat_template": template is not None,
        **_cpu_facts(),
    }
    if jsonl:
        _emit(facts)
        return 0
    notes = {
        "n_vocab": "tokens in the vocabulary",
        "n_ctx_train": "training context (tokens)",
        "n_params": f"{m.n_params / 1e6:.0f} M parameters",
        "size_bytes": f"{m.size / 2**20:.1f} MiB",
        "chat_template": "in the GGUF" if template else "none in the GGUF: format_chat uses a built-in one",
        "build_cpu": "features this build's code uses (-march=native for a native build)",
        "host_cpu": "the same features as this host's kernel reports them (/proc/cpuinfo)",
        "cpu_backend": "llama.cpp's CPU backend as it runs here",
    }
    for k, v in facts.items():
        note = f"  ({notes[k]})" if k in notes else ""
        print(f"{k:14} {v}{note}")
    return 0


def _cpu_facts() -> dict[str, Any]:
    """The build's CPU features next to the host's, and the CPU backend llama.cpp runs."""
    from lloyal import _cpu

    build = _cpu.build_cpu()
    host = _cpu.host_features()
    checked = build.checked or build.features
    cpu_backend = next((g.strip() for g in lloyal.system_info().split("CPU :")[1:2]), "")
    return {
        "build": f"{build.kind} {build.arch}",
        "build_cpu": " ".join(build.features) or "baseline",
        "host_cpu": "unknown" if host is None else " ".join(f for f in checked if f in host) or "baseline",
        "cpu_missing": " ".join(_cpu.missing(build, host)) or "none",
        "cpu_backend": cpu_backend,
    }


_F32_MAX = 3.4028234663852886e38  # the largest float32: llama.cpp scales adapters in float32


def _lora_flags(plain: list[str], scaled: list[str]) -> tuple[tuple[Path, float], ...]:
    """``--lora FNAME`` and ``--lora-scaled FNAME:SCALE`` (each comma-separated, repeatable) as
    ``(path, scale)`` pairs in the order given, ``--lora`` first (llama-server's syntax)."""
    out = [(Path(f.strip()), 1.0) for flag in plain for f in flag.split(",") if f.strip()]
    for flag in scaled:
        for item in (i.strip() for i in flag.split(",") if i.strip()):
            path, sep, scale = item.rpartition(":")
            try:
                value = float(scale)
            except ValueError:
                value = math.nan
            if not sep or not path or not math.isfinite(value):
                raise ValueError(f"--lora-scaled takes FNAME:SCALE (e.g. adapter.gguf:0.5), got {item!r}")
            if abs(value) > _F32_MAX:
                raise ValueError(
                    f"--lora-scaled: the scale of {item!r} is beyond a float32's range (~3.4e38)"
                )
            out.append((Path(path), value))
    return tuple(out)


def serve(args: argparse.Namespace) -> int:
    """``lloyal serve``: run the OpenAI-compatible server until Ctrl-C."""
    if args.parallel < 1 or args.n_ctx < 64:
        raise ValueError("--parallel must be >= 1 and --n-ctx >= 64")
    if args.request_timeout < 0 or args.max_queue < 0 or args.shutdown_grace < 0:
        raise ValueError("--request-timeout, --max-queue and --shutdown-grace must be >= 0")
    if args.cache_cells is not None and args.cache_cells < 0:
        raise ValueError("--cache-cells must be >= 0 (0: keep no finished request's KV)")
    if args.cache_ram < -1:
        raise ValueError("--cache-ram must be >= -1 (MiB; 0: keep no copies, -1: no limit)")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.batch_invariant and args.n_gpu_layers:
        raise ValueError(
            "--batch-invariant runs on the CPU (per-row CPU kernels): drop -ngl/--n-gpu-layers, or "
            "--batch-invariant"
        )
    try:
        from lloyal.server import ServerConfig
        from lloyal.server import serve as run_server
        from lloyal.server.state import load_weights
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    # Options whose ServerConfig field has the flag's name.
    same_name = (
        "n_ctx", "parallel", "api_key", "embeddings", "max_queue", "shutdown_grace",
        "batch_invariant", "n_gpu_layers", "prefill_chunk", "cache_cells", "cache_ram", "warmup",
    )  # fmt: skip
    model = _model_path(args.model)
    lora = _lora_flags(args.lora, args.lora_scaled)
    if args.batch_invariant and lora:
        raise ValueError(
            "--batch-invariant cannot go with --lora: llama.cpp multiplies an adapter's float matrices "
            "with a batch-dependent kernel; drop one of them"
        )
    if not args.ray:  # (on Ray the file is each node's)
        _lloyal._check_model_file(model)
    cfg = ServerConfig(
        model=model,
        n_threads=args.threads,
        model_name=args.served_model_name,
        request_timeout=args.request_timeout or None,
        use_mmap=args.mmap,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        lora=lora,
        **{name: getattr(args, name) for name in same_name},
    )
    if args.ray:
        try:
            from lloyal.ray.serve import run_on_ray
        except ImportError as exc:
            raise ValueError(f"{exc}: --ray needs the extra: pip install 'lloyal[ray]'") from None
        if args.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        run_on_ray(cfg, replicas=args.replicas, host=args.host, port=args.port, num_cpus=args.replica_cpus)
        return 0
    # The weights loaded here, as the server loads them, fail as this command's error (in the
    # server's startup they would be a traceback); held while it runs, the server finds them.
    weights = load_weights(cfg)
    run_server(cfg, host=args.host, port=args.port)
    del weights
    return 0


def _prefill_chunk(text: str) -> int | None:
    """``--prefill-chunk``: 'paced' or a token count >= 0."""
    if text == "paced":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected 'paced' or a number of tokens >= 0, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lloyal", description="Forkable, branch-parallel inference.")
    model_help = "GGUF path (default: LLOYAL_MODEL or the embedded Gemma 3 270M)"
    parser.add_argument("--model", help=model_help)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--model", default=argparse.SUPPRESS, help=model_help)  # also after the command
        if name != "info":
            p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all)")
        return p

    d = command("demo", "fork N branches from one prompt and decode them in lockstep")
    d.add_argument("--prompt", default=DEMO_PROMPT)
    d.add_argument("-n", type=int, default=4, help="number of branches (default 4)")
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--jsonl", action="store_true", help="machine-readable output")
    g = command("generate", "stream a completion")
    g.add_argument("prompt")
    g.add_argument("-n", "--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8, help="0 for greedy (default 0.8)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--jsonl", action="store_true", help="one JSON line per token, then a summary")
    b = command(
        "best-of-n", "sample N continuations together (the server's best_of), keep the lowest perplexity"
    )
    b.add_argument("prompt")
    b.add_argument("-n", type=int, default=4, help="number of candidates (default 4)")
    b.add_argument("--max-tokens", type=int, default=32, help="tokens per candidate (default 32)")
    b.add_argument("--temperature", type=float, default=0.8)
    b.add_argument("--seed", type=int, default=1, help="branch i samples with seed + 1 + i (default 1)")
    b.add_argument("--tree", metavar="HTML", help="write a self-contained HTML picture of the branch tree")
    b.add_argument("--jsonl", action="store_true", help="one JSON line per candidate, then a summary")
    i = command("info", "describe the model")
    i.add_argument("model_arg", nargs="?", metavar="MODEL", help="GGUF path (default: as --model)")
    i.add_argument("--jsonl", action="store_true", help="one JSON object")
    sv = command("serve", "OpenAI-compatible HTTP server (needs the extra: pip install 'lloyal[server]')")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--n-ctx", type=int, default=4096, help="KV cells shared by all requests (default 4096)")
    sv.add_argument("--parallel", type=int, default=8, help="completions decoded at once (default 8)")
    sv.add_argument(
        "-ngl",
        "--n-gpu-layers",
        type=int,
        default=None,
        metavar="N",
        help="layers on the GPU in a GPU build (99: all; default $LLOYAL_N_GPU_LAYERS, else 0)",
    )
    sv.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health"
    )
    sv.add_argument("--embeddings", action="store_true", help="also serve /v1/embeddings")
    sv.add_argument(
        "--allowed-origins",
        default="*",
        metavar="ORIGINS",
        help="CORS: comma-separated origins whose web pages may call the server (default '*': any; '': none)",
    )
    sv.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip decoding a token at startup (the first request then pays the backend's first-use costs)",
    )
    sv.add_argument("--served-model-name", default=None, help="the model id clients use (default: file stem)")
    sv.add_argument("--ray", action="store_true", help="serve on Ray Serve (docs/scale-out.md)")
    sv.add_argument("--replicas", type=int, default=2, help="with --ray: engines (default 2)")
    sv.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs per engine")
    sv.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="cancel a request still running after this long, answering 408 (default 600; 0: never)",
    )
    sv.add_argument(
        "--max-queue",
        type=int,
        default=512,
        metavar="N",
        help="requests that may wait for a slot; more get 429 with Retry-After (default 512)",
    )
    sv.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, time running requests get to finish before they are cancelled (default 30)",
    )
    sv.add_argument(
        "--cache-cells",
        type=int,
        default=None,
        metavar="N",
        help="most KV cells the prefix cache keeps of finished requests (default: --n-ctx times the share "
        "of recent prompts it served or would have, and at most the prompts its recent hits "
        "reached back); every cell kept slows every decode a little (docs/server.md)",
    )
    sv.add_argument(
        "--cache-ram",
        type=int,
        default=8192,
        metavar="MiB",
        help="host memory for copies of prefix cache entries evicted for room: a prompt that reuses one "
        "has it written back instead of prefilling it again, as llama-server's --cache-ram "
        "(default 8192; 0: none kept; -1: no limit)",
    )
    sv.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="FNAME",
        help="a LoRA adapter applied to every request at scale 1.0, as llama-server's --lora "
        "(comma-separated or repeated for several)",
    )
    sv.add_argument(
        "--lora-scaled",
        action="append",
        default=[],
        metavar="FNAME:SCALE",
        help="a LoRA adapter with its scale, as llama-server's --lora-scaled (comma-separated or "
        "repeated for several)",
    )
    sv.add_argument(
        "--mmap",
        action="store_true",
        help="map the weights file instead of reading it into memory (default: read, so the weights get "
        "2 MiB pages and a decode a few percent faster; a map starts sooner and shares the page cache)",
    )
    sv.add_argument(
        "--batch-invariant",
        action="store_true",
        help="per-row CPU kernels: a choice's tokens do not depend on what else is batched with it, at "
        "about a quarter of prompt speed (default: llama.cpp's fastest kernels; docs/performance.md)",
    )
    sv.add_argument(
        "--prefill-chunk",
        type=_prefill_chunk,
        default=None,
        metavar="paced|N",
        help="prompt tokens per decode step next to running requests: 'paced' (default) keeps a step "
        "at about 1.5x a decode-only step; 0 fills n_batch (most throughput, longest stalls); N caps",
    )
    bn = command("bench", "batched throughput table (llama-batched-bench style)")
    bn.add_argument("-b", "--batches", default="1,2,4,8,16", help="comma-separated batch sizes")
    bn.add_argument("--pp", type=int, default=128, help="prompt tokens")
    bn.add_argument("--tg", type=int, default=32, help="generated tokens per branch")
    bn.add_argument("--jsonl", action="store_true", help="machine-readable output")
    return parser


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "demo":
        return demo(args.model, args.prompt, args.n, args.max_tokens, args.jsonl, args.threads)
    if args.command == "generate":
        a = args
        return generate(a.model, a.prompt, a.max_tokens, a.temperature, a.seed, a.jsonl, a.threads)
    if args.command == "best-of-n":
        return best_of_n(
            args.model,
            args.prompt,
            args.n,
            args.max_tokens,
            args.temperature,
            args.seed,
            args.tree,
            args.jsonl,
            args.threads,
        )
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        from lloyal.bench import main_bench

        try:
            batches = [int(x) for x in args.batches.split(",") if x.strip()]
        except ValueError:
            parser.error(f"--batches must be comma-separated integers, got {args.batches!r}")
        return main_bench(_model_path(args.model), batches, args.pp, args.tg, args.threads, args.jsonl)
    return info(args.model_arg or args.model, args.jsonl)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lloyal`` command; the exit status (1 on an error, with a message on stderr)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _run(parser, args)
    except (lloyal.LloyalError, ValueError, OSError) as exc:
        if isinstance(exc, BrokenPipeError):  # `lloyal ... | head`: stop quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 1
        print(f"lloyal: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nlloyal: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
