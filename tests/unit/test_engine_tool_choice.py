"""tool_choice "required" and a named function: SGLang's checks and messages, the JSON
schema that constrains decoding to an array of calls, and that array read back as
``tool_calls`` (streamed or not). The engine decoding under it is in
tests/integration/test_engine_openai.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from sglang_protocol_for_tests import validate_with_sglang

from moerl.engine.openai.requests import Call, chat_call
from moerl.engine.openai.responses import chat_response
from moerl.engine.openai.stream import chat_events
from moerl.engine.openai.tool_calls import parse_call_array
from moerl.engine.openai.tool_choice import ToolChoice, calls_schema, tool_choice
from moerl.engine.validate import RequestError

ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "neg"}},
]
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, choice",
    [
        ({}, ToolChoice("none")),
        ({"tools": TOOLS}, ToolChoice("auto")),
        ({"tools": TOOLS, "tool_choice": "required"}, ToolChoice("required")),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "neg"}}},
            ToolChoice("function", "neg"),
        ),
    ],
)
def test_choices(body, choice):
    assert tool_choice(body) == choice


@pytest.mark.parametrize(
    "body, words",
    [
        ({"tool_choice": "required"}, ["Tools cannot be empty", "required"]),
        ({"tools": [], "tool_choice": "required"}, ["Tools cannot be empty"]),
        (
            {"tool_choice": {"type": "function", "function": {"name": "add"}}},
            ["Tools cannot be empty", "specific tool"],
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            ["Tool 'mul' not found in tools list."],
        ),
        ({"tools": TOOLS, "tool_choice": "any"}, ["required", "'any'"]),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, ['"name"']),
    ],
)
def test_bad_choices_name_the_problem(body, words):
    with pytest.raises(RequestError) as err:
        tool_choice(body)
    assert err.value.field == "tool_choice"
    for word in words:
        assert word in str(err.value)


def test_the_schema_is_an_array_of_the_chosen_calls():
    required = calls_schema(TOOLS, ToolChoice("required"))
    assert required["minItems"] == 1 and "maxItems" not in required
    items = required["items"]["anyOf"]
    assert [i["properties"]["name"]["enum"] for i in items] == [["add"], ["neg"]]
    assert items[0]["properties"]["parameters"] == ADD
    assert items[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    named = calls_schema(TOOLS, ToolChoice("function", "add"), parallel=False)
    assert named["maxItems"] == 1 and named["items"]["properties"]["name"]["enum"] == ["add"]


def test_conflicting_defs_are_refused():
    tools = [
        {"function": {"name": n, "parameters": {"$defs": {"x": {"type": t}}}}}
        for n, t in (("a", "string"), ("b", "integer"))
    ]
    with pytest.raises(RequestError, match="'x' has multiple schemas"):
        calls_schema(tools, ToolChoice("required"))


class _Tokenizer:
    chat_template = "t"

    def apply_chat_template(self, messages, tools=None, **kw):  # noqa: ANN001, ANN003, ANN201
        self.tools = tools
        return "ab"

    def __call__(self, text, add_special_tokens=False):  # noqa: ANN001, ANN201
        return type("Enc", (), {"input_ids": [1, 2]})()


def _chat(**body: Any) -> tuple[Call, _Tokenizer]:
    tok = _Tokenizer()
    return chat_call({"messages": USER, "tools": TOOLS, **body}, tok, "qwen25", {}, 128), tok


def test_a_forced_choice_constrains_decoding_and_shows_the_template_its_tools():
    call, tok = _chat(tool_choice={"type": "function", "function": {"name": "add"}})
    schema = json.loads(call.generate["sampling_params"]["json_schema"])
    assert schema == calls_schema(TOOLS, ToolChoice("function", "add"))
    assert call.forced_calls and [t["function"]["name"] for t in tok.tools] == ["add"]
    call, tok = _chat(tool_choice="required", parallel_tool_calls=False)
    assert json.loads(call.generate["sampling_params"]["json_schema"])["maxItems"] == 1
    assert len(tok.tools) == 2
    call, _ = _chat()  # auto: no constraint, <tool_call> blocks parsed afterwards
    assert "json_schema" not in call.generate["sampling_params"] and not call.forced_calls


@pytest.mark.parametrize(
    "extra",
    [{"regex": "a"}, {"ebnf": "root ::= [a]"}, {"response_format": {"type": "json_object"}}],
)
def test_a_forced_choice_takes_no_other_output_constraint(extra):
    with pytest.raises(RequestError, match="cannot be combined"):
        _chat(tool_choice="required", **extra)
    _chat(tool_choice="auto", **extra)  # auto leaves the output free


ARRAY = '[{"name": "add", "parameters": {"a": 1}}, {"name": "neg", "parameters": {}}]'


def test_the_array_is_read_back_as_calls():
    parsed = parse_call_array(ARRAY, TOOLS)
    assert parsed.content == ""
    assert [(c["index"], c["function"]["name"]) for c in parsed.calls] == [(0, "add"), (1, "neg")]
    assert json.loads(parsed.calls[0]["function"]["arguments"]) == {"a": 1}


@pytest.mark.parametrize("text", [ARRAY[:20], "[1, 2]", '"add"', ""])
def test_an_unfinished_array_is_plain_content(text):
    parsed = parse_call_array(text, TOOLS)
    assert parsed.calls == [] and parsed.content == text


def _ret(text: str, reason: dict | None) -> dict[str, Any]:
    meta = {
        "id": "r1",
        "finish_reason": reason,
        "prompt_tokens": 3,
        "completion_tokens": len(text),
        "weight_version": "0",
    }
    return {"text": text, "output_ids": [1] * len(text), "meta_info": meta}


def _forced(stream: bool = False) -> Call:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "stream": stream}
    return Call({}, "m", 1, stream, body, tools=TOOLS, forced_calls=True)


def test_chat_response_of_a_forced_call():
    out = chat_response(_forced(), [_ret(ARRAY, {"type": "stop", "matched": 2})], [[5]])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add", "neg"]
    validate_with_sglang([("ChatCompletionResponse", out)])
    cut = chat_response(_forced(), [_ret(ARRAY[:30], {"type": "length"})], [[5]])["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == ARRAY[:30]
    assert "tool_calls" not in cut["message"]


def test_a_streamed_forced_call_sends_no_json_as_content():
    finals = [_ret(ARRAY[:k], None) for k in (1, 10, 40)]
    finals.append(_ret(ARRAY, {"type": "stop", "matched": 2}))

    async def items() -> Any:
        for ret in finals:
            yield 0, ret

    async def collect() -> list[str]:
        return [line async for line in chat_events(_forced(True), [], items())]

    lines = asyncio.run(collect())
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["add", "neg"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    validate_with_sglang([("ChatCompletionStreamResponse", c) for c in chunks])
