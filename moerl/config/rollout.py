"""Options of the rollout orchestrator (group `rollout`): group sampling, dynamic filtering,
over-sampling, partial rollouts across weight updates, and fault handling.

Torch-free, like moerl.config.buffer. The semantics behind each option are documented in
moerl/rollout/orchestrator.py.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from moerl.common.checks import at_least, auto_or_bool, one_of

PARTIAL_ROLLOUT_MODES = ("in_place", "abort_resume", "drain")
LENGTH_DISTRIBUTIONS = ("fixed", "lognormal")


@dataclass
class RolloutConfig:
    """How the orchestrator turns prompts into scored groups for the rollout buffer."""

    group_size: int = 8
    """Completions sampled per prompt (G of GRPO); they share advantages' baseline."""
    max_inflight_groups: int = 16
    """Groups generating at once with oversample_factor=1; with over-sampling, the groups
    kept per round (see oversample_factor)."""
    group_request: bool = True
    """Send a group's completions as one /generate with sampling_params.n = group_size
    (SGLang's parallel sampling: one HTTP round trip, one engine, the prompt prefilled once
    there) instead of group_size requests load-balanced one by one. Groups of episodes and
    groups with a drawn length per completion (length_distribution) always go one by one;
    so do the continuations of aborted completions."""
    oversample_factor: float = 1.0
    """>= 1. Prompts are launched in rounds of ceil(oversample_factor * max_inflight_groups)
    groups; once max_inflight_groups groups of a round reached the buffer, the round's other
    groups (stragglers, or groups still scoring) are cancelled and their prompts consumed
    (counted in rollout/groups_cancelled). 1 = never cancel."""
    filter_uniform_groups: bool = False
    """Dynamic filtering (DAPO): drop groups whose rewards are all equal; their advantages
    are zero, so they carry no policy-gradient signal. Counted in rollout/groups_filtered."""

    max_new_tokens: int = 128
    """Most response tokens per completion (SGLang sampling_params.max_new_tokens)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer reproduces the distribution at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = all."""
    min_p: float = 0.0
    """Keep tokens with at least min_p times the top token's probability; 0 = off."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a completion (the model's EOS always does, unless
    ignore_eos)."""
    ignore_eos: bool = False
    """Keep sampling past EOS until max_new_tokens (benchmarks, tests)."""
    length_distribution: str = "fixed"
    """Response lengths, for benchmarks and tests. 'fixed': every completion may run to
    max_new_tokens (it ends at EOS or a stop token first). 'lognormal': each completion
    draws its own length from a log-normal distribution (length_median, length_sigma),
    rounded and clipped to [1, max_new_tokens], and samples exactly that many tokens
    (ignore_eos), whatever the model: a long-tailed workload (p90/median = e^(1.28 sigma)
    before clipping)."""
    length_median: int = 16
    """With length_distribution=lognormal: the median response length in tokens."""
    length_sigma: float = 1.5
    """With length_distribution=lognormal: the standard deviation of log(length); 1.26
    puts p90 at 5x the median, 1.5 at 6.8x."""
    length_seed: int = 0
    """With length_distribution=lognormal: the draw for completion `index` of the prompt
    at stream position `group_id` depends only on (length_seed, group_id, index), so
    runs compare on identical lengths."""
    return_routed_experts: bool = True
    """Record the experts every token was routed to (needed by Keep Routing replay)."""
    return_sampling_mask: bool = True
    """Record the kept token set per position (needed by sampling-mask replay) where the
    sampling truncates it (top_k, top_p, min_p, or greedy at temperature 0: see
    sampling_truncates). Otherwise every token is kept: nothing is asked for, and the
    trainer normalises a trajectory without a mask over the whole vocabulary, which is
    that set (a vocabulary-sized id list per token would otherwise cross the wire)."""

    partial_rollout: str = "in_place"
    """What happens to completions in flight when the trainer pushes new weights:
    'in_place' (they keep going; later tokens carry the new version), 'abort_resume'
    (aborted, then continued from prompt + partial response under the new weights, spliced
    into one trajectory) or 'drain' (no new groups; the update waits for in-flight groups)."""
    in_place_pause: Any = "auto"
    """With partial_rollout=in_place: pause the engines in place (requests and KV caches
    kept) during the push, so no token is sampled from half-loaded weights; SGLang needs it
    to swap weights under running requests. 'auto' (default): pause unless the push is
    atomic, one bucket (as the last push was) to moerl's own engines, which load a bucket
    whole between two decode steps: generation then goes on through the push (no token
    sees half-loaded weights; each carries the version that sampled it). True: always.
    False: engines decode throughout (moerl.engine only; tokens between buckets see a mix
    of old and new tensors)."""

    max_retries: int = 3
    """Times one /generate request is re-sent, on another engine when there is one, after
    a connection error, timeout or HTTP 5xx (EngineClient max_retries)."""
    request_timeout_s: float = 600.0
    """Bound on one /generate attempt (requests wait while engines are paused)."""
    engine_cooldown_s: float = 5.0
    """An engine that failed a request gets no new requests for this long while others are
    up."""
    max_group_attempts: int = 5
    """A group whose request still fails after max_retries is generated again from
    scratch; after this many attempts of the same prompt the orchestrator stops with the
    error."""
    group_retry_backoff_s: float = 1.0
    """Wait before re-generating a failed group, doubled per attempt (at most 30 s)."""
    reward_workers: int = 4
    """Threads running synchronous reward functions (async ones run on the event loop)."""
    reward_inline_us: float = 500.0
    """A synchronous reward function whose calls compute for less than this many
    microseconds (its thread's CPU time) runs on the event loop, without a thread hand-off:
    timed on the pool for the first group (its fastest call decides), then on the loop,
    where a group whose median call computed longer, or more than one call in 50 that
    computed ten times longer or waited (off its CPU for two interpreter switch intervals,
    longer than a wait for the interpreter lock lasts), sends it back to the pool for good
    (moerl/rollout/scoring.py, whose ``INLINE_S`` is this default). 0: always the pool.
    At 100 the tiny recipe's copy_digits reward (a tokenizer decode and a comparison: 40 µs a call
    warm, 80-120 µs in the run, its caches cold after the trainer's step) went to the pool
    in every run, where a group took 4.5-6.5 ms of wall against 0.9 ms on the loop; a pure
    Python reward holds the interpreter lock on the pool as well, so the loop gains little
    from handing off calls this short."""

    def validate(self, key: str = "rollout") -> None:
        """Raise ValueError naming `key.field` for an out-of-range option."""
        ints = ("group_size", "max_inflight_groups", "max_new_tokens", "reward_workers")
        for name in (*ints, "length_median"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{key}.{name}={value!r} must be an integer >= 1")
            at_least(f"{key}.{name}", value, 1)
        at_least(f"{key}.oversample_factor", self.oversample_factor, 1.0)
        at_least(f"{key}.reward_inline_us", self.reward_inline_us, 0.0)
        at_least(f"{key}.temperature", self.temperature, 0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{key}.top_p={self.top_p} must be in (0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"{key}.top_k={self.top_k} must be -1 (off) or >= 1")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"{key}.min_p={self.min_p} must be in [0, 1)")
        one_of(f"{key}.partial_rollout", self.partial_rollout, PARTIAL_ROLLOUT_MODES)
        auto_or_bool(f"{key}.in_place_pause", self.in_place_pause)
        if self.filter_uniform_groups and self.group_size < 2:
            raise ValueError(
                f"{key}.filter_uniform_groups=true with {key}.group_size={self.group_size} "
                "would drop every group (one reward is always uniform); set group_size >= 2 "
                "or turn the filter off"
            )
        one_of(f"{key}.length_distribution", self.length_distribution, LENGTH_DISTRIBUTIONS)
        if self.length_distribution == "lognormal":
            if not 1 <= self.length_median <= self.max_new_tokens:
                raise ValueError(
                    f"{key}.length_median={self.length_median} must be in [1, "
                    f"{key}.max_new_tokens={self.max_new_tokens}]"
                )
            at_least(f"{key}.length_sigma", self.length_sigma, 0.0)
        at_least(f"{key}.max_retries", self.max_retries, 0)
        at_least(f"{key}.max_group_attempts", self.max_group_attempts, 1)
        at_least(f"{key}.request_timeout_s", self.request_timeout_s, 0.0, strict=True)
        at_least(f"{key}.engine_cooldown_s", self.engine_cooldown_s, 0.0)
        at_least(f"{key}.group_retry_backoff_s", self.group_retry_backoff_s, 0.0)

    @property
    def groups_per_round(self) -> int:
        """Groups launched per over-sampling round: ceil(oversample_factor * max_inflight)."""
        # the epsilon keeps 1.1 * 10 at 11 despite floating point
        return max(
            self.max_inflight_groups,
            math.ceil(self.oversample_factor * self.max_inflight_groups - 1e-9),
        )

    def completion_length(self, group_id: int, index: int) -> int | None:
        """The response length drawn for completion `index` of group `group_id` under
        length_distribution, or None when it is 'fixed' (EOS or max_new_tokens ends it)."""
        if self.length_distribution == "fixed":
            return None
        rng = random.Random(f"{self.length_seed}-{group_id}-{index}")
        draw = rng.lognormvariate(math.log(self.length_median), self.length_sigma)
        return min(max(round(draw), 1), self.max_new_tokens)

    def sampling_truncates(self) -> bool:
        """Whether sampling keeps fewer tokens than the vocabulary: top_k, top_p < 1,
        min_p > 0, or temperature 0 (only the argmax)."""
        return self.temperature == 0 or self.top_k >= 1 or self.top_p < 1.0 or self.min_p > 0

    def records_sampling_mask(self) -> bool:
        """Whether completions ask the engines for their kept sets (return_sampling_mask
        where the sampling truncates them)."""
        return self.return_sampling_mask and self.sampling_truncates()

    def sampling_params(self) -> dict[str, Any]:
        """SGLang sampling_params for one completion."""
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.ignore_eos:
            params["ignore_eos"] = True
        return params
