"""Tool-call parsing for ``/v1/chat/completions``: SGLang 0.5.23's ``qwen25`` / ``qwen`` /
``hermes`` format (``--tool-call-parser``), which Qwen 2.5/3 and Hermes-style chat
templates teach the model::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

Text before the first ``<tool_call>`` is the message's ``content`` (stripped, as SGLang's
``Qwen25Detector.detect_and_parse``); each complete block whose JSON names a tool of the
request becomes one ``tool_calls`` entry with ``arguments`` as a JSON string. As in
SGLang, a block that is not valid JSON or names an unknown tool is dropped (the model's
mistake is visible in the trajectory, never a server error), and output that opens a
block without closing it is returned as plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("qwen25", "qwen", "hermes")
"""``--tool-call-parser`` names served: all three read the ``<tool_call>`` JSON blocks."""

BOT, EOT = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(BOT) + r"(.*?)" + re.escape(EOT), re.DOTALL)


@dataclass
class ParsedCalls:
    content: str
    calls: list[dict[str, Any]]  # OpenAI ``tool_calls`` entries


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [str(t["function"]["name"]) for t in tools]


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> ParsedCalls:
    """Split a finished message into content and tool calls (see the module docstring)."""
    start = text.find(BOT)
    if start == -1:
        return ParsedCalls(text, [])
    known = set(tool_names(tools))
    calls: list[dict[str, Any]] = []
    for block in _BLOCK.findall(text):
        try:
            action = json.loads(block.strip())
        except json.JSONDecodeError:
            continue
        for act in action if isinstance(action, list) else [action]:
            if not isinstance(act, dict) or act.get("name") not in known:
                continue
            args = act.get("parameters") or act.get("arguments") or {}
            calls.append(_call(len(calls), act["name"], args))
    if not calls:  # a marker but no complete call: SGLang keeps the text as it is
        return ParsedCalls(text, [])
    return ParsedCalls(text[:start].strip(), calls)


def parse_call_array(text: str, tools: list[dict[str, Any]]) -> ParsedCalls:
    """The output of a forced ``tool_choice`` (``tool_choice.py``): a JSON array of
    ``{"name", "parameters"}`` calls, all of them tool calls. Output the grammar did not
    let finish (cut by max_tokens or a stop string) is returned as plain content, as
    SGLang returns it when the array does not parse. ``tools`` is unused: the grammar
    already held each name to a tool's."""
    try:
        action = json.loads(text)
    except json.JSONDecodeError:
        return ParsedCalls(text, [])
    actions = [action] if isinstance(action, dict) else action
    if not isinstance(actions, list) or not all(
        isinstance(act, dict) and isinstance(act.get("name"), str) for act in actions
    ):
        return ParsedCalls(text, [])
    return ParsedCalls(
        "", [_call(i, act["name"], act.get("parameters", {})) for i, act in enumerate(actions)]
    )


def _call(index: int, name: str, args: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "index": index,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def safe_prefix(text: str) -> int:
    """How much of a partial message can be streamed as content: everything before a
    ``<tool_call>`` or before a tail that may be the start of one."""
    start = text.find(BOT)
    if start != -1:
        return start
    for k in range(min(len(BOT) - 1, len(text)), 0, -1):
        if BOT.startswith(text[-k:]):
            return len(text) - k
    return len(text)
