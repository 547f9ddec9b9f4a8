"""Staleness and sampling policies of the rollout buffer, behind registries
(docs/architecture.md, "Staleness and buffer sampling" and "Extension points").

# Q groups queued in the buffer

A staleness policy decides which queued groups the trainer may still consume at its current
version; a sampling policy orders the survivors. Both see only per-group numbers (never the
trajectories), so a policy is a few lines of numpy. Options live in moerl.config.buffer;
user code plugs in with `staleness._target_=...` or `buffer.sampling._target_=...`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from moerl.common.registry import Registry
from moerl.config.buffer import (
    CorrectStaleConfig,
    DepthConfig,
    DropStaleConfig,
    FifoConfig,
    FreshestConfig,
    StalenessConfig,
)


@dataclass
class StalenessInput:
    """How stale each queued group would be if the trainer took it now."""

    staleness_Q: np.ndarray
    """int64 [Q]: current_version − the oldest token version of each group."""
    current_version: int
    """The trainer's policy version."""


@dataclass
class StalenessOutput:
    """Which queued groups stay; the others are dropped and counted under `reason`."""

    keep_Q: np.ndarray
    """bool [Q]: True = the group may be consumed now."""
    reason: str = "stale"
    """Drop reason reported as `buffer/dropped/<reason>`."""


@dataclass
class SamplingInput:
    """The groups the trainer may take, in no particular order."""

    min_versions_Q: np.ndarray
    """int64 [Q]: the oldest token version of each group."""
    arrival_Q: np.ndarray
    """int64 [Q]: arrival number of each group (larger = put later); unique."""
    current_version: int
    """The trainer's policy version."""


@dataclass
class SamplingOutput:
    """The order in which the buffer hands groups to the trainer."""

    order_Q: np.ndarray
    """int64 [Q] (or a prefix of it): indices into the input, first taken first; unique."""


STALENESS_POLICIES: Registry[StalenessInput, StalenessOutput] = Registry(
    "staleness policy", "staleness"
)
SAMPLING_POLICIES: Registry[SamplingInput, SamplingOutput] = Registry(
    "sampling policy", "buffer.sampling"
)


def build_staleness(spec: Any) -> Callable[[StalenessInput], StalenessOutput]:
    """Config (name, options dataclass, mapping or `_target_`) → `fn(StalenessInput)`."""
    return STALENESS_POLICIES.build(spec)


def build_sampling(spec: Any) -> Callable[[SamplingInput], SamplingOutput]:
    """Config (name, options dataclass, mapping or `_target_`) → `fn(SamplingInput)`."""
    return SAMPLING_POLICIES.build(spec)


def _drop_above(inp: StalenessInput, cfg: StalenessConfig) -> StalenessOutput:
    return StalenessOutput(keep_Q=inp.staleness_Q <= cfg.max_staleness, reason="stale")


@STALENESS_POLICIES.register("drop", DropStaleConfig)
def drop(inp: StalenessInput, cfg: DropStaleConfig) -> StalenessOutput:
    """Keep groups with staleness <= max_staleness; drop the rest."""
    return _drop_above(inp, cfg)


@STALENESS_POLICIES.register("depth", DepthConfig)
def depth(inp: StalenessInput, cfg: DepthConfig) -> StalenessOutput:
    """As drop; the buffer also throttles generation (DepthConfig.throttle), so drops only
    catch what the throttle could not prevent (weight sync lag, long partial rollouts)."""
    return _drop_above(inp, cfg)


@STALENESS_POLICIES.register("correct", CorrectStaleConfig)
def correct(inp: StalenessInput, cfg: CorrectStaleConfig) -> StalenessOutput:
    """Keep everything: staleness is the IS correction's business."""
    return StalenessOutput(keep_Q=np.ones(inp.staleness_Q.shape, dtype=bool))


@SAMPLING_POLICIES.register("fifo", FifoConfig)
def fifo(inp: SamplingInput, cfg: FifoConfig) -> SamplingOutput:
    """Oldest arrival first."""
    return SamplingOutput(order_Q=np.argsort(inp.arrival_Q, kind="stable"))


@SAMPLING_POLICIES.register("freshest", FreshestConfig)
def freshest(inp: SamplingInput, cfg: FreshestConfig) -> SamplingOutput:
    """Highest oldest-token version first; ties in arrival order."""
    # lexsort sorts by the last key first.
    return SamplingOutput(order_Q=np.lexsort((inp.arrival_Q, -inp.min_versions_Q)))
