"""Beam search on forked branches, compared with greedy decoding by perplexity.

API: ``lloyal.strategies.beam_search`` (``Branch.logits``, ``Branch.fork``/``prune``,
``BranchStore.commit``/``retain_only``). Each step keeps the ``--width`` most likely
continuations by cumulative log-probability; the kept beams share their common KV prefix and
advance with ONE decode. Greedy decoding picks the locally best token each step, so the
beam's perplexity is usually lower than or equal to greedy's; both are printed.

Run:
    python examples/beam_search.py
    python examples/beam_search.py "The recipe for a perfect omelette" --width 4 --max-tokens 24
    python examples/beam_search.py --jsonl --model path/to/model.gguf

``--jsonl`` prints one ``{"event": "result", "method": "greedy" | "beam", "text", "tokens",
"score", "perplexity"}`` line per method and a ``{"event": "summary", ...}`` line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from _args import example_parser, run

import lloyal
from lloyal import strategies

DEFAULT_PROMPT = "The three most important inventions in history are"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class Result:
    """One decoding method's output on the prompt."""

    method: str
    text: str
    tokens: int
    score: float
    perplexity: float

    def event(self) -> dict[str, Any]:
        """This result as a JSON-ready event (a non-finite value becomes null)."""
        return {
            "event": "result",
            "method": self.method,
            "text": self.text,
            "tokens": self.tokens,
            "score": _finite(self.score),
            "perplexity": _finite(self.perplexity),
        }


def greedy(ctx: lloyal.Context, prompt: str, max_tokens: int) -> Result:
    """Greedy decoding of ``prompt`` (one branch, pruned afterwards)."""
    with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)) as b:
        b.prefill(ctx.tokenize(prompt))
        tokens = [t.token for t in b.generate(max_tokens)]
        ppl = b.perplexity
    score = -len(tokens) * math.log(ppl) if tokens else 0.0
    return Result("greedy", ctx.detokenize(tokens), len(tokens), score, ppl)


def compare(ctx: lloyal.Context, prompt: str, width: int, max_tokens: int) -> tuple[Result, Result]:
    """``(greedy, beam)`` results for ``prompt``; needs ``n_seq_max >= width + 1``."""
    base = greedy(ctx, prompt, max_tokens)
    beam = strategies.beam_search(ctx, prompt, width, max_tokens)
    with beam.branch:  # the retained winner: prune it, the example is done with it
        pass
    return base, Result("beam", beam.text, len(beam.tokens), beam.score, beam.perplexity)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    parser = example_parser(__doc__, seed=False, max_tokens=16)
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    parser.add_argument("--width", type=int, default=3, help="beam width")
    args = parser.parse_args(argv)
    path = args.model or lloyal.default_model_path()
    with lloyal.Context(path, n_ctx=1024, n_seq_max=args.width + 1) as ctx:
        base, beam = compare(ctx, args.prompt, args.width, args.max_tokens)
    summary = {
        "event": "summary",
        "prompt": args.prompt,
        "width": args.width,
        "greedy_perplexity": base.event()["perplexity"],
        "beam_perplexity": beam.event()["perplexity"],
        "beam_not_worse": beam.perplexity <= base.perplexity,
    }
    if args.jsonl:
        print(json.dumps(base.event()))
        print(json.dumps(beam.event()))
        print(json.dumps(summary))
        return
    for r in (base, beam):
        print(f"{r.method:>6}: perplexity {r.perplexity:6.3f}  {args.prompt}{r.text}")
    verdict = "not worse" if summary["beam_not_worse"] else "worse this time"
    print(f"\nbeam (width {args.width}) vs greedy: {verdict}")


if __name__ == "__main__":
    run(main)
