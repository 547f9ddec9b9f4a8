"""An environment defined outside moerl, as a user would (`env=custom
env._target_=envs_for_tests.make_echo`); `tests/` is on sys.path through its conftest."""

from __future__ import annotations

from moerl.envs import Action, Observation, Step
from moerl.tasks import Prompt


class EchoEnv:
    """One turn: shows the prompt and `word`, rewards an action that repeats `word`."""

    def __init__(self, prompt: Prompt, word: str) -> None:
        self.prompt = prompt
        self.word = word

    async def reset(self) -> Observation:
        return Observation(text=f"{self.prompt.text} say {self.word}: ")

    async def step(self, action: Action) -> Step:
        return Step(reward=float(action.text.strip() == self.word), done=True)


def make_echo(prompt: Prompt, word: str = "hi") -> EchoEnv:
    return EchoEnv(prompt, word)


class SyncEnv:
    """Has reset and step, but not async: not an Env."""

    def reset(self) -> Observation:
        return Observation()

    def step(self, action: Action) -> Step:
        return Step(done=True)


def make_sync(prompt: Prompt) -> SyncEnv:
    return SyncEnv()


def make_nothing(prompt: Prompt) -> object:
    return object()


NOT_CALLABLE = 3
