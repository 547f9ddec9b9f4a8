"""The environment contract of an episode (docs/architecture.md, "Episodes").

An episode is a conversation between the policy and an environment, possibly with several
agents (roles) played by the same policy. The episode runner (moerl.rollout.episode)
drives it, token in and token out:

    env = make_env(prompt)                  # one Env per episode (the registry's factory)
    obs = await env.reset()                 # the first observation, for obs.role
    while not done:
        action = generate for obs.role      # the role's token stream so far, as token ids
        step = await env.step(action)       # reward for that action, next observation
        obs, done = step.observation, step.done

Each role has its own token stream: its observations (tokens it did not generate: the
prompt, tool results, the other agent's messages; never trained) and its actions (tokens
the policy sampled for it; trained with that role's reward). An observation's text is
tokenised on its own and appended to the stream, never the stream's decoded text again,
so the trainer trains on exactly the ids the engine saw.

Everything is async: many episodes are in flight, and an environment that waits (a tool,
a sandbox, a remote service) holds up only its own episode. A synchronous environment can
do its work in ``asyncio.to_thread``.

A tool call the environment cannot parse is an observation ("error: ..."), not an
exception: the policy is trained on what it produced. An exception from reset() or step()
is a bug in the environment and fails the episode's group with the environment's error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

POLICY_ROLE = "policy"
"""The role of a single-agent episode."""


@dataclass
class Observation:
    """Tokens appended to ``role``'s stream, after which ``role`` acts."""

    text: str = ""
    """The observation as text; the episode's renderer tokenises it (moerl.rollout.render)."""
    token_ids: Sequence[int] | None = None
    """The observation as token ids, appended as they are (wins over ``text``)."""
    role: str = POLICY_ROLE
    """The agent that acts next, and whose stream this observation extends."""
    others: Mapping[str, str] = field(default_factory=dict)
    """Text appended to other roles' streams without their acting now (e.g. what the
    other player said, so it is in their context at their next turn)."""


@dataclass
class Action:
    """What the policy generated for one role in one turn."""

    role: str
    """The agent that acted."""
    text: str
    """The generated tokens decoded (special tokens skipped), for parsing."""
    token_ids: list[int]
    """The generated token ids (the EOS or stop token included when sampled)."""
    finish_reason: str | None
    """'stop' or 'length'."""
    turn: int
    """0-based index of this action in the episode (all roles counted)."""


@dataclass
class Step:
    """The environment's answer to an action."""

    observation: Observation | None = None
    """What comes next; None (or ``done``) ends the episode."""
    reward: float | Mapping[str, float] = 0.0
    """Reward for the action just taken: a number for the acting role, or a reward per
    role (e.g. the proposer's and the solver's at the end of a two-agent round)."""
    done: bool = False
    """The episode is over."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form, JSON-safe; ``tool_error: True`` counts towards episode/tool_error_rate,
    ``tool_call: True`` towards the tool calls it is a rate of."""


@runtime_checkable
class Env(Protocol):
    """One episode's environment; built per episode by the configured factory
    ``make(prompt) -> Env`` (moerl.envs.registry).

    An environment with several agents declares them in a ``roles`` attribute (a tuple
    of names; without one the episode has the single role 'policy'). Every role must act
    at least once in every episode: the runner gives one trajectory per role, so a group
    always holds the same number of them. An optional ``async close()`` is awaited when
    the episode ends."""

    async def reset(self) -> Observation:
        """The first observation (the task, as the first role should see it)."""
        ...

    async def step(self, action: Action) -> Step:
        """Apply ``action``; return its reward and what comes next."""
        ...
