"""Environments for multi-turn, tool-using and multi-agent episodes (docs/architecture.md,
"Episodes").

`base.py` is the async contract (Env, Observation, Action, Step), `registry.py` the
`env` slot's registry and factory builder. The built-ins, registered on import:
`calculator.py` (tool use; the tool-call format is in `tools.py`), `guess_number.py` (a
feedback game) and `two_agent.py` (proposer and solver on one policy). The episode runner
lives in moerl.rollout.
"""

from moerl.envs.base import POLICY_ROLE, Action, Env, Observation, Step
from moerl.envs.calculator import CalculatorEnv
from moerl.envs.guess_number import GuessNumberEnv, secret_of
from moerl.envs.registry import ENVS, build_env_factory, check_env_config, env_config
from moerl.envs.tools import ToolCall, ToolCallError, calc, parse_tool_call
from moerl.envs.two_agent import TwoAgentEnv

__all__ = [
    "ENVS",
    "POLICY_ROLE",
    "Action",
    "CalculatorEnv",
    "Env",
    "GuessNumberEnv",
    "Observation",
    "Step",
    "ToolCall",
    "ToolCallError",
    "TwoAgentEnv",
    "build_env_factory",
    "calc",
    "check_env_config",
    "env_config",
    "secret_of",
    "parse_tool_call",
]
