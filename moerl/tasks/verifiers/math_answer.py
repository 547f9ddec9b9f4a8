"""`math`: a final answer checked for mathematical equivalence with math-verify.

What is compared (the completion's last marked answer):

    \\boxed{...}       anywhere in the text: math-verify reads the boxed answer (several
                      boxed answers are read together, as a set)
    answer: ...        else, the text after the last `answer:` (case-insensitive, the
                      `answer_marker` option) up to the end of its line
    the whole text     else; math-verify takes the last LaTeX or plain expression in it

The reference answer (Prompt.answer) is read as LaTeX (wrapped in `$...$` unless it holds
`$` or `\\boxed`), so `1/2`, `0.5`, `\\frac{1}{2}` and `2/4` all match `\\boxed{\\frac12}`,
`x=3` matches `3` and `1,000` matches `1000`.

math-verify bounds its work with signal.alarm, which fails outside the main thread, and
rewards run in the orchestrator's threads. So each check runs in a helper process
(`math_worker.py`, one per concurrently scoring thread, started on first use and reused):
there math-verify's own timeouts work, and a check that ignores them (sympy stuck in C on
`9^{9^{9^{9^9}}}`) is killed when `timeout_s` passes. Either way the reward is 0 and the
reason is in traj.meta["reward_reason"]; the run goes on.

math-verify is optional: `pip install moerl[verify]`.
"""

from __future__ import annotations

import importlib.util
import json
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from moerl.tasks.rewards import REWARDS, RewardInput, note

WORKER = Path(__file__).with_name("math_worker.py")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
STARTUP_TIMEOUT_S = 120.0
"""Longest a helper process may take to import math-verify (sympy) before a first check."""


@dataclass
class MathConfig:
    name: str = "math"
    """Registered name."""
    timeout_s: float = 5.0
    """Longest one check may take; past it the helper process is killed and the reward is
    0 (math-verify's own parse and compare timeouts are half of it, at least 1 s)."""
    format_weight: float = 0.0
    """Share of the reward for a marked answer (a \\boxed{} or the answer marker) whatever
    its value: reward = (1 - w) * correct + w * marked."""
    answer_marker: str = "answer:"
    """Without a \\boxed{}, the text after the last occurrence of this (case-insensitive)
    is the answer; '' = no marker."""
    require_stop: bool = True
    """A completion cut by the length limit scores 0."""
    max_answer_chars: int = 2000
    """A longer extracted answer scores 0 unread (bounds the parser's work)."""

    def validate(self, key: str) -> None:
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(f"{key}.format_weight={self.format_weight} must be in [0, 1]")
        if self.timeout_s <= 0:
            raise ValueError(f"{key}.timeout_s={self.timeout_s} must be > 0")
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError(
                f"{key}: the `math` reward needs math-verify; pip install moerl[verify] "
                "(or pip install math-verify)"
            )


def extract_answer(text: str, marker: str = "answer:") -> tuple[str, bool]:
    """(the span math-verify should read, whether the answer was marked)."""
    if _BOXED.search(text):
        return text, True
    if marker:
        at = text.lower().rfind(marker.lower())
        if at >= 0:
            rest = text[at + len(marker) :].strip()
            return rest.splitlines()[0] if rest else "", True
    return text, False


def gold_latex(answer: object) -> str:
    """The reference answer as math-verify input: LaTeX in math mode."""
    gold = str(answer).strip()
    return gold if "$" in gold or _BOXED.search(gold) else f"${gold}$"


@REWARDS.register("math", MathConfig)
def math_answer(inp: RewardInput, cfg: MathConfig) -> float:
    if cfg.require_stop and not inp.stopped:
        return note(inp, "truncated (require_stop)")
    pred, marked = extract_answer(inp.text, cfg.answer_marker)
    fmt = cfg.format_weight * marked
    if not pred.strip():
        return fmt + note(inp, "no answer found in the completion")
    if len(pred) > cfg.max_answer_chars:
        return fmt + note(inp, f"answer longer than max_answer_chars={cfg.max_answer_chars}")
    ok, reason = WORKERS.check(gold_latex(inp.answer), pred, cfg.timeout_s)
    if not ok:
        return fmt + note(inp, reason)
    return (1.0 - cfg.format_weight) + fmt


class _Worker:
    """One helper process running math_worker.py."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if self._read(STARTUP_TIMEOUT_S) is None:
            self.kill()
            raise RuntimeError(
                f"the math-verify helper ({WORKER}) did not start within {STARTUP_TIMEOUT_S}s; "
                "is math-verify installed? pip install moerl[verify]"
            )

    def check(self, gold: str, pred: str, timeout_s: float) -> tuple[bool, str] | None:
        """(equivalent, reason), or None when timeout_s passed (the process is then dead)."""
        soft = max(1, int(timeout_s / 2))
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"gold": gold, "pred": pred, "timeout": soft}) + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout_s)
        if reply is None:
            self.kill()
            return None
        return bool(reply["ok"]), str(reply["reason"])

    def _read(self, timeout_s: float) -> dict | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class _Workers:
    """Idle helper processes, shared by the threads that score; one more starts when all
    are busy, a killed one is replaced on the next check."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def check(self, gold: str, pred: str, timeout_s: float) -> tuple[bool, str]:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker()
        start = time.monotonic()
        try:
            result = worker.check(gold, pred, timeout_s)
        except (OSError, ValueError) as err:  # the helper died (broken pipe, bad reply)
            worker.kill()
            return False, f"math-verify helper failed: {err}"
        if result is None:
            took = time.monotonic() - start
            return False, f"math-verify exceeded timeout_s={timeout_s:g} ({took:.1f}s); killed"
        with self._lock:
            self._idle.append(worker)
        return result

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


WORKERS = _Workers()
