"""``tool_choice`` for ``/v1/chat/completions``, as SGLang 0.5.23 checks and serves it.

``"auto"`` lets the model write a ``<tool_call>`` block or not (parsed afterwards by
``tool_calls.py``); ``"none"`` hides the tools. ``"required"`` and a named function
(``{"type": "function", "function": {"name": "f"}}``) constrain decoding instead: the
output must be a JSON array of calls, ``[{"name": "f", "parameters": {...}}, ...]``, with
each call's ``parameters`` valid for that tool's schema, so even an untrained model
returns at least one well-formed call (at most one with ``parallel_tool_calls=false``).
This is SGLang's ``json_schema`` tool-call constraint (``get_json_schema_constraint``),
read back whole, as its ``JsonArrayParser`` does.

SGLang 0.5.23 takes this path when the tool-call parser has no structural tag; for
``qwen25`` / ``hermes`` it constrains the model's own ``<tool_call>`` format instead (and
checks arguments only for ``strict`` tools). The embedded engine always uses the array,
so the trajectory's text differs from SGLang's there; the response does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moerl.engine.validate import RequestError, show

MODES = ("auto", "none", "required")
# The output constraints a forced call cannot share the output with (SGLang's message).
CONSTRAINTS = ("regex", "ebnf", "json_schema", "response_format")


@dataclass(frozen=True)
class ToolChoice:
    """A request's ``tool_choice``: ``mode`` is auto, none, required or function (then
    ``name`` is the function the model must call)."""

    mode: str
    name: str | None = None

    @property
    def forced(self) -> bool:
        """The model must call a tool: decoding is constrained to a JSON array of calls."""
        return self.mode in ("required", "function")


def tool_choice(body: dict[str, Any]) -> ToolChoice:
    """The request's choice, checked against its tools (already checked to be functions
    with names) with SGLang's messages."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    if choice is None:  # SGLang's set_tool_choice_default
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in MODES:
            raise RequestError(
                "tool_choice",
                f'must be "auto", "none", "required" or {{"type": "function", "function": '
                f'{{"name": ...}}}}, got {show(choice)}',
            )
        if choice == "required" and not tools:
            raise RequestError(
                "tool_choice", "Tools cannot be empty if tool choice is set to required."
            )
        return ToolChoice(choice)
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise RequestError(
            "tool_choice",
            f'must be {{"type": "function", "function": {{"name": ...}}}}, got {show(choice)}',
        )
    if not tools:
        raise RequestError(
            "tool_choice", "Tools cannot be empty if tool choice is set to a specific tool."
        )
    if name not in [t["function"]["name"] for t in tools]:
        raise RequestError("tool_choice", f"Tool '{name}' not found in tools list.")
    return ToolChoice("function", name)


def check_unconstrained(body: dict[str, Any]) -> None:
    """A forced call is the whole output, so no other output constraint may be set."""
    for name in CONSTRAINTS:
        value = body.get(name)
        if name == "response_format" and value and value.get("type") == "text":
            continue
        if value:
            raise RequestError(
                name,
                "tool_choice 'required' or a named tool cannot be combined with "
                "response_format, regex, or ebnf: the tool-call constraint and the output "
                "constraint cannot both be honored.",
            )


def calls_schema(
    tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool = True
) -> dict[str, Any]:
    """The JSON schema of the forced output: an array of one or more calls (of the named
    function only, for a named choice); one at most unless ``parallel``."""
    chosen = [t["function"] for t in tools if choice.name in (None, t["function"]["name"])]
    calls = [_call_schema(f) for f in chosen]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"type": "object", "anyOf": calls},
    }
    if not parallel:
        schema["maxItems"] = 1
    defs = _defs(chosen)
    if defs:
        schema["$defs"] = defs
    return schema


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """One call: the function's name and arguments valid for its ``parameters``. No
    other keys, as SGLang's default grammar backend (xgrammar, strict mode) allows."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [function["name"]]},
            "parameters": function.get("parameters") or {"type": "object", "properties": {}},
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _defs(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """The tools' ``$defs``, lifted to the array's root where their ``$ref``s point."""
    defs: dict[str, Any] = {}
    for function in functions:
        for name, schema in ((function.get("parameters") or {}).get("$defs") or {}).items():
            if name in defs and defs[name] != schema:
                raise RequestError(
                    "tools",
                    f"Tool definition '{name}' has multiple schemas, which is not supported.",
                )
            defs[name] = schema
    return defs
