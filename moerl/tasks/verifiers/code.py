"""`code`: the completion's Python program, run against the task's tests in a sandbox.

The program is the last fenced block (```python ... ``` or a bare ```) of the
completion, else the whole text. The answer (Prompt.answer, a dict or its JSON text) holds
the tests, in one of two forms:

    {"tests": ["assert f(2) == 4", ...]}      statements run after the program, in its
                                              namespace, in one process (a failed or
                                              raising statement fails that test)
    {"io": [{"stdin": "1 2\\n", "stdout": "3\\n"}, ...]}
                                              the program run once per case as a script;
                                              passes when its stdout equals the expected
                                              one up to surrounding whitespace and
                                              trailing spaces on each line

reward = passed / total (all_or_nothing: 1 only when every test passes). Every run is a
subprocess with limits (sandbox.py says what is and is not guaranteed); a crash, timeout,
memory or output blow-up fails the tests it stops and never raises: the reason is in
traj.meta["reward_reason"] (e.g. "2/3 passed; test 1: AssertionError").
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from typing import Any

from moerl.tasks.rewards import REWARDS, RewardInput, note
from moerl.tasks.verifiers.sandbox import Limits, RunResult, run_python

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)


@dataclass
class CodeConfig:
    name: str = "code"
    """Registered name."""
    timeout_s: float = 10.0
    """Wall time of one sandboxed run (all `tests`, or one `io` case); killed past it."""
    memory_mb: int = 1024
    """Address space of a run (RLIMIT_AS), MiB."""
    output_bytes: int = 1_000_000
    """Largest stdout (or file) a run may write."""
    isolate_network: bool = True
    """Also run in a fresh network namespace where the system allows it."""
    all_or_nothing: bool = False
    """1 only when every test passes, else 0 (default: the fraction passed)."""
    require_stop: bool = True
    """A completion cut by the length limit scores 0."""

    def validate(self, key: str) -> None:
        if self.timeout_s <= 0 or self.memory_mb <= 0 or self.output_bytes <= 0:
            raise ValueError(f"{key}: timeout_s, memory_mb and output_bytes must be > 0")

    def limits(self) -> Limits:
        return Limits(
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            output_bytes=self.output_bytes,
            isolate_network=self.isolate_network,
        )


def extract_code(text: str) -> str:
    """The last fenced block's body, else the whole text."""
    blocks = _FENCE.findall(text)
    return blocks[-1][1] if blocks else text


@REWARDS.register("code", CodeConfig)
def code(inp: RewardInput, cfg: CodeConfig) -> float:
    if cfg.require_stop and not inp.stopped:
        return note(inp, "truncated (require_stop)")
    try:
        spec = _spec(inp.answer)
    except ValueError as err:  # one bad record scores 0 rather than ending the run
        return note(inp, str(err))
    program = extract_code(inp.text)
    if "tests" in spec:
        passed, total, why = _run_tests(program, list(spec["tests"]), cfg.limits())
    else:
        passed, total, why = _run_io(program, list(spec["io"]), cfg.limits())
    if passed < total:
        note(inp, f"{passed}/{total} passed; {why}")
    if cfg.all_or_nothing:
        return float(passed == total)
    return passed / total


def _spec(answer: Any) -> dict[str, Any]:
    """The answer's test spec; ValueError for anything else."""
    try:
        spec = json.loads(answer) if isinstance(answer, str) else answer
    except json.JSONDecodeError:
        spec = None
    if isinstance(spec, dict) and (spec.get("tests") or spec.get("io")):
        return spec
    raise ValueError(
        f"the code reward needs an answer like {{'tests': ['assert f(2) == 4']}} or "
        f"{{'io': [{{'stdin': '1', 'stdout': '2'}}]}}, got {str(answer)[:100]!r}"
    )


def _run_tests(program: str, tests: list[str], limits: Limits) -> tuple[int, int, str]:
    run = run_python(program, limits, tests=tests)
    total = len(tests)
    if run.results and "load_error" in run.results[0]:
        return 0, total, f"the program failed to load: {run.results[0]['load_error']}"
    passed = sum(bool(r.get("ok")) for r in run.results)
    failed = next((i for i, r in enumerate(run.results) if not r.get("ok")), None)
    if failed is not None:
        why = f"test {failed}: {run.results[failed].get('error', '')}"
    else:
        why = _stopped(run, f"after test {len(run.results) - 1}" if run.results else "")
    return passed, total, why


def _run_io(program: str, cases: list[dict[str, str]], limits: Limits) -> tuple[int, int, str]:
    passed, why = 0, ""
    for i, case in enumerate(cases):
        run = run_python(program, limits, stdin=case.get("stdin", ""))
        if run.timed_out or run.returncode != 0:
            why = why or f"case {i}: " + _stopped(run, "")
        elif _lines(run.stdout) == _lines(case["stdout"]):
            passed += 1
        else:
            why = why or f"case {i}: wrong output {run.stdout[:80]!r}"
    return passed, len(cases), why


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _stopped(run: RunResult, where: str) -> str:
    """Why a run ended without finishing its tests."""
    at = f" {where}" if where else ""
    if run.timed_out:
        return f"killed at the time limit ({run.elapsed_s:.1f}s){at}"
    if run.returncode == -signal.SIGXCPU:  # RLIMIT_CPU: the CPU-time side of the time limit
        return f"killed at the time limit (CPU time, {run.elapsed_s:.1f}s wall){at}"
    if run.returncode is not None and run.returncode < 0:
        return f"killed by signal {-run.returncode}{at} (CPU or memory limit)"
    tail = run.stderr_tail.strip().splitlines()
    return f"exit {run.returncode}{at}: {tail[-1] if tail else 'no output'}"
