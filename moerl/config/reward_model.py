"""A reward model served over HTTP, scoring completions next to the task's reward
(group `reward_model`, conf/reward_model/; moerl.rollout.reward_model).

Two kinds:

- ``prm`` (process reward model, scoring by logprobs): the response is cut into steps
  (``step_delimiter`` or a ``step_parser``); the RM reads prompt + step 1 + tag + step 2 +
  tag ... in one /generate request with ``return_logprob`` and ``logprob_start_len=0`` and
  a step's score is P(tag | everything before it) from ``input_token_logprobs`` (Math-
  Shepherd's "+" after each step). The RM reads the policy's token ids: it must share the
  policy's tokenizer.
- ``judge`` (generative): ``judge_template`` filled with the prompt and response text is
  sent to /generate; the first number ``judge_pattern`` finds in the answer is the score.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REWARD_MODEL_KINDS = ("prm", "judge")


@dataclass
class RewardModelConfig:
    """Where the reward model runs, how it is called and how its scores become rewards."""

    enabled: bool = False
    """Score every completion with the reward model as well as the task's reward."""
    kind: str = "prm"
    """'prm': per-step scores from logprobs (process rewards); 'judge': one score parsed
    from generated text."""
    path: str = ""
    """Local HF checkpoint of the RM for embedded engines; '' = a random tiny model built
    from `model` (meaningless scores, real plumbing), written to the run directory."""
    urls: list[str] = field(default_factory=list)
    """Base URLs of running RM servers (SGLang or moerl.engine); empty = moerl starts
    `num_engines` embedded engines. RM engines never receive weight updates."""
    num_engines: int = 1
    """Embedded RM engines to start when `urls` is empty."""
    threads: int = 1
    """CPU threads of each embedded RM engine."""

    timeout_s: float = 60.0
    """Seconds one batched RM request may take before it counts as failed."""
    max_retries: int = 3
    """Times a failed or timed-out RM request is sent again (exponential backoff) before
    its groups fail; a failed group goes through rollout's fault policy (generated again,
    up to rollout.max_group_attempts, then the run stops with the RM's error)."""
    retry_backoff_s: float = 0.5
    """First retry's delay; doubles on each retry (capped at 30 s)."""
    batch_size: int = 32
    """Completions sent to the RM in one /generate request."""
    linger_s: float = 0.02
    """How long a partial batch waits for more completions before it is sent."""
    max_concurrency: int = 4
    """RM requests in flight at once (over all RM servers)."""

    weight: float = 1.0
    """Multiplies the RM's scores before they are added to the task's reward."""
    step_delimiter: str = "\n\n"
    """prm: a step ends after each response token whose text holds this string (the
    tiny vocabulary has no newline: use e.g. ',' or '.'); a response with none is one step."""
    step_parser: str = ""
    """prm: import path of ``fn(token_texts: list[str]) -> list[int]`` returning each
    step's end position (exclusive, increasing, last = len); overrides step_delimiter."""
    step_tag: str = "+"
    """prm: the token appended after every step; its probability is the step's score."""
    judge_template: str = "question: {prompt} answer: {response} score:"
    """judge: the RM's prompt; {prompt} and {response} are the texts."""
    judge_pattern: str = r"-?\d+(?:\.\d+)?"
    """judge: regex whose first match in the RM's answer is the score (none: 0)."""
    judge_max_new_tokens: int = 8
    """judge: tokens the RM may generate."""
