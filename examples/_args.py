"""The command-line options the examples share: ``--seed``, ``--model``, ``--jsonl`` and,
where an example takes them, ``--prompt`` and ``--max-tokens``.

Each example is run as a script (``python examples/best_of_n.py``), so this folder is on
``sys.path`` and ``from _args import example_parser`` finds this file.
"""

from __future__ import annotations

import argparse


def example_parser(
    doc: str | None,
    *,
    prompt: str | None = None,
    max_tokens: int | None = None,
    max_tokens_help: str | None = None,
    seed: bool = True,
    jsonl_help: str = "one JSON event per line",
) -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first line, with the shared options
    (``--prompt`` and ``--max-tokens`` when given their defaults)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    if prompt is not None:
        parser.add_argument("--prompt", default=prompt)
    if max_tokens is not None:
        parser.add_argument("--max-tokens", type=int, default=max_tokens, help=max_tokens_help)
    if seed:
        parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded Gemma 3 270M)")
    parser.add_argument("--jsonl", action="store_true", help=jsonl_help)
    return parser
