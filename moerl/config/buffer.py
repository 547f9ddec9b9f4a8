"""Options of the rollout buffer: its size and sampling order (group `buffer`) and the
staleness policy (group `staleness`). Torch-free, like moerl.algo.config.

Staleness of a group = the trainer's version when it consumes the group − the oldest policy
version among the group's tokens. The policies (registered in moerl.rollout.buffer_policies):

    drop      groups with staleness > max_staleness are dropped when the trainer asks
    depth     drop, plus backpressure: generation waits instead of running more than
              max_staleness versions ahead of the trainer (max_staleness=0: synchronous RL)
    correct   never drop; the IS correction (group `correction`) handles stale tokens

The sampling policies order the buffered groups for the trainer: `fifo` (arrival order) and
`freshest` (highest oldest-token version first, ties in arrival order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moerl.common.checks import at_least

if TYPE_CHECKING:
    from hydra.core.config_store import ConfigStore


# --- staleness policies -----------------------------------------------------------


@dataclass
class StalenessConfig:
    """The staleness slot. A bare StalenessConfig means its `name` with these options."""

    name: str = "depth"
    """Policy registered in moerl.rollout.buffer_policies.STALENESS_POLICIES; pick one with
    `staleness=NAME`."""
    max_staleness: int = 1
    """Largest accepted staleness (trainer version − oldest token version) of a consumed
    group; 0 = strictly on-policy."""
    throttle: bool = True
    """Backpressure on generation: a producer waits before starting a group while groups
    queued, in flight and taken at the current version already fill max_staleness + 1
    trainer steps. With max_staleness=0 generation and training alternate exactly."""

    def validate(self, key: str) -> None:
        """Raise ValueError naming `key.field` for an out-of-range option."""
        at_least(f"{key}.max_staleness", self.max_staleness, 0)


@dataclass
class DropStaleConfig(StalenessConfig):
    """Drop groups staler than max_staleness at consumption; generation is not throttled."""

    name: str = "drop"
    """Registered name of this policy."""
    throttle: bool = False
    """Off: generation runs freely, stale groups are dropped (counted in buffer/dropped)."""


@dataclass
class DepthConfig(StalenessConfig):
    """Bound how far generation runs ahead of the trainer; drop what is still too stale
    (e.g. a partial rollout that waited through several weight updates)."""

    name: str = "depth"
    """Registered name of this policy."""
    throttle: bool = True
    """On: producers wait in RolloutBuffer.reserve until the trainer catches up."""


@dataclass
class CorrectStaleConfig(StalenessConfig):
    """Keep every group, however stale, and let the IS correction weight its tokens."""

    name: str = "correct"
    """Registered name of this policy."""
    throttle: bool = False
    """Off by default; when on, max_staleness bounds generation but nothing is dropped."""


@dataclass
class CustomStalenessConfig(StalenessConfig):
    """A policy outside moerl: `fn(StalenessInput, **options) -> StalenessOutput`."""

    name: str = "custom"
    """Marks the escape hatch; the function is found through `_target_`."""
    _target_: str = ""
    """Import path of the function, e.g. 'mylab.buffer.my_staleness'."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function (`+staleness.options.k=v`)."""


# --- sampling policies and the buffer ---------------------------------------------


@dataclass
class SamplingConfig:
    """The sampling slot. A bare SamplingConfig means its `name` with default options."""

    name: str = "fifo"
    """Policy registered in moerl.rollout.buffer_policies.SAMPLING_POLICIES; pick one with
    `buffer/sampling=NAME`."""

    def validate(self, key: str) -> None:
        """Raise ValueError naming `key.field` for an out-of-range option."""


@dataclass
class FifoConfig(SamplingConfig):
    """Oldest arrival first."""

    name: str = "fifo"
    """Registered name of this policy."""


@dataclass
class FreshestConfig(SamplingConfig):
    """Highest oldest-token version first; ties in arrival order."""

    name: str = "freshest"
    """Registered name of this policy."""


@dataclass
class CustomSamplingConfig(SamplingConfig):
    """A policy outside moerl: `fn(SamplingInput, **options) -> SamplingOutput`."""

    name: str = "custom"
    """Marks the escape hatch; the function is found through `_target_`."""
    _target_: str = ""
    """Import path of the function, e.g. 'mylab.buffer.my_order'."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function (`+buffer.sampling.options.k=v`)."""


@dataclass
class BufferConfig:
    """The bounded queue of finished groups between generation and the trainer."""

    max_groups: int = 64
    """Most groups (one prompt's completions each) queued or in flight at once; producers
    wait while it is full. Must hold at least one trainer step's groups."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Order in which the trainer takes groups (group `buffer/sampling`)."""

    def validate(self, key: str) -> None:
        """Raise ValueError naming `key.field` for an out-of-range option."""
        if isinstance(self.max_groups, bool) or not isinstance(self.max_groups, int):
            raise ValueError(f"{key}.max_groups={self.max_groups!r} must be an integer >= 1")
        if self.max_groups < 1:
            raise ValueError(
                f"{key}.max_groups={self.max_groups} must be >= 1: the buffer needs room for "
                "at least one group (and for every group of one trainer step)"
            )


STALENESS_OPTIONS: dict[str, type[StalenessConfig]] = {
    "drop": DropStaleConfig,
    "depth": DepthConfig,
    "correct": CorrectStaleConfig,
    "custom": CustomStalenessConfig,
}
SAMPLING_OPTIONS: dict[str, type[SamplingConfig]] = {
    "fifo": FifoConfig,
    "freshest": FreshestConfig,
    "custom": CustomSamplingConfig,
}


def register_buffer_configs(cs: ConfigStore) -> None:
    """Store one schema per option (`base_NAME`) in the groups `staleness` and
    `buffer/sampling`; the group bases (`base_buffer`, `base_staleness`) are stored by
    moerl.config.store with the other groups."""
    groups: dict[str, dict[str, type]] = {
        "staleness": dict(STALENESS_OPTIONS),
        "buffer/sampling": dict(SAMPLING_OPTIONS),
    }
    for group, options in groups.items():
        for name, schema in options.items():
            cs.store(group=group, name=f"base_{name}", node=schema, provider="moerl")
