"""Synthetic verifiable tasks, generated deterministically from a seed (nothing downloads).

Every prompt uses only characters of the built-in tiny tokenizer (digits, `+-*/=()., :?`,
a-z), so they run on tiny models and on any real checkpoint alike.

arithmetic   `12+7=` -> `19`. Integer expressions with the usual precedence (`*` before
             `+`/`-`). Default reward `exact`: 1 for exactly the answer followed by EOS,
             0 otherwise (truncated completions score 0). Partial credit: `prefix`
             (matched characters / the longer length) or `shaped` (see below); `numeric`
             accepts any text whose first number is the answer.

copy_digits  `372=` -> `372`. Built for a TINY RANDOM-INIT model to learn with RL on CPU
             within a few dozen steps. An exact-answer reward is hopeless from random init
             (the tiny models sample from 128 ids, so even a 1-digit answer plus EOS is hit
             with probability ~1/128^2), and GRPO learns nothing from a group whose rewards
             are all equal. The default `shaped` reward therefore gives dense, graded credit
             with three rungs a policy climbs in order of difficulty:

               format  (w 0.25)  answer positions holding a digit: a unigram preference,
                                 learnt in a handful of steps; random sampling already
                                 hits a digit with p = 10/128 per position
               stop    (w 0.25)  stopping (EOS) after as many characters as the answer
               match   (w 0.50)  the right digit at each position: copying from the
                                 prompt, which needs attention

             each divided by max(len(answer), len(text)) so rambling on costs credit. Only
             the exact answer followed by EOS scores 1. Under uniform random sampling the
             mean reward is small but positive and most groups of 16 hold different values,
             so GRPO has a signal from step 0 (tests/unit/test_tasks.py measures it).
"""

from __future__ import annotations

from typing import Any

from moerl.config.task import ArithmeticTaskConfig, CopyDigitsTaskConfig
from moerl.tasks.indexed import IndexedTask


def evaluate(operands: list[int], ops: list[str]) -> int:
    """The value of operands[0] ops[0] operands[1] ... with `*` binding tighter."""
    terms = [operands[0]]
    signs: list[str] = []
    for op, value in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= value
        else:
            signs.append(op)
            terms.append(value)
    total = terms[0]
    for sign, term in zip(signs, terms[1:], strict=True):
        total = total + term if sign == "+" else total - term
    return total


class ArithmeticTask(IndexedTask):
    """`a op b (op c ...)=`; the answer is the integer value as text."""

    def __init__(self, tokenizer: Any, cfg: ArithmeticTaskConfig) -> None:
        cfg.validate("task")
        super().__init__(tokenizer, **self.configured(cfg))
        self.cfg = cfg

    def item(self, index: int) -> tuple[str, str]:
        cfg = self.cfg
        rng = self.rng(index)
        operands = [
            int(v) for v in rng.integers(cfg.min_operand, cfg.max_operand + 1, cfg.num_operands)
        ]
        ops = [cfg.ops[int(i)] for i in rng.integers(0, len(cfg.ops), cfg.num_operands - 1)]
        text = "".join(f"{v}{op}" for v, op in zip(operands, [*ops, "="], strict=True))
        return text, str(evaluate(operands, ops))


class CopyDigitsTask(IndexedTask):
    """`372=` -> `372`: echo a random digit string of min_digits..max_digits digits."""

    default_reward = "shaped"

    def __init__(self, tokenizer: Any, cfg: CopyDigitsTaskConfig) -> None:
        cfg.validate("task")
        super().__init__(tokenizer, **self.configured(cfg))
        self.cfg = cfg

    def item(self, index: int) -> tuple[str, str]:
        rng = self.rng(index)
        n = int(rng.integers(self.cfg.min_digits, self.cfg.max_digits + 1))
        digits = "".join(str(int(d)) for d in rng.integers(0, 10, n))
        return f"{digits}=", digits
