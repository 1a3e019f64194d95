"""What constrains a completion's output, as one grammar on llguidance (its token mask applied
before every sample): OpenAI's ``response_format``, llama-server's ``grammar`` (GBNF) and
``json_schema``, and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` or their newer form, ``structured_outputs``. A request gives at most one;
every refusal is a 400 naming the field.

>>> from lloyal.server.constraints import choice_regex
>>> choice_regex(["yes", "no (1.5)"])
'yes|no \\\\(1\\\\.5\\\\)'
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import lloyal

from .protocol import ApiError, ChatRequest, CompletionRequest

__all__ = ["choice_regex", "constraint_fields", "output_grammar"]

Build = Callable[[lloyal.Context, Any, str], lloyal.Grammar]


def constraint_fields(body: CompletionRequest | ChatRequest) -> list[str]:
    """The output-constraint fields ``body`` sets (a ``response_format`` of type ``text`` is none)."""
    names = [name for name in _BUILDERS if getattr(body, name) is not None]
    fmt = body.response_format
    if fmt is not None and fmt.get("type") == "text":
        names.remove("response_format")
    return names


def output_grammar(ctx: lloyal.Context, body: CompletionRequest | ChatRequest) -> lloyal.Grammar | None:
    """The grammar of ``body``'s one output constraint (``None`` when it gives none)."""
    names = constraint_fields(body)
    if not names:
        return None
    if len(names) > 1:
        raise ApiError(f"give either {names[0]} or {names[1]}, not both", param=names[1])
    name = names[0]
    try:
        return _BUILDERS[name](ctx, getattr(body, name), name)
    except lloyal.GrammarError as exc:
        raise ApiError(f"{name}: {exc}", param=name) from None


# The characters Rust's ``regex`` syntax gives a meaning (``regex_syntax::is_meta_character``):
# these are escaped, and only these (``\<`` and ``\>`` there are word boundaries).
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def choice_regex(choices: list[str]) -> str:
    """A regular expression (Rust ``regex`` syntax) matching exactly one of ``choices``.

    >>> choice_regex(["a>b", "1.5"])
    'a>b|1\\\\.5'
    """
    return "|".join("".join("\\" + c if c in _REGEX_META else c for c in s) for s in choices)


def _schema(ctx: lloyal.Context, value: Any, name: str) -> lloyal.Grammar:
    """A JSON schema, as an object or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ApiError(f"{name} is not valid JSON: {exc}", param=name) from None
    if not isinstance(value, dict):
        raise ApiError(f"{name} must be a JSON schema object", param=name)
    return lloyal.Grammar.from_json_schema(ctx, value)


def _gbnf(ctx: lloyal.Context, value: Any, name: str) -> lloyal.Grammar:
    return lloyal.Grammar.from_gbnf(ctx, value)


def _cfg(ctx: lloyal.Context, value: Any, name: str) -> lloyal.Grammar:
    """vLLM's ``guided_grammar``: GBNF, or Lark (which its guidance backend takes too) when the
    text has no GBNF rule (``::=``)."""
    if isinstance(value, str) and "::=" not in value:
        return lloyal.Grammar.from_lark(ctx, value)
    return _gbnf(ctx, value, name)


def _regex(ctx: lloyal.Context, value: Any, name: str) -> lloyal.Grammar:
    return lloyal.Grammar.from_regex(ctx, value)


def _choice(ctx: lloyal.Context, value: Any, name: str) -> lloyal.Grammar:
    if not value or not all(isinstance(c, str) and c for c in value):
        raise ApiError(f"{name} must be a list of non-empty strings", param=name)
    return lloyal.Grammar.from_regex(ctx, choice_regex(value))


def _response_format(ctx: lloyal.Context, fmt: dict[str, Any], name: str) -> lloyal.Grammar:
    """OpenAI's ``response_format``, and llama-server's forms of it: ``json_object`` with a
    ``schema``, and ``json_schema`` with its ``schema`` beside ``type``."""
    kind = fmt.get("type")
    if kind is None:
        raise ApiError(f"{name}.type is missing: give text, json_object or json_schema", param=name)
    if kind == "json_object":
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise ApiError(f"{name}.schema must be a JSON schema object", param=name)
        return lloyal.Grammar.from_json_schema(ctx, schema or {"type": "object"})
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else fmt.get("schema")
        if not isinstance(schema, dict):
            raise ApiError(f"{name}.json_schema.schema must be a JSON schema object", param=name)
        return lloyal.Grammar.from_json_schema(ctx, schema)
    raise ApiError(f"{name} type {kind!r} is not supported (text, json_object, json_schema)", param=name)


def _structured_outputs(ctx: lloyal.Context, value: dict[str, Any], name: str) -> lloyal.Grammar:
    """vLLM's ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar`` or
    ``json_object`` (its other keys tune vLLM's own backends and are ignored)."""
    kinds: dict[str, Build] = {"json": _schema, "regex": _regex, "choice": _choice, "grammar": _cfg}
    given = [k for k in (*kinds, "json_object", "structural_tag") if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise ApiError(
            f"{name} takes one of json, regex, choice, grammar or json_object, got {given or 'none'}",
            param=name,
        )
    key = given[0]
    if key == "structural_tag":
        raise ApiError(f"{name}.structural_tag is not supported by this server", param=name)
    if key == "json_object":
        return lloyal.Grammar.from_json_schema(ctx, {"type": "object"})
    return kinds[key](ctx, value[key], f"{name}.{key}")


_BUILDERS: dict[str, Build] = {
    "response_format": _response_format,
    "grammar": _gbnf,
    "json_schema": _schema,
    "guided_json": _schema,
    "guided_regex": _regex,
    "guided_choice": _choice,
    "guided_grammar": _cfg,
    "structured_outputs": _structured_outputs,
}
