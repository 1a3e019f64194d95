"""Streaming past n_ctx with BlinkKV: reseed the branch from summary sinks plus the recent tail.

A branch generates in a small context (256 cells, ``n_seq_max=2``). When its position nears the
end, a sidecar (``Branch.fork``: it shares every cell, so it costs only its own tokens) reads a
summary prompt, writes a few greedy tokens (``generate``) and is pruned. ``Branch.reseed(sinks,
tail)`` then rebuilds the branch's sequence from the attention sinks (BOS + that running summary)
and the last ``--tail`` tokens; the next position is ``len(sinks) + len(tail)``. Sampler history
and ``Branch.perplexity`` carry on across reseeds, so the stream reads as one text of any length.
llama.cpp rounds a context up to a multiple of 256 cells; ``--n-ctx`` below that only narrows the
window the stream may use (handy for a quick demo).

Run:
    python examples/streaming.py                      # 400 tokens in a 256-cell context
    python examples/streaming.py --max-tokens 1000 --jsonl
    python examples/streaming.py --n-ctx 96 --max-tokens 120 --tail 16 --summary-tokens 6

``--jsonl`` prints one ``reseed`` event per reseed (positions, sinks/tail sizes, perplexity so
far, summary) and a final ``done`` (tokens, reseeds, perplexity, text).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from _args import example_parser, run

import lloyal

PROMPT = "The old lighthouse keeper kept a diary. On the first page he wrote:"
SUMMARY_PROMPT = "\n\nIn short, the text above is about"
SINK_LABEL = "Story so far:"

Event = dict[str, Any]


def _sample_no_stop(branch: lloyal.Branch, banned: dict[int, float]) -> lloyal.Produced:
    """``produce()``, banning (for good, via the logit bias) any stop token it returns."""
    p = branch.produce()
    while p.is_stop:
        banned[p.token] = -math.inf
        branch.set_logit_bias(banned)
        p = branch.produce()
    return p


def _summarize(ctx: lloyal.Context, branch: lloyal.Branch, prompt: list[int], n_tokens: int) -> list[int]:
    """Greedy summary tokens written by a sidecar fork of ``branch`` (pruned before returning)."""
    sidecar = branch.fork()
    try:
        sidecar.set_sampler_params(lloyal.SamplingParams(temperature=0.0))
        sidecar.prefill(prompt)
        out: list[int] = []
        for tok in sidecar.generate(n_tokens):
            if "\n" in tok.text:
                break
            out.append(tok.token)
        return out
    finally:
        sidecar.prune()


def stream(
    ctx: lloyal.Context,
    prompt: str,
    max_tokens: int,
    *,
    window: int | None = None,
    tail: int = 48,
    summary_tokens: int = 12,
    seed: int = 1,
) -> Iterator[Event]:
    """Generate ``max_tokens`` tokens (stop tokens banned), reseeding as the cells run out.

    The branch and its sidecar stay within ``window`` KV cells (default ``ctx.n_ctx``; llama.cpp
    rounds a context up to a multiple of 256 cells, so a smaller ``window`` makes a short demo).
    Needs a free second lease for the sidecar. Yields one ``reseed`` event per reseed and a final
    ``done`` event; raises ``ValueError`` when the window cannot hold the prompt, or the sinks,
    the tail and the free cells a reseed needs.

    Example:
        >>> with lloyal.Context(lloyal.default_model_path(), n_seq_max=2) as ctx:
        ...     events = list(stream(ctx, "Once,", 60, window=48, tail=8, summary_tokens=4))
        >>> events[-1]["reseeds"] >= 1
        True
    """
    store = lloyal.BranchStore(ctx)
    summary_prompt = ctx.tokenize(SUMMARY_PROMPT, add_special=False)
    label = ctx.tokenize(SINK_LABEL, add_special=False)
    newline = ctx.tokenize("\n", add_special=False)
    history = ctx.tokenize(prompt)
    n_ctx = min(window or ctx.n_ctx, ctx.n_ctx)
    # Free cells to keep: the sidecar's own (summary prompt + summary + the branch's next token),
    # and the new sinks + tail, which reseed decodes while the old cells are still parked.
    max_sinks = 1 + len(label) + summary_tokens + len(newline)
    reserve = max(len(summary_prompt) + summary_tokens + 1, max_sinks + tail)
    if len(history) + reserve >= n_ctx or max_sinks + tail + reserve >= n_ctx:
        raise ValueError(
            f"a window of {n_ctx} cells is too small for a {len(history)}-token prompt, sinks of up to "
            f"{max_sinks}, a {tail}-token tail and {reserve} free cells; raise it or lower them"
        )
    params = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repeat_penalty=1.1, seed=seed)
    branch = lloyal.Branch.create(ctx, 0, params)
    try:
        branch.prefill(history)
        banned: dict[int, float] = {}
        generated: list[int] = []
        reseeds = 0
        while len(generated) < max_tokens:
            if branch.position + reserve >= n_ctx:
                summary = _summarize(ctx, branch, summary_prompt, summary_tokens)
                sinks = [ctx.bos_token, *label, *summary, *newline]
                recent = history[-tail:]
                before = branch.position
                after = branch.reseed(sinks, recent)
                reseeds += 1
                yield {
                    "event": "reseed",
                    "position_before": before,
                    "position_after": after,
                    "sinks": len(sinks),
                    "tail": len(recent),
                    "generated": len(generated),
                    "kv_cells": store.kv_pressure.cells_used,
                    "perplexity": branch.perplexity,
                    "summary": ctx.detokenize(summary).strip(),
                }
            p = _sample_no_stop(branch, banned)
            branch.commit(p.token)
            generated.append(p.token)
            history.append(p.token)
        yield {
            "event": "done",
            "tokens": len(generated),
            "reseeds": reseeds,
            "n_ctx": n_ctx,
            "perplexity": branch.perplexity,
            "text": ctx.detokenize(generated),
        }
    finally:
        branch.prune_subtree()


def main() -> None:
    parser = example_parser(__doc__, prompt=PROMPT, max_tokens=400)
    parser.add_argument("--n-ctx", type=int, default=256, help="KV cells the stream may use")
    parser.add_argument("--tail", type=int, default=48, help="recent tokens kept at each reseed")
    parser.add_argument("--summary-tokens", type=int, default=12, help="most tokens of running summary")
    args = parser.parse_args()
    model = args.model or lloyal.default_model_path()
    with lloyal.Context(model, n_ctx=args.n_ctx, n_seq_max=2) as ctx:
        events = stream(
            ctx,
            args.prompt,
            args.max_tokens,
            window=args.n_ctx,
            tail=args.tail,
            summary_tokens=args.summary_tokens,
            seed=args.seed,
        )
        for ev in events:
            if args.jsonl:
                print(json.dumps(ev), flush=True)
            elif ev["event"] == "reseed":
                print(
                    f"[reseed after {ev['generated']} tokens] position {ev['position_before']} -> "
                    f"{ev['position_after']} ({ev['sinks']} sinks + {ev['tail']} tail), perplexity "
                    f"{ev['perplexity']:.2f}, summary: {ev['summary']!r}"
                )
            else:
                print(f"\n{args.prompt}{ev['text']}\n")
                print(
                    f"{ev['tokens']} tokens in a {ev['n_ctx']}-cell context, {ev['reseeds']} reseeds, "
                    f"perplexity {ev['perplexity']:.2f}"
                )


if __name__ == "__main__":
    run(main)
