"""Reward functions on decoded completions, and the decoding they share.

A reward function takes a `RewardInput` (the completion decoded up to its stop token, the
reference answer, whether the completion stopped on its own) and returns a float. Built-ins
register with an options dataclass, `fn(inp, cfg) -> float`; a function outside moerl is
`fn(inp, **options) -> float` given by import path. All built-ins are sync and cheap; an
async function (a remote verifier) may be given instead, the orchestrator awaits it.

    exact    1 if the text equals the answer (and the completion stopped), else 0
    prefix   partial credit: the fraction of answer characters matched position by
             position, 0 unless stopped (option require_stop)
    numeric  1 if the first number in the text is within tol of the answer
    shaped   dense credit for tiny models: format (characters from a charset) +
             per-position match + stopping at the right length; 1 only for the exact answer

The verifiers (`moerl/tasks/verifiers/`) register three more: `math` (math-verify
equivalence), `format_length` (a required pattern and a length budget) and `code` (tests
run in a sandboxed subprocess). A reward that gives 0 because its check failed (a timeout,
a crash, no answer found) says why with `note(inp, reason)`: the reason lands in
`traj.meta["reward_reason"]` (kept with the trajectory) and in a debug log line.

Decoding (`decode_response`) cuts the response at the first EOS, and marks every token it
cannot show as text (a special token, or an id the model has but the tokenizer lacks; tiny
models have vocab_size 128 over a 52-token tokenizer) with U+FFFD, so a sampled <pad> still
takes a position instead of silently vanishing.
"""

# R response tokens

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from moerl.common.registry import Registry
from moerl.common.trajectory import Trajectory
from moerl.tasks.base import Prompt

log = logging.getLogger(__name__)

PLACEHOLDER = "\ufffd"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class RewardInput:
    """What a reward function sees of one completion."""

    text: str
    """The response decoded up to (not including) its stop token; unshowable tokens are
    U+FFFD."""
    answer: Any
    """The prompt's reference answer (Prompt.answer)."""
    stopped: bool
    """The completion ended on EOS / a stop token (not truncated by length, not aborted)."""
    prompt: Prompt
    """The prompt, for rewards that need more than the answer."""
    traj: Trajectory
    """The raw trajectory (token ids, finish_reason, meta)."""


def note(inp: RewardInput, reason: str) -> float:
    """Record why a completion scored 0 (traj.meta["reward_reason"], a debug log); returns
    0.0 so a verifier can `return note(inp, "timeout after 5s")`."""
    inp.traj.meta["reward_reason"] = reason
    log.debug("reward 0 for prompt %s: %s", inp.prompt.prompt_id, reason)
    return 0.0


def decode_response(tokenizer: Any, traj: Trajectory) -> tuple[str, bool]:
    """(text before the stop token, stopped) of a trajectory's response."""
    ids_R = traj.response_ids
    eos = tokenizer.eos_token_id
    hits = np.flatnonzero(ids_R == eos) if eos is not None else np.empty(0, np.int64)
    cut = int(hits[0]) if hits.size else None
    special = set(tokenizer.all_special_ids)
    if cut is None and traj.finish_reason == "stop" and ids_R.size and int(ids_R[-1]) in special:
        cut = ids_R.size - 1  # a stop token other than EOS matched
    stopped = cut is not None or traj.finish_reason == "stop"
    body = ids_R[:cut] if cut is not None else ids_R
    return decode_marked(tokenizer, body, special), stopped


def decode_marked(tokenizer: Any, ids: np.ndarray, special: set[int] | None = None) -> str:
    """Decode ids; each special or out-of-vocabulary id becomes one U+FFFD."""
    if special is None:
        special = set(tokenizer.all_special_ids)
    vocab = len(tokenizer)
    parts: list[str] = []
    run: list[int] = []
    for tok in ids.tolist():
        if tok in special or not 0 <= tok < vocab:
            if run:
                parts.append(tokenizer.decode(run, skip_special_tokens=True))
                run = []
            parts.append(PLACEHOLDER)
        else:
            run.append(tok)
    if run:
        parts.append(tokenizer.decode(run, skip_special_tokens=True))
    return "".join(parts)


REWARDS: Registry[RewardInput, float] = Registry(
    "reward function", "task.reward", options_key="task.reward_options"
)


@dataclass
class ExactConfig:
    name: str = "exact"
    """Registered name."""
    strip: bool = True
    """Compare after stripping surrounding whitespace."""
    require_stop: bool = True
    """A completion cut by the length limit scores 0 even if its text matches."""


@REWARDS.register("exact", ExactConfig)
def exact(inp: RewardInput, cfg: ExactConfig) -> float:
    if cfg.require_stop and not inp.stopped:
        return 0.0
    text, answer = inp.text, str(inp.answer)
    if cfg.strip:
        text, answer = text.strip(), answer.strip()
    return float(text == answer)


@dataclass
class PrefixConfig:
    name: str = "prefix"
    """Registered name."""
    require_stop: bool = True
    """Truncated completions score 0."""
    exact_bonus: float = 0.0
    """Added (then the sum divided by 1 + exact_bonus) when the text is exactly the answer."""


@REWARDS.register("prefix", PrefixConfig)
def prefix(inp: RewardInput, cfg: PrefixConfig) -> float:
    """Matched positions / max(len(answer), len(text)): extra characters cost credit."""
    if cfg.require_stop and not inp.stopped:
        return 0.0
    text, answer = inp.text.strip(), str(inp.answer).strip()
    denom = max(len(answer), len(text), 1)
    score = sum(a == b for a, b in zip(text, answer, strict=False)) / denom
    return (score + cfg.exact_bonus * (text == answer)) / (1.0 + cfg.exact_bonus)


@dataclass
class NumericConfig:
    name: str = "numeric"
    """Registered name."""
    tol: float = 1e-6
    """Largest accepted |parsed - answer|."""
    require_stop: bool = True
    """Truncated completions score 0."""


@REWARDS.register("numeric", NumericConfig)
def numeric(inp: RewardInput, cfg: NumericConfig) -> float:
    if cfg.require_stop and not inp.stopped:
        return 0.0
    found = _NUMBER.search(inp.text)
    if found is None:
        return 0.0
    try:
        target = float(inp.answer)
    except (TypeError, ValueError):
        return 0.0
    value = float(found.group())
    return float(math.isfinite(value) and abs(value - target) <= cfg.tol)


@dataclass
class ShapedConfig:
    name: str = "shaped"
    """Registered name."""
    format_weight: float = 0.25
    """Weight of the share of answer positions holding a charset character."""
    match_weight: float = 0.5
    """Weight of the share of answer positions holding the right character."""
    stop_weight: float = 0.25
    """Weight of stopping: min(n, m) / max(n, m) when stopped (1 at the right length)."""
    charset: str = "0123456789-"
    """Characters that earn format credit."""

    def validate(self, key: str) -> None:
        weights = (self.format_weight, self.match_weight, self.stop_weight)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(
                f"{key}: the shaped reward's weights must be >= 0 with a positive sum, "
                f"got format={weights[0]}, match={weights[1]}, stop={weights[2]}"
            )


@REWARDS.register("shaped", ShapedConfig)
def shaped(inp: RewardInput, cfg: ShapedConfig) -> float:
    """Weighted mean of format, match and stop credit, each in [0, 1].

    With answer a (n chars) and text s (m chars), D = max(n, m): format = #{i < min(n, m):
    s[i] in charset} / D, match = #{i < min(n, m): s[i] == a[i]} / D, stop = min(n, m) / D
    if stopped else 0. Dividing by D makes rambling past the answer cost credit.
    """
    return shaped_score(inp.text, str(inp.answer), inp.stopped, cfg)


def shaped_score(s: str, a: str, stopped: bool, cfg: ShapedConfig) -> float:
    """The `shaped` reward of text `s` against answer `a` (for callers without a
    trajectory, e.g. an environment scoring one turn)."""
    n, m = len(a), len(s)
    d = max(n, m, 1)
    k = min(n, m)
    fmt = sum(c in cfg.charset for c in s[:k]) / d
    match = sum(x == y for x, y in zip(s[:k], a[:k], strict=True)) / d
    stop = k / d if stopped else 0.0
    total = cfg.format_weight + cfg.match_weight + cfg.stop_weight
    return (cfg.format_weight * fmt + cfg.match_weight * match + cfg.stop_weight * stop) / total


def build_reward(name: str, options: dict[str, Any] | None = None) -> Any:
    """`inp -> float` for a built-in name or an import path (a name with a dot)."""
    options = dict(options or {})
    if "." in name:
        return REWARDS.build({"_target_": name, "options": options})
    if name not in REWARDS:
        return REWARDS.entry(name)  # raises, listing the known names
    return REWARDS.build({"name": name, **options})


def reward_names() -> list[str]:
    return REWARDS.names()
