"""Best-of-N: fork N branches from one prompt, decode them in lockstep, keep the most fluent.

Every step is ONE ``llama_decode`` for all live branches (``BranchStore.commit``); the prompt's KV
cells are shared by every branch (``fork`` copies metadata, not tensors). The winner is the branch
with the lowest model perplexity; ``retain_only`` keeps its sequence and frees every other lease.

Run:
    python examples/best_of_n.py "The old lighthouse keeper opened the door and saw" -n 4
"""

from __future__ import annotations

import argparse

import lloyal


def best_of_n(ctx: lloyal.Context, prompt: str, n: int, max_tokens: int, seed: int = 1) -> tuple[int, str]:
    """Return ``(winner_index, winner_text)`` of ``n`` sampled continuations of ``prompt``."""
    store = lloyal.BranchStore(ctx)
    params = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=seed)
    root = lloyal.Branch.create(ctx, 0, params)
    root.prefill(ctx.tokenize(prompt))
    branches = [root.fork() for _ in range(n)]
    for i, b in enumerate(branches):
        b.reseed_sampler(seed + 1 + i)
    tokens: list[list[int]] = [[] for _ in branches]
    live = list(range(n))
    for _ in range(max_tokens):
        produced = store.produce_all([branches[i] for i in live])
        step = [(i, p) for i, p in zip(live, produced, strict=True) if not p.is_stop]
        if not step:
            break
        store.commit([(branches[i], p.token) for i, p in step])
        for i, p in step:
            tokens[i].append(p.token)
        live = [i for i, _ in step]
    winner = min(range(n), key=lambda i: branches[i].perplexity)
    store.retain_only(branches[winner])  # frees every other lease, the winner becomes a root
    return winner, ctx.detokenize(tokens[winner])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded Gemma 3 270M)")
    args = parser.parse_args()
    with lloyal.Context(args.model or lloyal.default_model_path(), n_seq_max=args.n + 1) as ctx:
        winner, text = best_of_n(ctx, args.prompt, args.n, args.max_tokens)
        print(f"winner: branch {winner} of {args.n}\n{args.prompt}{text}")


if __name__ == "__main__":
    main()
