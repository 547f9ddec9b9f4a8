"""`env=calculator`: tool use on an arithmetic prompt (docs/architecture.md, "Episodes").

    obs     12+7*3=                  the task's prompt (task=arithmetic), after the preamble
    action  call:calc(7*3)           a tool call (moerl.envs.tools), reward tool_credit
    obs     result: 21               the tool's result ...
    action  call:calc(12+)
    obs     error: expression ends too early    ... or why the call failed (tool_error)
    action  answer: 33               no `call:`: the final answer; the episode ends with
                                     1 if right, else partial_credit * its shaped score

A call to another tool, or one past `max_tool_calls`, is an `error: ...` observation too.
Observations are in the tiny tokenizer's characters and never echo the policy's text.
"""

from __future__ import annotations

from moerl.config.env import CalculatorEnvConfig
from moerl.envs.base import Action, Observation, Step
from moerl.envs.registry import ENVS
from moerl.envs.scoring import answer_reward
from moerl.envs.tools import ToolCallError, calc, parse_tool_call
from moerl.tasks.base import Prompt

TOOL = "calc"


class CalculatorEnv:
    """One episode: the prompt's expression, up to `max_tool_calls` calls, one answer."""

    def __init__(self, prompt: Prompt, cfg: CalculatorEnvConfig) -> None:
        self.cfg = cfg
        self.problem = prompt.text.strip()
        self.answer = str(prompt.answer) if prompt.answer is not None else self._solve()
        self.calls = 0

    def _solve(self) -> str:
        value = calc(self.problem.rstrip("="))
        if isinstance(value, ToolCallError):
            raise ValueError(
                f"env=calculator: prompt {self.problem!r} has no answer and is not an "
                f"expression calc evaluates ({value.reason}); use task=arithmetic"
            )
        return str(value)

    async def reset(self) -> Observation:
        return Observation(text=self.cfg.preamble + self.problem)

    async def step(self, action: Action) -> Step:
        call = parse_tool_call(action.text)
        if call is None:
            stopped = action.finish_reason == "stop"
            reward = answer_reward(action.text, self.answer, stopped, self.cfg.partial_credit)
            return Step(reward=reward, done=True, info={"correct": reward == 1.0})
        if isinstance(call, ToolCallError):
            return _error(call.reason)
        if call.name != TOOL:
            return _error(f"unknown tool {call.name}, use {TOOL}")
        if self.calls >= self.cfg.max_tool_calls:
            return _error(f"no tool calls left after {self.cfg.max_tool_calls}, answer now")
        self.calls += 1
        value = calc(call.args)
        if isinstance(value, ToolCallError):
            return _error(value.reason)
        return Step(
            observation=Observation(text=f"result: {value} "),
            reward=self.cfg.tool_credit,
            info={"tool_call": True},
        )


def _error(reason: str) -> Step:
    return Step(
        observation=Observation(text=f"error: {reason} "),
        info={"tool_call": True, "tool_error": True},
    )


@ENVS.register("calculator", CalculatorEnvConfig)
def calculator(prompt: Prompt, cfg: CalculatorEnvConfig) -> CalculatorEnv:
    return CalculatorEnv(prompt, cfg)
