"""``tools`` and ``tool_choice`` of a chat completion: the tools the chat template shows, and a
forced call (``"required"`` or a named function) as a JSON-schema grammar and its reply.

A forced call is generated under a grammar, whatever the model's own tool-call format (as vLLM
does): for a named function the output is its arguments object (the tool's ``parameters``
schema); for ``"required"`` it is a JSON array of ``{"name": ..., "parameters": {...}}`` calls,
each to one of the offered tools (exactly one with ``parallel_tool_calls=false``). With
``"auto"`` the model may call a tool in its own format, parsed by
:func:`lloyal.parse_chat_output`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import lloyal

from .call_scanner import CallScanner, required_calls
from .protocol import ApiError, ChatRequest
from .replies import assistant_message, tool_call

__all__ = ["ToolChoice", "tool_choice"]

# The schema of a function that declares no ``parameters``: it takes none.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request does with tools.

    Attributes:
        tools: The tools the chat template is given (``None``: no tools, or ``tool_choice="none"``).
        forced: ``None`` (the model chooses), ``"required"``, or the name of the forced function.
        schema: The JSON schema a forced call is generated under.
    """

    tools: list[dict[str, Any]] | None = None
    forced: str | None = None
    schema: dict[str, Any] | None = None

    @property
    def named(self) -> str | None:
        """The forced function's name (``None`` unless one function is forced)."""
        return self.forced if self.forced not in (None, "required") else None

    def grammar(self, ctx: lloyal.Context) -> lloyal.Grammar | None:
        """The grammar of a forced call (``None`` otherwise); a schema llguidance cannot compile
        is a 400 naming ``tools``."""
        if self.schema is None:
            return None
        try:
            return lloyal.Grammar.from_json_schema(ctx, self.schema)
        except lloyal.GrammarError as exc:
            raise ApiError(f"tools: a function's parameters schema: {exc}", param="tools") from None

    def message(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """A choice's generated ``text`` as the assistant message, and its finish reason.

        A named call is ``stop`` as OpenAI answers a forced function (``length`` when cut, its
        arguments then partial JSON); ``"required"`` is ``tool_calls``, each call's arguments the
        text the model wrote for its ``parameters``. Cut by ``max_tokens``, a ``"required"`` reply
        is ``length`` with the calls named so far, the last one's arguments partial (what its
        stream sent), or the text as content when it was cut before the first name."""
        if self.named is not None:
            return {"role": "assistant", "content": None, "tool_calls": [tool_call(self.named, text)]}, reason
        if self.forced == "required":
            calls = required_calls(text)
            finish = "tool_calls"
            if calls is None:  # cut: the calls as its stream sent them
                scanner = CallScanner()
                scanner.feed(text)
                calls = [(c.name, c.arguments) for c in scanner.calls if c.name is not None]
                finish = reason
            if not calls:
                return {"role": "assistant", "content": text}, reason
            tool_calls = [tool_call(name, arguments) for name, arguments in calls]
            return {"role": "assistant", "content": None, "tool_calls": tool_calls}, finish
        return assistant_message(text, reason, self.tools is not None)


def tool_choice(body: ChatRequest) -> ToolChoice:
    """``body``'s ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked: every refusal is
    a 400 naming the field."""
    choice = body.tool_choice
    if body.tools:
        _functions(body.tools)  # malformed tools are refused whatever the choice
    if choice in (None, "auto"):
        return ToolChoice(tools=body.tools)
    if choice == "none":
        return ToolChoice()
    if choice != "required" and not isinstance(choice, dict):
        raise ApiError(
            f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}",
            param="tool_choice",
        )
    functions = _functions(body.tools)
    if choice == "required":
        defs: dict[str, Any] = {}
        calls: dict[str, Any] = {
            "anyOf": [_call_schema(name, _hoisted(name, params, defs)) for name, params in functions.items()]
        }
        schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
        if defs:
            schema["$defs"] = defs
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolChoice(tools=body.tools, forced="required", schema=schema)
    assert isinstance(choice, dict)
    name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise ApiError(
            'a forced tool_choice is {"type": "function", "function": {"name": ...}}, got '
            f"{json.dumps(choice)}",
            param="tool_choice",
        )
    if name not in functions:
        raise ApiError(
            f"tool_choice names the function {name!r}, which is not in tools ({', '.join(functions)})",
            param="tool_choice",
        )
    return ToolChoice(tools=body.tools, forced=name, schema=functions[name])


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The offered functions by name, with their parameters schemas (a forced call needs tools)."""
    if not tools:
        raise ApiError("a forced tool_choice needs tools to choose from", param="tool_choice")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or not isinstance(name, str) or not name:
            raise ApiError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                param="tools",
            )
        params = fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(params, dict):
            raise ApiError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        out[name] = params
    return out


def _hoisted(name: str, params: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``params`` as it reads inside the ``"required"`` array: a schema that refers within itself
    (``$ref`` to its ``$defs``, ``definitions`` or root, as Pydantic's do) moves into the
    array's ``$defs`` as ``name`` and its definitions as ``name.X``, its references rewritten;
    nested where it was, ``#/$defs/X`` would point at the array's root. Other schemas stay."""
    if "$ref" not in json.dumps(params):
        return params
    key = name.replace("~", "~0").replace("/", "~1")

    def moved(ref: str) -> str:
        for where in ("#/$defs/", "#/definitions/"):
            if ref.startswith(where):
                return f"#/$defs/{key}.{ref[len(where) :]}"
        if ref == "#" or ref.startswith("#/"):
            return f"#/$defs/{key}{ref[1:]}"
        return ref  # not a reference within the schema

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: moved(v) if k == "$ref" and isinstance(v, str) else rewrite(v) for k, v in node.items()
            }
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    body = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
    for where in ("$defs", "definitions"):
        for def_name, sub in (params.get(where) or {}).items():
            defs[f"{name}.{def_name}"] = rewrite(sub)
    defs[name] = rewrite(body)
    return {"$ref": f"#/$defs/{key}"}


def _call_schema(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """One call of ``name`` as an element of the ``"required"`` array."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "parameters": params},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
