"""Supervised warm start: correct completions of a task's prompts, for a few SFT steps
before RL when a policy starts too far from any reward (a recipe's choice)."""

# P prompt tokens, R target tokens

from __future__ import annotations

from itertools import islice

import numpy as np

from moerl.tasks.base import Task
from moerl.tasks.indexed import encode_target


def warm_start_examples(task: Task, n: int, start: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt_ids int32 [P], target_ids int32 [R]) for the prompts at positions
    start .. start + n - 1; each target is the task's reference completion, EOS last.

    The task must expose `tokenizer` and `reference(prompt) -> str` (every built-in does).
    Train on the target tokens only; the prompt tokens are context.
    """
    if n < 0:
        raise ValueError(f"warm_start_examples: n={n} must be >= 0")
    reference = getattr(task, "reference", None)
    tokenizer = getattr(task, "tokenizer", None)
    if reference is None or tokenizer is None:
        raise TypeError(
            f"{type(task).__name__} cannot give warm-start examples: it needs a `tokenizer` "
            "attribute and a `reference(prompt) -> str` method"
        )
    return [
        (p.input_ids, encode_target(tokenizer, reference(p)))
        for p in islice(task.prompts(start), n)
    ]
