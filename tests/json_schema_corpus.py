"""JSON schemas for the conformance test: each small enough that a document fits in 64 tokens
(strings and arrays are bounded), together covering nested objects, arrays, enums, patterns,
optional fields, numeric bounds, $ref/$defs, anyOf/oneOf/allOf and additionalProperties.
(Left out: unbounded recursion and bare numbers; at temperature 1 the model may nest or write
digits past any token budget. Bounded numbers appear inside nested-people.)"""

from __future__ import annotations

from typing import Any

from helpers import person_schema

S = {"type": "string", "maxLength": 6}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}
CLOSED = {"additionalProperties": False}

CORPUS: dict[str, dict[str, Any]] = {
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "integer-bounds": {"type": "integer", "minimum": -5, "maximum": 5},
    "integer-exclusive": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 14},
    "string-length": {"type": "string", "minLength": 2, "maxLength": 5},
    "string-pattern": {"type": "string", "pattern": "^[A-Z][a-z]{1,4}$"},
    "string-date": {"type": "string", "format": "date"},
    "enum-strings": {"enum": ["red", "green", "blue"]},
    "enum-mixed": {"enum": ["a", 1, None, True]},
    "const": {"const": "fixed"},
    "array-ints": {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 4},
    "array-unique-bool": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    "array-prefix": {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}],
        "items": False,
    },
    "array-exact": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 3, "maxItems": 3},
    "object-required": {
        "type": "object",
        "properties": {"id": SMALL_INT, "tag": S},
        "required": ["id", "tag"],
        "additionalProperties": False,
    },
    "object-optional": {
        "type": "object",
        "properties": {"a": SMALL_INT, "b": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "object-all-optional": {
        "type": "object",
        "properties": {"x": {"type": "boolean"}},
        "additionalProperties": False,
    },
    "object-additional-typed": {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxProperties": 2,
    },
    "object-nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": S, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array-of-objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": ["p", "q"]}, "v": SMALL_INT},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
    "object-with-array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "ref-defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": SMALL_INT, "y": SMALL_INT},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
        "additionalProperties": False,
    },
    "ref-definitions": {
        "definitions": {"color": {"enum": ["red", "blue"]}},
        "type": "array",
        "items": {"$ref": "#/definitions/color"},
        "minItems": 1,
        "maxItems": 3,
    },
    "ref-chained": {
        "$defs": {
            "digit": {"type": "integer", "minimum": 0, "maximum": 9},
            "pair": {
                "type": "array",
                "prefixItems": [{"$ref": "#/$defs/digit"}, {"$ref": "#/$defs/digit"}],
                "items": False,
                "minItems": 2,
            },
        },
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/pair"}},
        "required": ["p"],
        "additionalProperties": False,
    },
    "anyof-scalar": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    "anyof-objects": {
        "anyOf": [
            {"type": "object", "properties": {"cat": S}, "required": ["cat"], **CLOSED},
            {"type": "object", "properties": {"dog": SMALL_INT}, "required": ["dog"], **CLOSED},
        ]
    },
    "oneof-disjoint": {
        "oneOf": [
            {"type": "string", "enum": ["on", "off"]},
            {"type": "integer", "minimum": 0, "maximum": 3},
        ]
    },
    "allof-merge": {
        "allOf": [
            {"type": "object", "properties": {"a": SMALL_INT}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ],
        "additionalProperties": False,
        "properties": {"a": True, "b": True},
    },
    "type-union": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    "nullable-field": {
        "type": "object",
        "properties": {"note": {"anyOf": [S, {"type": "null"}]}},
        "required": ["note"],
        "additionalProperties": False,
    },
    "pattern-properties": {
        "type": "object",
        "patternProperties": {"^n[0-9]$": SMALL_INT},
        "additionalProperties": False,
        "maxProperties": 2,
    },
    "issue-person": person_schema(max_name=10, max_age=120, cities=["Paris", "London", "Tokyo"]),
    "nested-people": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "n": {"type": "string", "maxLength": 5},
                "r": {"enum": ["a", "b"]},
                "s": {"type": "number", "minimum": 0, "maximum": 10},
            },
            "required": ["n", "r", "s"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
}
