"""Entropy as a control signal: adapt the temperature per token, fork where the model is unsure.

Before each token the branch reads ``Branch.model_entropy()`` (nats) of its next-token
distribution and maps it to a temperature with ``set_sampler_params`` (low entropy: near greedy,
high: hotter). When the entropy crosses ``--threshold``, the branch forks (``Branch.fork``, the
fork's RNG reseeded with ``reseed_sampler``), both alternatives advance ``--lookahead`` tokens with
one ``BranchStore.commit`` per step, and the one with the lower ``perplexity`` is kept: a losing
fork is ``prune``d; a losing parent goes with ``BranchStore.retain_only(fork)``, which also makes
the fork the new root. The run uses two leases and gives both back.

Run:
    python examples/entropy.py
    python examples/entropy.py --threshold 3.5 --lookahead 6 --max-tokens 64 --jsonl

Events (``--jsonl``): ``token`` (position, entropy, temperature, text) for every kept token,
``fork`` (position, entropy, kept index, both perplexities) and a final ``done``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from _args import example_parser, run

import lloyal

PROMPT = "The old lighthouse keeper opened the door and saw"

Event = dict[str, Any]


def temperature_for(entropy: float, *, low: float = 1.0, high: float = 5.0) -> float:
    """Map an entropy (nats) to a temperature: 0.1 at or below ``low``, 1.1 at or above ``high``.

    Example:
        >>> temperature_for(0.2), temperature_for(3.0), temperature_for(9.0)
        (0.1, 0.6, 1.1)
    """
    share = min(max((entropy - low) / (high - low), 0.0), 1.0)
    return round(0.1 + 1.0 * share, 3)


def _advance_both(
    store: lloyal.BranchStore, pair: list[lloyal.Branch], n: int
) -> tuple[list[list[Event]], list[bool]]:
    """Advance both branches up to ``n`` tokens, one ``commit`` per step; their steps, and which stopped."""
    steps: list[list[Event]] = [[] for _ in pair]
    stopped = [False for _ in pair]
    for _ in range(n):
        live = [i for i in range(len(pair)) if not stopped[i]]
        entropies = [pair[i].model_entropy() for i in live]
        produced = store.produce_all([pair[i] for i in live])
        step = []
        for i, entropy, p in zip(live, entropies, produced, strict=True):
            stopped[i] = p.is_stop
            if not p.is_stop:
                step.append((i, entropy, p))
        if not step:
            break
        store.commit([(pair[i], p.token) for i, _, p in step])
        for i, entropy, p in step:
            position = pair[i].position - 1
            steps[i].append({"position": position, "entropy": entropy, "token": p.token, "text": p.text})
    return steps, stopped


def entropy_steered(
    ctx: lloyal.Context,
    prompt: str,
    max_tokens: int,
    *,
    threshold: float = 4.5,
    lookahead: int = 4,
    cooldown: int = 4,
    seed: int = 1,
) -> Iterator[Event]:
    """Generate up to ``max_tokens`` tokens with entropy-driven temperature and forks.

    A fork happens when the entropy exceeds ``threshold``, at least ``cooldown`` tokens after
    the previous fork's alternatives ended, and ``lookahead`` tokens still fit in the budget.
    Needs two free leases; ``retain_only`` disposes every branch of ``ctx``, so give the
    function a context of its own.

    Example:
        >>> with lloyal.Context(lloyal.default_model_path(), n_ctx=512, n_seq_max=2) as ctx:
        ...     events = list(entropy_steered(ctx, PROMPT, 16, threshold=2.0))
        >>> events[-1]["event"], events[-1]["tokens"]
        ('done', 16)
    """
    store = lloyal.BranchStore(ctx)
    base = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=seed)
    branch = lloyal.Branch.create(ctx, 0, base)
    tokens: list[int] = []
    forks = 0
    next_fork_at = 0  # len(tokens) from which a fork is allowed again
    try:
        branch.prefill(ctx.tokenize(prompt))
        while len(tokens) < max_tokens:
            entropy = branch.model_entropy()
            temperature = temperature_for(entropy)
            branch.set_sampler_params(base.replace(temperature=temperature))
            if entropy > threshold and len(tokens) >= next_fork_at and len(tokens) + lookahead <= max_tokens:
                position = branch.position
                alt = branch.fork()
                forks += 1
                alt.reseed_sampler(seed + 1000 * forks)
                pair = [branch, alt]
                steps, stopped = _advance_both(store, pair, lookahead)
                perplexities = [b.perplexity for b in pair]
                kept = 0 if perplexities[0] <= perplexities[1] else 1
                if kept == 0:
                    alt.prune()
                else:
                    store.retain_only(alt)  # disposes the parent; the fork becomes the root
                    branch = alt
                yield {
                    "event": "fork",
                    "position": position,
                    "entropy": entropy,
                    "temperature": temperature,
                    "kept": kept,
                    "perplexities": perplexities,
                }
                for s in steps[kept]:
                    tokens.append(s["token"])
                    yield {"event": "token", **s, "temperature": temperature, "forked": True}
                next_fork_at = len(tokens) + cooldown
                if stopped[kept]:  # the kept alternative reached a stop token
                    break
                continue
            p = branch.produce()
            if p.is_stop:
                break
            branch.commit(p.token)
            tokens.append(p.token)
            yield {
                "event": "token",
                "position": branch.position - 1,
                "entropy": entropy,
                "temperature": temperature,
                "token": p.token,
                "text": p.text,
                "forked": False,
            }
        yield {
            "event": "done",
            "tokens": len(tokens),
            "forks": forks,
            "perplexity": branch.perplexity,
            "text": ctx.detokenize(tokens),
        }
    finally:
        branch.prune_subtree()


def _human(ev: Event, prompt: str) -> str:
    """One event as a line of text for people."""
    if ev["event"] == "token":
        mark = "*" if ev["forked"] else " "
        return f"{ev['position']:5d} {mark} H={ev['entropy']:5.2f} T={ev['temperature']:.2f}  {ev['text']!r}"
    if ev["event"] == "fork":
        a, b = ev["perplexities"]
        kept = "the branch" if ev["kept"] == 0 else "the fork"
        where = f"      fork at {ev['position']} (H={ev['entropy']:.2f})"
        return f"{where}: perplexity {a:.2f} vs {b:.2f}, kept {kept}"
    return (
        f"\n{prompt}{ev['text']}\n\n{ev['tokens']} tokens, {ev['forks']} forks, "
        f"perplexity {ev['perplexity']:.2f}"
    )


def main() -> None:
    parser = example_parser(__doc__, prompt=PROMPT, max_tokens=48)
    parser.add_argument("--threshold", type=float, default=4.5, help="entropy (nats) that triggers a fork")
    parser.add_argument("--lookahead", type=int, default=4, help="tokens each alternative gets")
    args = parser.parse_args()
    with lloyal.Context(args.model or lloyal.default_model_path(), n_ctx=1024, n_seq_max=2) as ctx:
        events = entropy_steered(
            ctx,
            args.prompt,
            args.max_tokens,
            threshold=args.threshold,
            lookahead=args.lookahead,
            seed=args.seed,
        )
        for ev in events:
            print(json.dumps(ev) if args.jsonl else _human(ev, args.prompt), flush=True)


if __name__ == "__main__":
    run(main)
