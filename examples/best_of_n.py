"""Best-of-N: fork N branches from one prompt, decode them in lockstep, keep the most fluent.

API: ``lloyal.strategies.best_of_n`` (``Branch.fork``, ``BranchStore.produce_all``/``commit``,
``BranchStore.retain_only``). Every step is ONE ``llama_decode`` for all live branches; the
prompt's KV cells are shared by every branch (``fork`` copies metadata, not tensors). The
winner is the branch with the lowest model perplexity; ``retain_only`` keeps its sequence and
frees every other lease.

Run:
    python examples/best_of_n.py
    python examples/best_of_n.py "The old lighthouse keeper opened the door and saw" -n 4
    python examples/best_of_n.py --jsonl --max-tokens 16 --model path/to/model.gguf

``--jsonl`` prints one ``{"event": "candidate", ...}`` line per candidate (index, text,
tokens, perplexity) and a final ``{"event": "summary", ...}`` (winner, prompt, text).
"""

from __future__ import annotations

import json
import math

from _args import example_parser, run

import lloyal
from lloyal import strategies

DEFAULT_PROMPT = "The old lighthouse keeper opened the door and saw"


def best_of_n(ctx: lloyal.Context, prompt: str, n: int, max_tokens: int, seed: int = 1) -> tuple[int, str]:
    """Return ``(winner_index, winner_text)`` of ``n`` sampled continuations of ``prompt``.

    The winner's branch stays alive as the context's only branch (``retain_only``).
    """
    result = strategies.best_of_n(ctx, prompt, n, max_tokens=max_tokens, seed=seed)
    return result.index, result.text


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    parser = example_parser(__doc__, max_tokens=32)
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    parser.add_argument("-n", type=int, default=4, help="number of candidates")
    args = parser.parse_args(argv)
    with lloyal.Context(args.model or lloyal.default_model_path(), n_ctx=1024, n_seq_max=args.n) as ctx:
        result = strategies.best_of_n(ctx, args.prompt, args.n, max_tokens=args.max_tokens, seed=args.seed)
        if args.jsonl:
            for i, (text, tokens, ppl) in enumerate(
                zip(result.texts, result.tokens, result.perplexities, strict=True)
            ):
                finite = ppl if math.isfinite(ppl) else None
                event = {"event": "candidate", "index": i, "text": text, "tokens": len(tokens)}
                print(json.dumps({**event, "perplexity": finite, "winner": i == result.index}))
            summary = {"event": "summary", "winner": result.index, "n": args.n, "prompt": args.prompt}
            print(json.dumps({**summary, "text": result.text}))
        else:
            for i, (text, ppl) in enumerate(zip(result.texts, result.perplexities, strict=True)):
                mark = "*" if i == result.index else " "
                print(f"{mark} [{i}] perplexity {ppl:6.2f} |{text!r}")
            print(f"\nwinner: branch {result.index} of {args.n}\n{args.prompt}{result.text}")


if __name__ == "__main__":
    run(main)
