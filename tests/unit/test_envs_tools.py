"""The tool-call grammar (moerl.envs.tools): parsing `call:NAME(ARGS)` and the `calc`
tool's integer arithmetic, against hand-computed values."""

from __future__ import annotations

import pytest

from moerl.envs.tools import MAX_DEPTH, MAX_VALUE, ToolCall, ToolCallError, calc, parse_tool_call


@pytest.mark.parametrize(
    "text, call",
    [
        ("call:calc(12+7)", ToolCall("calc", "12+7")),
        ("let me see call:calc(12+7) ok", ToolCall("calc", "12+7")),
        ("call: calc (3*4)", ToolCall("calc", "3*4")),
        ("call:calc((1+2)*(3+4))", ToolCall("calc", "(1+2)*(3+4)")),
        ("call:calc(-5+2)", ToolCall("calc", "-5+2")),
        ("call:calc()", ToolCall("calc", "")),
        ("call:calc(1) call:calc(2)", ToolCall("calc", "1")),  # one call per turn
        ("call:web_search(x)", ToolCall("web_search", "x")),
    ],
)
def test_well_formed_calls(text: str, call: ToolCall) -> None:
    assert parse_tool_call(text) == call


@pytest.mark.parametrize("text", ["40", "answer: 40", "", "calc(1+2)", "call calc(1)"])
def test_text_without_a_call_is_an_answer(text: str) -> None:
    assert parse_tool_call(text) is None


@pytest.mark.parametrize(
    "text, reason",
    [
        ("call:", "no tool name"),
        ("call:(1+2)", "no tool name"),
        ("call:CALC(1)", "no tool name"),
        ("call:calc", "expected ("),
        ("call:calc 1+2", "expected ("),
        ("call:calc(1+2", "unbalanced"),
        ("call:calc((1+2)", "unbalanced"),
    ],
)
def test_malformed_calls_are_errors_not_exceptions(text: str, reason: str) -> None:
    out = parse_tool_call(text)
    assert isinstance(out, ToolCallError)
    assert reason in out.reason


@pytest.mark.parametrize(
    "expr, value",
    [
        ("12+7", 19),
        ("12+7*3", 33),
        ("(12+7)*3", 57),
        ("2*(3+(4-1))*2", 24),
        ("-5+2", -3),
        ("3--2", 5),
        ("-(2+3)*2", -10),
        (" 1 + 2 ", 3),
        ("0", 0),
        ("10-2-3", 5),  # left-associative
        (str(MAX_VALUE), MAX_VALUE),
    ],
)
def test_calc_values(expr: str, value: int) -> None:
    assert calc(expr) == value


@pytest.mark.parametrize(
    "expr, reason",
    [
        ("", "ends too early"),
        ("1+", "ends too early"),
        ("(1+2", "unbalanced"),
        ("1+2)", "unexpected parenthesis"),
        ("1 2", "unexpected number"),
        ("1/2", "division is not supported"),
        ("2^3", "unexpected character"),
        ("x+1", "unexpected character"),
        ("\u0663+1", "unexpected character"),  # a non-ASCII digit is not a number
        (str(MAX_VALUE + 1), "too big"),
        ("9" * 5000, "longer than"),  # never reaches int(), whose digit limit would raise
        ("9" * 100, "too big"),
        ("999999999*999999999*999999999", "too big"),
        ("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), "nested"),
    ],
)
def test_calc_errors(expr: str, reason: str) -> None:
    out = calc(expr)
    assert isinstance(out, ToolCallError), out
    assert reason in out.reason


def test_calc_allows_nesting_up_to_the_limit() -> None:
    assert calc("(" * MAX_DEPTH + "7" + ")" * MAX_DEPTH) == 7
