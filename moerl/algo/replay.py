"""Routing-replay policies: which experts each token uses in the trainer's forward.

Keep Routing replays the experts the engine chose when it generated a token, so the
trainer's logprob is of the same computation. A replay policy decides, per MoE layer and
per router token, which routes the trainer's router uses. It receives a
:class:`ReplayInput` — the engine's recorded routes, each token's policy version, the
trainer's version, the live router's scores and its own top-k — and returns a
:class:`ReplayOutput` with the routes to use.

Built in (``trainer.replay``):

- ``all``: the recorded routes for every token (Keep Routing);
- ``recent``: the recorded routes for tokens within ``window`` versions of the trainer's
  (``trainer.recent_window``), the router's own choice for older ones;
- ``none``: the plain router (no replay at all; the mismatch checker's baseline).

A researcher's own policy plugs in without editing moerl, e.g. replaying only where the
router's margin is small::

    # mylab/replay.py
    def small_margin(inp: ReplayInput, threshold: float = 0.05) -> ReplayOutput:
        top = inp.scores_TE.topk(inp.recorded_TK.shape[1] + 1, dim=-1).values
        close = (top[:, -2] - top[:, -1]) < threshold        # the k-th vs the (k+1)-th
        routes = torch.where(close[:, None], inp.recorded_TK, inp.fresh_TK)
        return ReplayOutput(routes, metrics={"replayed_frac": close.float().mean().item()})

    trainer.replay={_target_: mylab.replay.small_margin, threshold: 0.02}
"""

# T router tokens (this rank's slice), K top-k, E experts

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from moerl.common.registry import Registry

if TYPE_CHECKING:  # the preflight checks trainer.replay without waiting for torch
    import torch


@dataclasses.dataclass
class ReplayInput:
    """One MoE layer's router tokens of one micro-batch forward."""

    recorded_TK: torch.Tensor
    """The engine's routes (int64 expert ids), in the router's token order."""
    versions_T: torch.Tensor | None
    """The policy version that produced each token (None when the batch has none)."""
    current_version: int
    """The trainer's policy version."""
    scores_TE: torch.Tensor
    """The live router's scores (after its score function)."""
    fresh_TK: torch.Tensor
    """The live router's own top-k choice (what no replay would use)."""
    layer: int
    """The layer's global number (1-based, as megatron-core counts)."""


@dataclasses.dataclass
class ReplayOutput:
    routes_TK: torch.Tensor
    """The expert ids the trainer's router uses, [T, K] int64."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """Numbers of the policy's own (e.g. the fraction of tokens it replayed): each key is
    averaged over the step's calls (layers × micro-batches × ranks) and logged as
    ``replay/<key>`` in metrics.jsonl."""


REPLAY_POLICIES: Registry[ReplayInput, ReplayOutput] = Registry("replay policy", "trainer.replay")


@dataclasses.dataclass
class AllReplayConfig:
    name: str = "all"


@dataclasses.dataclass
class RecentReplayConfig:
    name: str = "recent"
    window: int = 1
    """The largest version gap whose routes are still replayed."""

    def validate(self, prefix: str) -> None:
        if self.window < 0:
            raise ValueError(f"{prefix}.window={self.window} must be >= 0")


@dataclasses.dataclass
class NoReplayConfig:
    name: str = "none"


@REPLAY_POLICIES.register("all", AllReplayConfig)
def replay_all(inp: ReplayInput, cfg: AllReplayConfig) -> ReplayOutput:
    return ReplayOutput(inp.recorded_TK)


@REPLAY_POLICIES.register("recent", RecentReplayConfig)
def replay_recent(inp: ReplayInput, cfg: RecentReplayConfig) -> ReplayOutput:
    if inp.versions_T is None:
        raise ValueError("replay=recent needs per-token versions")
    keep_T = inp.current_version - inp.versions_T.to(inp.recorded_TK.device) <= cfg.window
    return ReplayOutput(inp.recorded_TK.where(keep_T[:, None], inp.fresh_TK))


@REPLAY_POLICIES.register("none", NoReplayConfig)
def replay_none(inp: ReplayInput, cfg: NoReplayConfig) -> ReplayOutput:
    return ReplayOutput(inp.fresh_TK)


ReplayPolicy = Callable[[ReplayInput], ReplayOutput]


def is_none(spec: Any) -> bool:
    """Whether ``spec`` selects no replay at all (the plain router)."""
    return _selects(spec, "none", NoReplayConfig)


def is_all(spec: Any) -> bool:
    """Whether ``spec`` is the built-in that replays every recorded route (no live
    routing needed: the router's own top-k is not computed)."""
    return _selects(spec, "all", AllReplayConfig)


def _selects(spec: Any, name: str, config: type) -> bool:
    """Whether ``spec`` (a name, a mapping or an options dataclass) is built-in ``name``."""
    from moerl.common.registry import _plain

    spec = _plain(spec)
    if isinstance(spec, str):
        return spec == name
    if isinstance(spec, Mapping):
        return spec.get("name") == name and not spec.get("_target_")
    return isinstance(spec, config)


def build_replay_policy(spec: Any, recent_window: int = 1) -> ReplayPolicy:
    """The policy callable for ``trainer.replay``: a name, an options mapping or a
    ``_target_`` mapping. The name ``recent`` takes ``recent_window``
    (``trainer.recent_window``) as its window."""
    if spec == "recent":
        spec = RecentReplayConfig(window=recent_window)
    return REPLAY_POLICIES.build(spec)


def check_replay_spec(spec: Any, recent_window: int = 1) -> None:
    """Validate ``trainer.replay`` at start-up: a known name, a mapping naming a built-in
    with valid options, or an importable ``_target_``."""
    build_replay_policy(spec, recent_window)
