"""Tool calls in the policy's text, and the `calc` tool (docs/architecture.md, "Episodes").

The tool-call format is one line of characters that every tokenizer has, the built-in
tiny one included (so a random-init tiny model can produce it):

    call:NAME(ARGS)          e.g. `call:calc(12+7*3)`

    call       := "call:" " "* NAME " "* "(" ARGS ")"
    NAME       := one or more of a-z and _
    ARGS       := any text whose parentheses balance (`call:calc((1+2)*3)`)

The first `call:` in the text starts the call; text before it is free (thinking), text
after the closing parenthesis is ignored (one call per turn). `parse_tool_call` returns
None for text without `call:` (a final answer), a `ToolCall` for a well-formed call and a
`ToolCallError` (never an exception) for a malformed one; the environment turns the error
into an `error: ...` observation.

`calc` evaluates ARGS as integer arithmetic without eval(): integers (a leading `-` is a
unary minus), `+`, `-`, `*` (binding tighter), parentheses, spaces. Bounds keep it cheap
on whatever a policy samples: numbers and results above `MAX_VALUE` in magnitude,
expressions over `MAX_CHARS` characters and nesting deeper than `MAX_DEPTH` are errors.
Error reasons use only the tiny tokenizer's characters, and never echo the policy's text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_VALUE = 10**18
"""Largest magnitude of a number or an intermediate result of `calc`."""
MAX_CHARS = 200
"""Longest `calc` expression."""
MAX_DEPTH = 16
"""Deepest parenthesis nesting of a `calc` expression."""

_CALL = "call:"
_NAME = re.compile(r" *([a-z_]+) *")


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: `call:NAME(ARGS)`."""

    name: str
    """The tool's name (a-z and _)."""
    args: str
    """The text between the outer parentheses, as written."""


@dataclass(frozen=True)
class ToolCallError:
    """A malformed call or a failed evaluation; `reason` is tokenizer-safe text."""

    reason: str
    """Why, in the tiny tokenizer's characters (e.g. 'unbalanced parentheses')."""


def parse_tool_call(text: str) -> ToolCall | ToolCallError | None:
    """The first tool call in `text`; None when `text` holds no `call:` (an answer)."""
    start = text.find(_CALL)
    if start < 0:
        return None
    rest = text[start + len(_CALL) :]
    name = _NAME.match(rest)
    if name is None:
        return ToolCallError("no tool name after call:")
    pos = name.end()
    if pos >= len(rest) or rest[pos] != "(":
        return ToolCallError("expected ( after the tool name")
    depth = 0
    for i in range(pos, len(rest)):
        if rest[i] == "(":
            depth += 1
        elif rest[i] == ")":
            depth -= 1
            if depth == 0:
                return ToolCall(name.group(1), rest[pos + 1 : i])
    return ToolCallError("unbalanced parentheses")


def calc(expression: str) -> int | ToolCallError:
    """The value of an integer expression (see the module docstring), or why not."""
    if len(expression) > MAX_CHARS:
        return ToolCallError(f"expression longer than {MAX_CHARS} characters")
    tokens = re.findall(r"[0-9]+|\S", expression)
    try:
        parser = _Parser(tokens)
        value = parser.sum(0)
        if parser.pos != len(tokens):
            raise _Invalid("unexpected " + _describe(tokens[parser.pos]))
    except _Invalid as err:
        return ToolCallError(str(err))
    return value


class _Invalid(Exception):
    pass


def _describe(token: str) -> str:
    if token in ("(", ")"):
        return "parenthesis"
    if token in ("+", "-", "*"):
        return "operator " + token
    if token == "/":
        return "operator / (division is not supported)"
    return "number" if _is_number(token) else "character"


def _is_number(token: str) -> bool:
    return token[0] in "0123456789"


def _bounded(value: int) -> int:
    if abs(value) > MAX_VALUE:
        raise _Invalid("number too big")
    return value


class _Parser:
    """Recursive descent: sum := product (('+'|'-') product)*; product := unary ('*'
    unary)*; unary := '-' unary | atom; atom := integer | '(' sum ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise _Invalid("expression ends too early")
        self.pos += 1
        return token

    def sum(self, depth: int) -> int:
        value = self.product(depth)
        while self._peek() in ("+", "-"):
            op = self._take()
            right = self.product(depth)
            value = _bounded(value + right if op == "+" else value - right)
        return value

    def product(self, depth: int) -> int:
        value = self.unary(depth)
        while self._peek() == "*":
            self._take()
            value = _bounded(value * self.unary(depth))
        return value

    def unary(self, depth: int) -> int:
        if self._peek() == "-":
            self._take()
            return -self.unary(depth)
        return self.atom(depth)

    def atom(self, depth: int) -> int:
        token = self._take()
        if token == "(":
            if depth >= MAX_DEPTH:
                raise _Invalid(f"more than {MAX_DEPTH} nested parentheses")
            value = self.sum(depth + 1)
            if self._peek() != ")":
                raise _Invalid("unbalanced parentheses")
            self._take()
            return value
        if _is_number(token):
            if len(token) > len(str(MAX_VALUE)):
                raise _Invalid("number too big")
            return _bounded(int(token))
        raise _Invalid("unexpected " + _describe(token))
