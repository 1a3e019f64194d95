"""The ``lloyal`` command line: ``demo``, ``generate`` and ``info``.

Example:
    $ lloyal demo                      # 4 branches from one prompt, decoded in lockstep
    $ lloyal generate "Once upon a time" -n 40
    $ lloyal info                      # facts about the (default) model
    $ lloyal bench -b 1,2,4,8          # batched throughput table (B, S_PP, S_TG)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import lloyal

DEMO_PROMPT = "The old lighthouse keeper opened the door and saw"


def _model_path(arg: str | None) -> Path:
    return Path(arg) if arg else lloyal.default_model_path()


def demo(model: str | None, prompt: str, n: int, max_tokens: int, jsonl: bool) -> int:
    """Fork ``n`` branches from one prompt, decode them in lockstep (one decode per step)."""
    path = _model_path(model)
    with lloyal.Context(path, n_ctx=2048, n_seq_max=n + 1) as ctx:
        store = lloyal.BranchStore(ctx)
        params = lloyal.SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)
        with lloyal.Branch.create(ctx, 0, params) as root:
            root.prefill(ctx.tokenize(prompt))
            branches = [root.fork() for _ in range(n)]
            for i, b in enumerate(branches):
                b.reseed_sampler(1000 + i)
            tokens: list[list[int]] = [[] for _ in branches]
            live = list(range(n))
            steps = 0
            start = time.perf_counter()
            while live and steps < max_tokens:
                produced = store.produce_all([branches[i] for i in live])
                step = [(i, p) for i, p in zip(live, produced, strict=True) if not p.is_stop]
                live = [i for i, _ in step]
                if step:
                    store.commit([(branches[i], p.token) for i, p in step])
                for i, p in step:
                    tokens[i].append(p.token)
                steps += 1
            elapsed = time.perf_counter() - start
            total = sum(len(t) for t in tokens)
            winner = min(range(n), key=lambda i: branches[i].perplexity)
            for i, b in enumerate(branches):
                text = ctx.detokenize(tokens[i])
                if jsonl:
                    event = {"branch": i, "perplexity": b.perplexity, "tokens": len(tokens[i]), "text": text}
                    print(json.dumps(event))
                else:
                    mark = "  <- winner" if i == winner else ""
                    print(f"--- branch {i}  perplexity {b.perplexity:.2f}  tokens {len(tokens[i])}{mark}")
                    print(prompt + text)
            summary = {
                "winner": winner,
                "perplexity": branches[winner].perplexity,
                "steps": steps,
                "decode_calls": steps,
                "tokens": total,
                "tokens_per_s": total / elapsed if elapsed > 0 else 0.0,
            }
            if jsonl:
                print(json.dumps({"summary": summary}))
            else:
                print(
                    f"\nwinner: branch {winner} (perplexity {summary['perplexity']:.2f}); "
                    f"{total} tokens in {steps} lockstep decodes, {summary['tokens_per_s']:.1f} tok/s"
                )
    return 0


def generate(model: str | None, prompt: str, max_tokens: int, temperature: float, seed: int | None) -> int:
    """Stream one completion of ``prompt``."""
    with lloyal.Context(_model_path(model), n_ctx=2048) as ctx:
        params = lloyal.SamplingParams(temperature=temperature, seed=seed)
        with lloyal.Branch.create(ctx, 0, params) as b:
            b.prefill(ctx.tokenize(prompt))
            sys.stdout.write(prompt)
            for tok in b.generate(max_tokens):
                sys.stdout.write(tok.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
    return 0


def info(model: str | None) -> int:
    """Print facts about a model."""
    m = lloyal.Model(_model_path(model))
    facts = {
        "path": str(m.path),
        "architecture": m.architecture,
        "n_vocab": m.n_vocab,
        "n_ctx_train": m.n_ctx_train,
        "n_embd": m.n_embd,
        "n_layer": m.n_layer,
        "n_params": m.n_params,
        "size_bytes": m.size,
        "chat_template": m.chat_template is not None,
    }
    for k, v in facts.items():
        print(f"{k:14} {v}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lloyal`` command."""
    parser = argparse.ArgumentParser(prog="lloyal", description="Forkable, branch-parallel inference.")
    parser.add_argument("--model", help="GGUF path (default: LLOYAL_MODEL or the embedded Gemma 3 270M)")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="fork N branches from one prompt and decode them in lockstep")
    d.add_argument("--prompt", default=DEMO_PROMPT)
    d.add_argument("-n", type=int, default=4, help="number of branches (default 4)")
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--jsonl", action="store_true", help="machine-readable output")
    g = sub.add_parser("generate", help="stream a completion")
    g.add_argument("prompt")
    g.add_argument("-n", "--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--seed", type=int, default=None)
    sub.add_parser("info", help="describe the model")
    bn = sub.add_parser("bench", help="batched throughput table (llama-batched-bench style)")
    bn.add_argument("-b", "--batches", default="1,2,4,8,16", help="comma-separated batch sizes")
    bn.add_argument("--pp", type=int, default=128, help="prompt tokens")
    bn.add_argument("--tg", type=int, default=32, help="generated tokens per branch")
    bn.add_argument("-t", "--threads", type=int, default=None)
    bn.add_argument("--jsonl", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return demo(args.model, args.prompt, args.n, args.max_tokens, args.jsonl)
        if args.command == "generate":
            return generate(args.model, args.prompt, args.max_tokens, args.temperature, args.seed)
        if args.command == "bench":
            from lloyal.bench import main_bench

            try:
                batches = [int(x) for x in args.batches.split(",") if x.strip()]
            except ValueError:
                parser.error(f"--batches must be comma-separated integers, got {args.batches!r}")
            return main_bench(_model_path(args.model), batches, args.pp, args.tg, args.threads, args.jsonl)
        return info(args.model)
    except (lloyal.LloyalError, ValueError) as exc:
        print(f"lloyal: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
