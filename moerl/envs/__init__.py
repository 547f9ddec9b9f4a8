"""Environments for multi-turn, tool-using and multi-agent episodes.

`base.py` is the async contract (Env, Observation, Action, Step), `registry.py` the
`env` slot's registry and factory builder. The episode runner lives in moerl.rollout.
"""

from moerl.envs.base import POLICY_ROLE, Action, Env, Observation, Step
from moerl.envs.registry import ENVS, build_env_factory

__all__ = ["ENVS", "POLICY_ROLE", "Action", "Env", "Observation", "Step", "build_env_factory"]
