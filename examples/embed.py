"""Sentence embeddings: a cosine-similarity matrix and nearest-neighbour search.

API: ``Context(..., embeddings=True)`` and ``Context.embed(texts)``, which packs the texts
across free sequences into as few ``llama_decode`` calls as possible and returns one
mean-pooled, L2-normalised vector per text (shape ``(len(texts), embedding_dimension)``), so
a cosine similarity is a dot product. The built-in sentences come in related pairs; each
sentence's nearest neighbour should be its partner, and each query should land in its pair.

Run:
    python examples/embed.py
    python examples/embed.py "A dog chased the ball." --model path/to/model.gguf
    python examples/embed.py --jsonl

``--jsonl`` prints ``{"event": "matrix", "sentences", "matrix"}``, then one
``{"event": "neighbour", "text", "neighbour", "index", "similarity"}`` per sentence
(its nearest other sentence) and per query (``"query": true``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from _args import example_parser, run

import lloyal

SENTENCES = (
    "A cat sat on the mat.",
    "A kitten slept on the rug.",
    "The stock market fell sharply today.",
    "Shares dropped as investors panicked.",
    "She baked fresh bread this morning.",
    "The oven smelled of warm loaves.",
)
QUERIES = ("A small cat was lying on a carpet.", "Investors sold their shares.")


@dataclass(frozen=True)
class Neighbour:
    """The sentence closest to ``text`` (by cosine similarity)."""

    text: str
    index: int
    neighbour: str
    similarity: float
    query: bool


def similarity_matrix(ctx: lloyal.Context, sentences: list[str]) -> npt.NDArray[np.float32]:
    """Cosine similarities of every pair of ``sentences`` (one batched ``embed``)."""
    vectors = ctx.embed(sentences)  # unit rows
    matrix: npt.NDArray[np.float32] = vectors @ vectors.T
    return matrix


def neighbours(
    ctx: lloyal.Context, sentences: list[str], queries: list[str]
) -> tuple[npt.NDArray[np.float32], list[Neighbour]]:
    """The similarity matrix, each sentence's nearest other sentence, and each query's nearest."""
    vectors = ctx.embed([*sentences, *queries])
    corpus, asked = vectors[: len(sentences)], vectors[len(sentences) :]
    matrix = corpus @ corpus.T
    out: list[Neighbour] = []
    others = matrix - 2.0 * np.eye(len(sentences), dtype=np.float32)  # never pick itself
    for i, text in enumerate(sentences):
        j = int(np.argmax(others[i]))
        out.append(Neighbour(text, j, sentences[j], float(matrix[i, j]), query=False))
    for text, row in zip(queries, asked @ corpus.T, strict=True):
        j = int(np.argmax(row))
        out.append(Neighbour(text, j, sentences[j], float(row[j]), query=True))
    return matrix, out


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    parser = example_parser(__doc__, seed=False)
    parser.add_argument("queries", nargs="*", help=f"texts to look up (default: {list(QUERIES)})")
    args = parser.parse_args(argv)
    queries = args.queries or list(QUERIES)
    path = args.model or lloyal.default_model_path()
    with lloyal.Context(path, n_ctx=1024, n_batch=512, n_seq_max=4, embeddings=True) as ctx:
        matrix, found = neighbours(ctx, list(SENTENCES), queries)
    if args.jsonl:
        rows = [[round(float(x), 6) for x in row] for row in matrix]
        print(json.dumps({"event": "matrix", "sentences": list(SENTENCES), "matrix": rows}))
        for n in found:
            event = {"event": "neighbour", "text": n.text, "neighbour": n.neighbour, "index": n.index}
            print(json.dumps({**event, "similarity": round(n.similarity, 6), "query": n.query}))
        return
    print("cosine similarity")
    for i, (text, row) in enumerate(zip(SENTENCES, matrix, strict=True)):
        print(f"[{i}] " + " ".join(f"{x:5.2f}" for x in row) + f"  {text}")
    print()
    for n in found:
        kind = "query" if n.query else "sentence"
        print(f"{kind} {n.text!r} -> [{n.index}] {n.neighbour!r} ({n.similarity:.3f})")


if __name__ == "__main__":
    run(main)
