"""`format_length`: credit for the shape of a completion, not its correctness.

    reward = format * length

format is 1 when the text matches `pattern` (re.search, DOTALL; '' = always), else 0.
length is 1 up to `target_length` and falls linearly to 0 at `target_length +
overlong_window` (DAPO's soft overlong penalty); `target_length=0` turns it off. Length
counts response tokens (`unit=tokens`, the trajectory's response, stop token included) or
characters of the decoded text (`unit=chars`). Mix it into a correctness reward with your
own function, or use it alone to teach a format first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moerl.tasks.rewards import REWARDS, RewardInput, note


@dataclass
class FormatLengthConfig:
    name: str = "format_length"
    """Registered name."""
    pattern: str = r"(?i)answer:\s*\S"
    """Regex the text must contain (re.search with DOTALL), e.g. `\\boxed\\{` for a boxed answer;
    '' = no format requirement."""
    target_length: int = 0
    """Length with no penalty; 0 = no length penalty."""
    overlong_window: int = 0
    """The reward falls linearly from 1 at target_length to 0 at target_length +
    overlong_window; 0 = a hard cut (0 past target_length)."""
    unit: str = "tokens"
    """What length counts: 'tokens' (response tokens) or 'chars' (decoded text)."""
    require_stop: bool = True
    """A completion cut by the length limit scores 0."""

    def validate(self, key: str) -> None:
        if self.unit not in ("tokens", "chars"):
            raise ValueError(f"{key}.unit={self.unit!r}; choose 'tokens' or 'chars'")
        if self.target_length < 0 or self.overlong_window < 0:
            raise ValueError(f"{key}: target_length and overlong_window must be >= 0")
        try:
            re.compile(self.pattern)
        except re.error as err:
            raise ValueError(f"{key}.pattern={self.pattern!r} is not a regex: {err}") from err


@REWARDS.register("format_length", FormatLengthConfig)
def format_length(inp: RewardInput, cfg: FormatLengthConfig) -> float:
    if cfg.require_stop and not inp.stopped:
        return note(inp, "truncated (require_stop)")
    if cfg.pattern and re.search(cfg.pattern, inp.text, re.DOTALL) is None:
        return note(inp, f"pattern {cfg.pattern!r} not found")
    if cfg.target_length == 0:
        return 1.0
    n = len(inp.traj.response_ids) if cfg.unit == "tokens" else len(inp.text)
    return length_factor(n, cfg.target_length, cfg.overlong_window)


def length_factor(n: int, target: int, window: int) -> float:
    """1 up to target, linear to 0 at target + window (a step at target when window=0)."""
    over = n - target
    if over <= 0:
        return 1.0
    if window == 0:
        return 0.0
    return max(0.0, 1.0 - over / window)
