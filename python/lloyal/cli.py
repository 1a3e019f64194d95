"""The ``lloyal`` command line (also ``python -m lloyal``): demo, generate, best-of-n, bench, info.

Every command uses the embedded Gemma 3 270M unless ``--model`` (or ``LLOYAL_MODEL``) names a GGUF;
``--jsonl`` prints machine-readable JSON lines instead of text. Progress bars (model assembly on
first use, long prefills, best-of-n steps) go to stderr, and only when stderr is a terminal.

Example:
    $ lloyal demo                               # 4 branches from one prompt, decoded in lockstep
    $ lloyal generate "Once upon a time" -n 40  # streamed text
    $ lloyal best-of-n "The sea was" -n 8 --tree tree.html
    $ lloyal info                               # architecture, vocab, context, chat template
    $ lloyal bench -b 1,2,4,8                   # batched throughput table (B, S_PP, S_TG)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lloyal
from lloyal import progress
from lloyal.tree_html import TreeNode, write_tree_html

__all__ = ["BestOfN", "Candidate", "main", "run_best_of_n"]

DEMO_PROMPT = "The old lighthouse keeper opened the door and saw"


def _model_path(arg: str | None) -> Path:
    """``--model`` if given, else ``LLOYAL_MODEL``, else the embedded model (assembled with a bar)."""
    return Path(arg) if arg else progress.default_model_path()


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


@dataclass(frozen=True)
class Candidate:
    """One best-of-n branch: its generated tokens and text, perplexity, and why it ended."""

    branch: int
    tokens: tuple[int, ...]
    text: str
    perplexity: float
    stopped: bool  # ended on a stop token (otherwise it reached max_tokens)


@dataclass(frozen=True)
class BestOfN:
    """The outcome of :func:`run_best_of_n`."""

    prompt: str
    prompt_tokens: int
    candidates: tuple[Candidate, ...]
    winner: int
    steps: int  # lockstep steps, each ONE BranchStore.commit (= one llama_decode) for every live branch
    seconds: float

    @property
    def generated(self) -> int:
        """Tokens generated over all candidates."""
        return sum(len(c.tokens) for c in self.candidates)

    def tree(self) -> TreeNode:
        """The branch tree as plain data for :mod:`lloyal.tree_html`."""
        kids = tuple(
            TreeNode(f"branch {c.branch}", c.text, len(c.tokens), c.perplexity, c.branch == self.winner)
            for c in self.candidates
        )
        return TreeNode("prompt", self.prompt, self.prompt_tokens, children=kids)


def run_best_of_n(
    ctx: lloyal.Context,
    prompt: str,
    prompt_tokens: Sequence[int],
    n: int,
    max_tokens: int,
    params: lloyal.SamplingParams,
    *,
    seed: int = 1,
) -> BestOfN:
    """Fork ``n`` reseeded branches from the prompt, decode in lockstep, keep the lowest perplexity.

    Each step samples every live branch in one ``produce_all`` and decodes them in one
    ``BranchStore.commit``; a branch stops on a stop token or after ``max_tokens``. The winner is
    kept with ``retain_only`` (every other lease freed). Needs ``ctx.n_seq_max >= n + 1``.
    """
    if n < 1 or max_tokens < 1:
        raise ValueError("-n and --max-tokens must be at least 1")
    store = lloyal.BranchStore(ctx)
    root = lloyal.Branch.create(ctx, 0, params)
    try:
        progress.prefill(root, prompt_tokens)
        branches = [root.fork() for _ in range(n)]
        for i, b in enumerate(branches):
            b.reseed_sampler(seed + 1 + i)
        tokens: list[list[int]] = [[] for _ in branches]
        stopped = [False] * n
        live = list(range(n))
        steps = 0
        start = time.perf_counter()
        with progress.Progress(max_tokens, "best-of-n", unit="steps") as bar:
            while live and steps < max_tokens:
                produced = store.produce_all([branches[i] for i in live])
                for i, p in zip(live, produced, strict=True):
                    stopped[i] = stopped[i] or p.is_stop
                step = [(i, p.token) for i, p in zip(live, produced, strict=True) if not p.is_stop]
                live = [i for i, _ in step]
                if not step:
                    break
                store.commit([(branches[i], t) for i, t in step])
                for i, t in step:
                    tokens[i].append(t)
                steps += 1
                bar.update(note=f"{len(live)}/{n} live")
        seconds = time.perf_counter() - start
        ppl = [b.perplexity for b in branches]
        winner = min(range(n), key=lambda i: (not math.isfinite(ppl[i]), ppl[i], i))
        candidates = tuple(
            Candidate(i, tuple(tokens[i]), ctx.detokenize(tokens[i]), ppl[i], stopped[i]) for i in range(n)
        )
        store.retain_only(branches[winner])
        branches[winner].prune()
    finally:
        root.prune_subtree()
    return BestOfN(prompt, len(prompt_tokens), candidates, winner, steps, seconds)


def _best_of_n_summary(r: BestOfN) -> dict[str, Any]:
    win = r.candidates[r.winner]
    return {
        "winner": r.winner,
        "perplexity": _json_float(win.perplexity),
        "text": win.text,
        "n": len(r.candidates),
        "prompt_tokens": r.prompt_tokens,
        "steps": r.steps,
        "decode_calls": r.steps,
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
    ctx, toks = _open(_model_path(model), prompt, n * max_tokens, n + 1, threads)
    with ctx:
        params = lloyal.SamplingParams(temperature=temperature, top_k=40, top_p=0.95, seed=seed)
        r = run_best_of_n(ctx, prompt, toks, n, max_tokens, params, seed=seed)
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
                    "tokens": len(c.tokens),
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
        print(f"--- branch {c.branch}  tokens {len(c.tokens)}  perplexity {c.perplexity:.2f}  ({end}){mark}")
        print(prompt + c.text)
    print(
        f"\nwinner: branch {r.winner} of {n} (perplexity {r.candidates[r.winner].perplexity:.2f}); "
        f"{r.generated} tokens in {r.steps} lockstep decodes, {summary['tokens_per_s']:.1f} tok/s"
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
    ctx, toks = _open(_model_path(model), prompt, n * max_tokens, n + 1, threads)
    with ctx:
        params = lloyal.SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)
        r = run_best_of_n(ctx, prompt, toks, n, max_tokens, params, seed=7)
    summary = _best_of_n_summary(r)
    for c in r.candidates:
        if jsonl:
            ppl = _json_float(c.perplexity)
            _emit({"branch": c.branch, "perplexity": ppl, "tokens": len(c.tokens), "text": c.text})
        else:
            mark = "  <- winner" if c.branch == r.winner else ""
            print(f"--- branch {c.branch}  perplexity {c.perplexity:.2f}  tokens {len(c.tokens)}{mark}")
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
    }
    for k, v in facts.items():
        note = f"  ({notes[k]})" if k in notes else ""
        print(f"{k:14} {v}{note}")
    return 0


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
    b = command("best-of-n", "sample N continuations in lockstep, keep the lowest perplexity")
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
