"""Grammar-constrained generation: JSON Schema to GBNF, and the :class:`Grammar` handle.

Example:
    >>> import lloyal
    >>> gbnf = lloyal.json_schema_to_grammar({"type": "object", "properties": {"n": {"type": "integer"}}})
    >>> "root" in gbnf
    True
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from typing import Any

from lloyal import _lloyal
from lloyal._lloyal import Grammar
from lloyal.errors import GrammarError

__all__ = ["Grammar", "json_schema_to_grammar"]


def json_schema_to_grammar(schema: str | Mapping[str, Any]) -> str:
    """GBNF with a ``root`` rule for the JSON documents ``schema`` describes, by llama.cpp's
    converter (an object that lists ``properties`` takes no other keys unless the schema says
    so, as :meth:`Grammar.from_json_schema` reads it too).

    ``schema`` is a JSON Schema as a dict or as JSON text. An invalid schema raises
    :class:`~lloyal.GrammarError`. The converter enforces less than
    :meth:`Grammar.from_json_schema` (llguidance): it ignores ``multipleOf`` and the bounds of
    non-integer numbers (a ``UserWarning`` names them) and drops a ``pattern`` it cannot
    translate (llama.cpp prints that on stderr); the grammar then accepts documents the schema
    does not.
    """
    if isinstance(schema, str):
        text = schema
    else:
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"the JSON schema is not JSON-serialisable: {exc}") from exc
    gbnf = _lloyal.json_schema_to_grammar(text)
    try:
        unenforced = sorted(set(_unenforced(json.loads(text))))
    except ValueError:
        unenforced = []
    if unenforced:
        warnings.warn(
            f"json_schema_to_grammar: llama.cpp's converter does not enforce {', '.join(unenforced)}; "
            "the grammar accepts documents that break them (Grammar.from_json_schema enforces them)",
            UserWarning,
            stacklevel=2,
        )
    return gbnf


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _unenforced(node: Any) -> list[str]:
    """The keywords of ``node`` (a schema, walked whole) that llama.cpp's converter ignores."""
    found: list[str] = []
    if isinstance(node, dict):
        if "multipleOf" in node:
            found.append("multipleOf")
        if node.get("type") == "number":
            found += [f"{k} of a number" for k in _BOUNDS if k in node]
        for value in node.values():
            found += _unenforced(value)
    elif isinstance(node, list):
        for value in node:
            found += _unenforced(value)
    return found
