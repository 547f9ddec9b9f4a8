"""Tool-call parsing of /v1/chat/completions (the ``<tool_call>{json}</tool_call>`` format
of SGLang's qwen25 / hermes parsers) and its place in chat responses, streamed or not."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from sglang_protocol_for_tests import validate_with_sglang

from moerl.engine.openai.requests import Call
from moerl.engine.openai.responses import chat_response
from moerl.engine.openai.stream import chat_events
from moerl.engine.openai.tool_calls import parse_tool_calls, safe_prefix

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "mul"}},
]
TWO_CALLS = (
    'let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "mul", "arguments": {"a": 3}}\n</tool_call>'
)


def test_parses_calls_and_keeps_the_text_before_them():
    parsed = parse_tool_calls(TWO_CALLS, TOOLS)
    assert parsed.content == "let me add."
    assert [c["function"]["name"] for c in parsed.calls] == ["add", "mul"]
    assert json.loads(parsed.calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert [c["index"] for c in parsed.calls] == [0, 1]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed.calls)


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        '<tool_call>{"name": "add", "arguments": {}}',  # never closed
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',  # not a tool of the request
    ],
)
def test_a_bad_or_missing_call_is_plain_content(text):
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == [] and parsed.content == text


def test_safe_prefix_holds_back_a_possible_marker():
    assert safe_prefix("abc") == 3
    assert safe_prefix("abc<tool") == 3
    assert safe_prefix("abc<tool_call>{") == 3
    assert safe_prefix("a<b") == 3


def _ret(text: str, reason: dict[str, Any] | None, ids: list[int]) -> dict[str, Any]:
    meta = {
        "id": "r1",
        "finish_reason": reason,
        "prompt_tokens": 3,
        "completion_tokens": len(ids),
        "weight_version": "0",
    }
    return {"text": text, "output_ids": ids, "meta_info": meta}


def _call(stream: bool = False) -> Call:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "stream": stream}
    return Call({}, "m", 1, stream, body, tools=TOOLS)


def test_chat_response_carries_tool_calls():
    out = chat_response(_call(), [_ret(TWO_CALLS, {"type": "stop", "matched": 2}, [1, 2])], [[5]])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert choice["message"]["content"] == "let me add."
    assert len(choice["message"]["tool_calls"]) == 2
    validate_with_sglang([("ChatCompletionResponse", out)])


def test_streamed_tool_calls_never_leak_the_markup():
    finals = [_ret(TWO_CALLS[:k], None, [1]) for k in (5, 12, 20, 40)]
    finals.append(_ret(TWO_CALLS, {"type": "stop", "matched": 2}, [1, 2]))

    async def items() -> Any:
        for ret in finals:
            yield 0, ret

    async def collect() -> list[str]:
        return [line async for line in chat_events(_call(True), [], items())]

    lines = asyncio.run(collect())
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content.strip() == "let me add." and "<" not in content
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
