"""The command-line options the examples share: ``--seed``, ``--model``, ``--jsonl`` and,
where an example takes them, ``--prompt`` and ``--max-tokens``.

Each example is run as a script (``python examples/best_of_n.py``), so this folder is on
``sys.path`` and ``from _args import example_parser`` finds this file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import lloyal


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
    model_help = "GGUF path (default: LLOYAL_MODEL or the embedded Gemma 3 270M)"
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--jsonl", action="store_true", help=jsonl_help)
    return parser


def run(main: Callable[[], object]) -> None:
    """Run an example's ``main``: what a user can get wrong (an argument, a model path) ends it
    with one line on stderr and exit status 1, not a traceback."""
    try:
        main()
    except (lloyal.LloyalError, ValueError) as exc:
        sys.exit(f"{Path(sys.argv[0]).name}: error: {exc}")
