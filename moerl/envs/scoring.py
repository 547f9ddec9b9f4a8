"""Reading numbers and answers out of a turn's text, and scoring an answer, shared by the
built-in environments (docs/architecture.md, "Episodes")."""

from __future__ import annotations

import re

from moerl.envs.tools import MAX_VALUE
from moerl.tasks.rewards import ShapedConfig, shaped_score

_INT = re.compile(r"-?[0-9]+")
_ANSWER = "answer:"
_SHAPED = ShapedConfig()


def first_int(text: str) -> int | None:
    """The first integer in `text` (a leading `-` included); one of more digits than
    MAX_VALUE has reads as just past it, so huge numbers stay cheap and compare as big."""
    found = _INT.search(text)
    if found is None:
        return None
    token = found.group()
    sign = -1 if token.startswith("-") else 1
    digits = token.lstrip("-")
    if len(digits) > len(str(MAX_VALUE)):
        return sign * (MAX_VALUE + 1)
    return int(token)


def final_answer(text: str) -> str:
    """The answer a turn gives: its text stripped, without a leading `answer:`."""
    text = text.strip()
    if text.startswith(_ANSWER):
        text = text[len(_ANSWER) :].strip()
    return text


def answer_reward(text: str, answer: str, stopped: bool, partial_credit: float) -> float:
    """1 when the turn's answer is exactly `answer`, else partial_credit times its
    `shaped` score (digits, right digits at their positions, stopping at the right
    length; moerl.tasks.rewards), which is below 1."""
    given = final_answer(text)
    if given == answer:
        return 1.0
    return partial_credit * shaped_score(given, answer, stopped, _SHAPED)
