"""Speculative decoding with prompt lookup: drafts come from earlier text, ONE decode verifies them
(and one more writes the bonus token).

API: ``lloyal.strategies.speculative_generate`` (``Branch.verify``).

On copy-heavy tasks (rewriting, quoting, code edits) the continuation often repeats a span of
the prompt. Each round takes the last 2 tokens, finds their latest earlier occurrence, and
proposes the (up to) ``k`` tokens that followed as drafts; ``Branch.verify`` decodes them in
one batch, keeps the prefix the branch's own sampler agrees with and commits the sampler's
next token. With greedy sampling the output equals plain greedy decoding.

Run:
    python examples/speculative.py --max-tokens 64
    python examples/speculative.py --jsonl
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from _args import example_parser, run

import lloyal
from lloyal import strategies

PARAGRAPH = (
    "The harbour master walked along the pier every morning, counting the boats that had come "
    "in during the night and writing their names in a small leather book."
)
PROMPT = f"Original: {PARAGRAPH}\nCopy: {PARAGRAPH[:40]}"


@dataclass
class Run:
    """Generated tokens and how many decodes produced them."""

    tokens: list[int]
    decodes: int
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0


lookup_drafts = strategies.prompt_lookup_drafts  # (history, k, ngram=2) -> drafts


def plain(ctx: lloyal.Context, prompt: list[int], max_tokens: int) -> Run:
    """Greedy decoding, one decode per token."""
    t0 = time.perf_counter()
    with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)) as b:
        b.prefill(prompt)
        out = [t.token for t in b.generate(max_tokens)]
    return Run(out, decodes=len(out), seconds=time.perf_counter() - t0)


def speculative(ctx: lloyal.Context, prompt: list[int], max_tokens: int, k: int = 8) -> Run:
    """Greedy decoding with prompt-lookup drafts verified by ``Branch.verify``."""
    t0 = time.perf_counter()
    result = strategies.speculative_generate(ctx, prompt, max_tokens, k=k)
    with result.branch:  # prunes the branch the call created
        seconds = time.perf_counter() - t0
    return Run(list(result.tokens), result.decodes, result.drafted, result.accepted, seconds)


def main() -> None:
    parser = example_parser(__doc__, seed=False, jsonl_help="machine-readable output", max_tokens=48)
    parser.add_argument("-k", type=int, default=8, help="most drafts per round")
    args = parser.parse_args()
    with lloyal.Context(args.model or lloyal.default_model_path(), n_ctx=1024) as ctx:
        prompt = ctx.tokenize(PROMPT)
        base = plain(ctx, prompt, args.max_tokens)
        spec = speculative(ctx, prompt, args.max_tokens, args.k)
        summary = {
            "same_tokens": spec.tokens == base.tokens,
            "tokens": len(spec.tokens),
            "plain_decodes": base.decodes,
            "speculative_decodes": spec.decodes,
            "acceptance": spec.accepted / spec.drafted if spec.drafted else 0.0,
            "speedup": base.seconds / spec.seconds if spec.seconds else 0.0,
        }
        if args.jsonl:
            print(json.dumps({"text": ctx.detokenize(spec.tokens)}))
            print(json.dumps({"summary": summary}))
        else:
            print(PROMPT + ctx.detokenize(spec.tokens))
            print(
                f"\n{summary['tokens']} tokens: {summary['plain_decodes']} decodes plain, "
                f"{summary['speculative_decodes']} speculative; acceptance {summary['acceptance']:.0%}, "
                f"speedup {summary['speedup']:.2f}x; identical to plain greedy: {summary['same_tokens']}"
            )


if __name__ == "__main__":
    run(main)
