"""The verifier rewards: `math` against a hand-written table of equivalent and different
answers (also from worker threads, where signal-based timeouts fail), `format_length`,
and the `code` sandbox's limits (each failure is reward 0 with a reason, never a raise)."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from moerl.common.trajectory import Trajectory
from moerl.tasks import Prompt, RewardInput, build_reward
from moerl.tasks.verifiers.code import extract_code
from moerl.tasks.verifiers.format_length import length_factor
from moerl.tasks.verifiers.math_answer import extract_answer

linux_only = pytest.mark.skipif(
    sys.platform != "linux", reason="the sandbox's limits are Linux rlimits"
)


def make_input(text: str, answer: Any, stopped: bool = True, tokens: int = 1) -> RewardInput:
    traj = Trajectory(
        np.zeros(1, np.int32),
        np.zeros(tokens, np.int32),
        np.zeros(tokens, np.float32),
        np.zeros(tokens, np.int32),
    )
    return RewardInput(text, answer, stopped, Prompt(0, np.zeros(1, np.int32)), traj)


# ---------------------------------------------------------------- math

EQUIVALENT = [
    ("\\boxed{1/2}", "0.5"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("The answer is \\boxed{\\frac12}.", "2/4"),
    ("so x=3", "3"),
    ("\\boxed{x=3}", "3"),
    ("answer: 1,000", "1000"),
    ("\\boxed{1,000}", "1000"),
    ("First 7, then finally 0.5", "1/2"),
    ("\\boxed{2^{1/2}}", "\\sqrt{2}"),
]
DIFFERENT = [
    ("\\boxed{0.51}", "0.5"),
    ("\\boxed{3}", "4"),
    ("answer: 1/3", "0.5"),
    ("three", "3"),
    ("", "3"),
]


@pytest.fixture(scope="module")
def math_reward() -> Any:
    pytest.importorskip("math_verify", reason="pip install moerl[verify]")
    return build_reward("math", {"timeout_s": 10.0})


@pytest.mark.parametrize("text,answer", EQUIVALENT)
def test_math_equivalent(math_reward: Any, text: str, answer: str) -> None:
    inp = make_input(text, answer)
    assert math_reward(inp) == 1.0, inp.traj.meta


@pytest.mark.parametrize("text,answer", DIFFERENT)
def test_math_different(math_reward: Any, text: str, answer: str) -> None:
    inp = make_input(text, answer)
    assert math_reward(inp) == 0.0
    assert inp.traj.meta["reward_reason"]


def test_math_from_worker_threads(math_reward: Any) -> None:
    """The orchestrator scores in a thread pool: no 'signal only works in main thread'."""
    cases = [(t, a, 1.0) for t, a in EQUIVALENT] + [(t, a, 0.0) for t, a in DIFFERENT]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: math_reward(make_input(c[0], c[1])), cases))
    assert got == [want for _, _, want in cases]


def test_math_pathological_input_is_bounded() -> None:
    """A check past timeout_s is killed: reward 0 with a reason, and the next check works."""
    pytest.importorskip("math_verify")
    reward = build_reward("math", {"timeout_s": 0.2})
    # math-verify's own alarm is 1 s at least, so the 0.2 s bound is the kill
    inp = make_input("\\boxed{9^{9^{9^{9^{9}}}}}", "1")
    start = time.monotonic()
    assert reward(inp) == 0.0
    assert time.monotonic() - start < 0.2 + 2.0
    assert "timeout_s" in inp.traj.meta["reward_reason"]
    assert build_reward("math", {"timeout_s": 10.0})(make_input("\\boxed{2}", "2")) == 1.0


def test_math_format_weight_and_stop() -> None:
    pytest.importorskip("math_verify")
    reward = build_reward("math", {"format_weight": 0.2})
    assert reward(make_input("\\boxed{5}", "4")) == pytest.approx(0.2)
    assert reward(make_input("5", "4")) == 0.0
    assert reward(make_input("\\boxed{4}", "4")) == pytest.approx(1.0)
    inp = make_input("\\boxed{4}", "4", stopped=False)
    assert reward(inp) == 0.0 and "truncated" in inp.traj.meta["reward_reason"]


def test_math_extraction() -> None:
    assert extract_answer("blah \\boxed{3} more") == ("blah \\boxed{3} more", True)
    assert extract_answer("work\nAnswer: 42\nthanks") == ("42", True)
    assert extract_answer("just 42") == ("just 42", False)
    assert extract_answer("answer: 7", marker="") == ("answer: 7", False)


# ---------------------------------------------------------------- format_length


def test_format_length() -> None:
    reward = build_reward("format_length", {"target_length": 10, "overlong_window": 10})
    assert reward(make_input("answer: 4", None, tokens=8)) == 1.0
    assert reward(make_input("answer: 4", None, tokens=15)) == pytest.approx(0.5)
    assert reward(make_input("answer: 4", None, tokens=25)) == 0.0
    inp = make_input("4", None, tokens=3)
    assert reward(inp) == 0.0 and "not found" in inp.traj.meta["reward_reason"]
    boxed = build_reward("format_length", {"pattern": r"\\boxed\{.+\}", "unit": "chars"})
    assert boxed(make_input("\\boxed{4}", None)) == 1.0
    assert boxed(make_input("answer: 4", None)) == 0.0
    hard = build_reward("format_length", {"pattern": "", "target_length": 3, "unit": "chars"})
    assert hard(make_input("abc", None)) == 1.0 and hard(make_input("abcd", None)) == 0.0
    assert length_factor(12, 10, 4) == pytest.approx(0.5)


def test_format_length_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="unit"):
        build_reward("format_length", {"unit": "words"})
    with pytest.raises(ValueError, match="not a regex"):
        build_reward("format_length", {"pattern": "("})


# ---------------------------------------------------------------- code

TESTS = {"tests": ["assert f(2) == 4", "assert f(3) == 9", "assert f(-1) == 1"]}
LIMIT_S = 2.0
SLACK_S = 3.0  # interpreter start-up and the kill, on a loaded CI machine


@pytest.fixture(scope="module")
def code_reward() -> Any:
    return build_reward("code", {"timeout_s": LIMIT_S, "memory_mb": 512, "output_bytes": 10_000})


def score(reward: Any, text: str, answer: Any = TESTS) -> tuple[float, str, float]:
    inp = make_input(text, answer)
    start = time.monotonic()
    value = reward(inp)
    return value, inp.traj.meta.get("reward_reason", ""), time.monotonic() - start


@linux_only
def test_code_correct_and_wrong(code_reward: Any) -> None:
    good = "Here it is:\n```python\ndef f(x):\n    return x * x\n```\n"
    assert score(code_reward, good)[0] == 1.0
    value, reason, _ = score(code_reward, "```\ndef f(x):\n    return 2 * x\n```")
    assert value == pytest.approx(1 / 3)
    assert "1/3 passed" in reason and "AssertionError" in reason
    strict = build_reward("code", {"all_or_nothing": True})
    assert score(strict, "def f(x):\n    return 2 * x")[0] == 0.0


@linux_only
def test_code_infinite_loop_is_killed(code_reward: Any) -> None:
    value, reason, elapsed = score(code_reward, "def f(x):\n    while True:\n        pass")
    assert value == 0.0 and "time limit" in reason
    assert elapsed < LIMIT_S + SLACK_S


@linux_only
def test_code_memory_hog_is_stopped(code_reward: Any) -> None:
    value, reason, elapsed = score(
        code_reward, "big = bytearray(2 * 1024**3)\ndef f(x):\n    return x * x"
    )
    assert value == 0.0 and "MemoryError" in reason
    assert elapsed < LIMIT_S + SLACK_S


@linux_only
@pytest.mark.parametrize(
    "program",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)",
        "import _socket\n_socket.socket()",
        "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)",
    ],
)
def test_code_network_fails(code_reward: Any, program: str) -> None:
    value, reason, _ = score(code_reward, program + "\ndef f(x):\n    return x * x")
    assert value == 0.0 and "failed to load" in reason


@linux_only
def test_code_subprocess_and_outside_writes_fail(code_reward: Any, tmp_path: Any) -> None:
    for program in ("import os\nos.system('true')", f"open({str(tmp_path / 'x')!r}, 'w')"):
        value, reason, _ = score(code_reward, program + "\ndef f(x):\n    return x * x")
        assert value == 0.0 and "not allowed" in reason
    assert not (tmp_path / "x").exists()


@linux_only
def test_code_stdout_flood_is_cut(code_reward: Any) -> None:
    value, reason, elapsed = score(code_reward, "while True:\n    print('x' * 1000)")
    assert value == 0.0 and "File too large" in reason
    assert elapsed < LIMIT_S + SLACK_S


@linux_only
def test_code_stdin_stdout_cases(code_reward: Any) -> None:
    io = {"io": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5", "stdout": "10"}]}
    assert score(code_reward, "print(sum(map(int, input().split())))", io)[0] == 1.0
    value, reason, _ = score(code_reward, "print(3)", io)
    assert value == 0.5 and "case 1: wrong output" in reason
    value, reason, _ = score(code_reward, "print(3)", '{"io": [{"stdin": "", "stdout": "3"}]}')
    assert value == 1.0


def test_code_bad_answer_scores_zero(code_reward: Any) -> None:
    value, reason, _ = score(code_reward, "print(1)", "not a test spec")
    assert value == 0.0 and "needs an answer like" in reason


def test_extract_code() -> None:
    assert extract_code("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```") == "y = 2\n"
    assert extract_code("x = 1") == "x = 1"


# ---------------------------------------------------------------- plugging in


def plugged(inp: RewardInput, bonus: float = 0.0) -> float:
    return float(inp.text == str(inp.answer)) + bonus


def test_import_path_reward_still_works() -> None:
    reward = build_reward(f"{__name__}.plugged", {"bonus": 0.5})
    assert reward(make_input("7", 7)) == 1.5
