"""The task contract: a deterministic prompt stream and a reward function.

The orchestrator reads prompts from a cursor (a resumed run continues at the same
prompt), samples G completions each, and scores every completion with the task's
reward, off the critical path: a reward may be a plain function (run in a worker
thread) or a coroutine function (a remote verifier or reward model).
"""

# P prompt tokens

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from moerl.common.trajectory import Trajectory


@dataclass
class Prompt:
    """One prompt of a task."""

    prompt_id: int
    """Position in the task's deterministic order; the data cursor counts these."""
    input_ids: np.ndarray
    """int32 [P]: the prompt's tokens (the tokenizer's own BOS included if it uses one)."""
    answer: Any = None
    """What the reward function checks the completion against."""
    text: str = ""
    """The prompt as text, for logs."""
    meta: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[Prompt, Trajectory], "float | Awaitable[float]"]


@runtime_checkable
class Task(Protocol):
    """What the orchestrator needs from a task."""

    def prompts(self, start: int = 0) -> Iterator[Prompt]:
        """Prompts from position ``start`` on, the same sequence on every call (an
        endless task cycles or keeps generating)."""
        ...

    def reward(self, prompt: Prompt, traj: Trajectory) -> float | Awaitable[float]:
        """The completion's reward (higher is better)."""
        ...
