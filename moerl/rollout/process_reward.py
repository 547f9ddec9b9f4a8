"""Process rewards: a response cut into steps, a score per step, steps as segments.

# R response tokens, S steps of a response

A process reward model (PRM) scores every reasoning step, not only the answer. moerl
represents the steps of a single completion as Trajectory ``segments`` (source 'policy',
``turn`` = step index, ``reward`` = the step's reward), so ``algo.credit=turn``
(moerl.algo.credit) trains each step's tokens with its own advantage and the usual
estimators (grpo, rloo, ...) baseline them per group, exactly as for episode turns.

The estimator (as PRIME and Math-Shepherd): step k's reward is r_k = weight * score_k,
and the task's outcome reward is added to the last step's. Step k's tokens are trained
with the estimator applied to the step-level return

    G_k = sum over j >= k of discount^(j-k) r_j        (discount = algo.turn_discount)

so the final step carries the outcome and every earlier step the outcome plus the scores
of the steps from it on. The trajectory's ``reward`` is the undiscounted total (outcome +
every r_k), what ``algo.credit=outcome`` trains with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from moerl.common.trajectory import Segment, Trajectory

StepParser = Callable[[list[str]], list[int]]
"""token texts of a response -> each step's end position (exclusive, increasing, last = R)."""


def delimiter_parser(delimiter: str) -> StepParser:
    """A step ends after every token whose text holds ``delimiter`` (and at the end)."""

    def parse(texts: list[str]) -> list[int]:
        ends = [i + 1 for i, t in enumerate(texts) if delimiter in t]
        if not ends or ends[-1] != len(texts):
            ends.append(len(texts))
        return ends

    return parse


def build_step_parser(delimiter: str, target: str = "") -> StepParser:
    """``target`` (an import path) when set, else the delimiter parser."""
    if not target:
        return delimiter_parser(delimiter)
    from hydra.utils import get_method

    from moerl.common.imports import quiet_hydra_utils

    try:
        with quiet_hydra_utils():
            return get_method(target)  # type: ignore[no-any-return]
    except Exception as err:  # hydra wraps import errors in its own types
        reason = " ".join(str(err).split())
        raise ValueError(
            f"reward_model.step_parser={target!r} could not be imported as a function: {reason}"
        ) from err


def check_ends(ends: Sequence[int], length: int) -> list[int]:
    """The parser's ends as ints; ValueError unless increasing, positive and ending at R."""
    out = [int(e) for e in ends]
    if length == 0:
        return []
    if not out or out[-1] != length or any(b <= a for a, b in zip([0, *out], out)):
        raise ValueError(
            f"step ends {out} must increase from above 0 to the response length {length}"
        )
    return out


def prm_input(
    prompt_ids: np.ndarray, response_ids: np.ndarray, ends: Sequence[int], tag_id: int
) -> tuple[list[int], list[int]]:
    """The PRM's input, prompt + step 1 + tag + step 2 + tag ..., and the positions of the
    tags (whose input logprobs are the steps' scores)."""
    ids = [int(t) for t in prompt_ids]
    tags: list[int] = []
    start = 0
    for end in ends:
        ids.extend(int(t) for t in response_ids[start:end])
        tags.append(len(ids))
        ids.append(int(tag_id))
        start = end
    return ids, tags


def apply_step_rewards(
    traj: Trajectory, ends: Sequence[int], scores: Sequence[float], weight: float
) -> None:
    """Steps become the trajectory's segments with r_k = weight * score_k, the outcome
    (``traj.reward``, the task's reward) added to the last; ``traj.reward`` becomes the
    total. A trajectory that already has segments (an episode) is left as it is."""
    assert len(ends) == len(scores), (ends, scores)
    if traj.segments or not ends:
        return
    outcome = float(traj.reward or 0.0)
    step_rewards = [weight * float(s) for s in scores]
    step_rewards[-1] += outcome
    traj.segments = [
        Segment(start, end, "policy", k, r)
        for k, (start, end, r) in enumerate(zip([0, *ends[:-1]], ends, step_rewards))
    ]
    traj.reward = float(sum(step_rewards))
