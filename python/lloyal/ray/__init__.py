"""lloyal on Ray (the ``lloyal[ray]`` extra): serving replicas and batch generation.

- :func:`serve_app`: ``lloyal serve`` as a Ray Serve application of N engines, with
  prefix-affinity routing (:mod:`lloyal.ray.routing`) — ``lloyal serve --ray --replicas N``.
- :func:`generate`: prompts of a Ray Dataset (or a list of dicts, a Parquet/JSONL path)
  expanded with ``n``/``best_of`` completions on an actor pool, every actor running its rows
  through one engine (one decode per step across rows).

See docs/scale-out.md. Submodules import Ray only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["generate", "serve_app"]

if TYPE_CHECKING:
    from .data import generate
    from .serve import serve_app


def __getattr__(name: str) -> Any:
    if name == "serve_app":
        from .serve import serve_app

        return serve_app
    if name == "generate":
        from .data import generate

        return generate
    raise AttributeError(f"module 'lloyal.ray' has no attribute {name!r}")
