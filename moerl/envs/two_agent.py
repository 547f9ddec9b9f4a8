"""`env=two_agent`: a proposer and a solver played by one policy (docs/architecture.md,
"Episodes").

    proposer obs     propose a problem like 12+7:      (the task's prompt as the example)
    proposer action  31+4                              the first `a op b` of the turn
    solver obs       solve: 31+4=
    solver action    35                                (or `answer: 35`)

Rewards, per role:
    proposer  valid_reward for a valid proposal (operands 0..max_operand, an operator of
              `ops`), given at its turn, plus 1 - valid_reward when the solver then gets it
              right, given with the solver's; an invalid proposal earns 0 and no bonus,
              and the solver gets the fallback problem instead (the task's example, or
              1+1), so every role acts in every episode (the runner's contract)
    solver    1 for the right answer, else partial_credit * its shaped score
so a proposer learns to pose valid problems the solver can solve. With `rounds` > 1 the
proposer proposes again after each answer, told `solved`/`failed`; the solver's stream is
told `correct `/`wrong ` through Observation.others before its next problem.
"""

from __future__ import annotations

import re

from moerl.config.env import TwoAgentEnvConfig
from moerl.envs.base import Action, Observation, Step
from moerl.envs.registry import ENVS
from moerl.envs.scoring import answer_reward
from moerl.tasks.base import Prompt
from moerl.tasks.synthetic import evaluate

PROPOSER = "proposer"
SOLVER = "solver"
_PROBLEM = re.compile(r"([0-9]+) *([-+*]) *([0-9]+)")


def parse_problem(text: str, cfg: TwoAgentEnvConfig) -> tuple[int, str, int] | None:
    """The first `a op b` in `text` when it is a valid proposal, else None."""
    found = _PROBLEM.search(text)
    if found is None:
        return None
    left, op, right = found.groups()
    if op not in cfg.ops or max(len(left), len(right)) > len(str(cfg.max_operand)):
        return None
    a, b = int(left), int(right)
    return (a, op, b) if max(a, b) <= cfg.max_operand else None


class TwoAgentEnv:
    """One episode of `rounds` proposal/answer rounds."""

    roles = (PROPOSER, SOLVER)

    def __init__(self, prompt: Prompt, cfg: TwoAgentEnvConfig) -> None:
        self.cfg = cfg
        example = parse_problem(prompt.text, cfg)
        self.example = "".join(map(str, example)) if example else ""
        self.rounds = 0
        self.answer = ""
        self.bonus = False  # the problem being solved is the proposer's own

    def _propose(self, lead: str = "", others: dict[str, str] | None = None) -> Observation:
        like = f" like {self.example}" if self.example else ""
        return Observation(f"{lead}propose a problem{like}: ", role=PROPOSER, others=others or {})

    async def reset(self) -> Observation:
        return self._propose()

    async def step(self, action: Action) -> Step:
        if action.role == PROPOSER:
            return self._proposed(action)
        if action.role == SOLVER:
            return self._answered(action)
        raise ValueError(f"env=two_agent: unknown role {action.role!r}")  # a runner bug

    def _proposed(self, action: Action) -> Step:
        problem = parse_problem(action.text, self.cfg)
        valid = problem is not None
        self.bonus = valid
        if problem is None:
            problem = parse_problem(self.example, self.cfg) or (1, "+", 1)
        a, op, b = problem
        self.answer = str(evaluate([a, b], [op]))
        return Step(
            observation=Observation(f"solve: {a}{op}{b}=", role=SOLVER),
            reward={PROPOSER: self.cfg.valid_reward if valid else 0.0},
            info={"valid_proposal": valid},
        )

    def _answered(self, action: Action) -> Step:
        cfg = self.cfg
        stopped = action.finish_reason == "stop"
        solver = answer_reward(action.text, self.answer, stopped, cfg.partial_credit)
        solved = solver == 1.0
        reward = {PROPOSER: (1.0 - cfg.valid_reward) * (solved and self.bonus), SOLVER: solver}
        self.rounds += 1
        info = {"correct": solved}
        if self.rounds >= cfg.rounds:
            return Step(reward=reward, done=True, info=info)
        lead = "solved, " if solved else "failed, "
        told = {SOLVER: "correct " if solved else "wrong "}
        return Step(observation=self._propose(lead, told), reward=reward, info=info)


@ENVS.register("two_agent", TwoAgentEnvConfig)
def two_agent(prompt: Prompt, cfg: TwoAgentEnvConfig) -> TwoAgentEnv:
    return TwoAgentEnv(prompt, cfg)
