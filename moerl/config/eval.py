"""Options of evaluation on held-out prompts (group `eval`, conf/eval/).

Every `every` steps the rollout side generates on each held-out set through the same
engines, concurrently with training, and logs `eval/<set>/pass@k`, `reward_mean`,
`response_len_mean` and the policy version evaluated (moerl.rollout.evaluation);
`python -m moerl.eval` runs the same sets once on a checkpoint.

A set is a task spec in the task schema (moerl.config.task), written as a mapping with
`name` (or `_target_`): `'+eval.sets.arith={name:arithmetic,seed:7,max_operand:50}'`.
A mapping rather than a group per set because Hydra cannot type a dict whose values are
different task dataclasses; `moerl.validate` checks each spec against its task's options
at start-up. No sets = one set named after the training task, its stream at `eval.seed`.
Torch-free, like the other config modules.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from moerl.common.checks import at_least, non_negative_int, positive_int

SET_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass
class EvalConfig:
    """Held-out evaluation during training (and offline, `python -m moerl.eval`)."""

    every: int = 0
    """Evaluate after every this many steps, and after the last one; 0 = off."""
    sets: dict[str, Any] = field(default_factory=dict)
    """Named held-out prompt sets, each a task spec mapping (`name` plus that task's
    options, or `_target_`): `'+eval.sets.arith={name:arithmetic,seed:7}'`. Empty = one
    set named after the training task: its options with `seed` replaced by eval.seed."""
    seed: int = 1_000_003
    """Prompt-stream seed of the default set (no `sets`); keep it apart from task.seed."""
    num_prompts: int = 32
    """Prompts per set: the first N of its stream (fewer when the set is smaller)."""
    greedy: bool = True
    """One greedy completion per prompt (temperature 0): it gives `pass@1`."""
    n: int = 4
    """Sampled completions per prompt at `temperature` for the unbiased pass@k; 0 = none."""
    temperature: float = 1.0
    """Temperature of the `n` sampled completions (top_p/top_k/min_p are rollout's)."""
    k: list[int] = field(default_factory=lambda: [1, 4])
    """The k of the reported pass@k estimates from the `n` samples (each 1 <= k <= n).
    With greedy, pass@1 is the greedy one and a sampled k=1 is `pass@1_sampled`."""
    threshold: float = 1.0
    """A completion passes when its reward is >= threshold (exact-answer rewards are 0/1)."""
    max_new_tokens: int = 0
    """Most response tokens per eval completion; 0 = rollout.max_new_tokens."""
    max_concurrent: int = 32
    """Eval requests in flight at once, so an eval never floods the engines."""

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def validate(self, key: str = "eval") -> None:
        """Raise ValueError naming `key.field` for an out-of-range option."""
        non_negative_int(f"{key}.every", self.every)
        positive_int(f"{key}.num_prompts", self.num_prompts)
        non_negative_int(f"{key}.n", self.n)
        non_negative_int(f"{key}.max_new_tokens", self.max_new_tokens)
        positive_int(f"{key}.max_concurrent", self.max_concurrent)
        if not self.greedy and self.n == 0:
            raise ValueError(
                f"{key}.greedy=false and {key}.n=0 generate nothing; set greedy=true or n >= 1"
            )
        if self.n:
            at_least(f"{key}.temperature", self.temperature, 0.0, strict=True)
            if not self.k:
                raise ValueError(f"{key}.k is empty; list the k of pass@k, e.g. [1, {self.n}]")
        for k in self.k if self.n else ():  # without samples k is not read
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n:
                raise ValueError(
                    f"{key}.k={list(self.k)}: {k!r} is not in 1..{key}.n={self.n}; pass@k "
                    f"needs at least k samples per prompt, raise {key}.n or drop that k"
                )
        for name, spec in self.sets.items():
            if not SET_NAME.match(str(name)):
                raise ValueError(
                    f"{key}.sets.{name}: a set name must be letters, digits, '_', '.' or "
                    "'-' (it becomes part of the metric name eval/<set>/...)"
                )
            if not hasattr(spec, "get") or not (spec.get("name") or spec.get("_target_")):
                raise ValueError(
                    f"{key}.sets.{name}={spec!r} must be a task spec with 'name' (a task "
                    "of conf/task/) or '_target_', e.g. {name:arithmetic,seed:7}"
                )

    def resolve_sets(self, task: Any) -> dict[str, Any]:
        """The sets to evaluate: `sets`, or the training task `task` (an options
        dataclass) at `seed` under the task's name; a data set's evaluation view (its
        eval split or held-out part, `for_eval`)."""
        if self.sets:
            return {str(name): dict(spec) for name, spec in self.sets.items()}
        for_eval = getattr(task, "for_eval", None)
        if for_eval is not None:
            return {str(task.name): for_eval()}
        if getattr(task, "name", "") == "jsonl":
            raise ValueError(
                "eval without eval.sets evaluates the training task at another seed, but a "
                "jsonl task reads the same file whatever the seed; add a held-out file: "
                "'+eval.sets.heldout={name:jsonl,path:/data/test.jsonl}'"
            )
        name = str(getattr(task, "name", None) or task.get("name", "task"))
        if dataclasses.is_dataclass(task) and not isinstance(task, type):
            return {name: dataclasses.replace(task, seed=self.seed)}
        return {name: {**dict(task), "seed": self.seed}}
