"""Grammar-constrained generation: JSON Schema to GBNF, and the :class:`Grammar` handle.

Example:
    >>> import lloyal
    >>> gbnf = lloyal.json_schema_to_grammar({"type": "object", "properties": {"n": {"type": "integer"}}})
    >>> "root" in gbnf
    True
"""

from __future__ import annotations

import json
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
    :class:`~lloyal.GrammarError`.
    """
    if isinstance(schema, str):
        text = schema
    else:
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"the JSON schema is not JSON-serialisable: {exc}") from exc
    return _lloyal.json_schema_to_grammar(text)
