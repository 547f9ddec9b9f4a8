"""`IndexedTask`: the shared machinery of moerl's tasks.

A task is a function from an item index to (prompt text, answer), plus a reward function.
Position p of the prompt stream maps to an item without generating the positions before it,
so `prompts(start=k)` resumes in O(1) and equals the tail of `prompts(0)`:

    endless (num_items None)  item = p; a synthetic task draws item p from
                              numpy.random.default_rng([seed, p])
    fixed set of N items      epoch, j = divmod(p, N); item = permutation_epoch[j], the
                              permutation drawn from default_rng([seed, epoch]) (or j when
                              shuffle is off)

Prompt ids are the stream positions, so a resumed run's data cursor is just an int.
"""

# P prompt tokens, R response tokens

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from moerl.common.trajectory import Trajectory
from moerl.tasks.base import Prompt
from moerl.tasks.rewards import RewardInput, build_reward, decode_response


def encode_prompt(tokenizer: Any, text: str, chat_template: bool = False) -> np.ndarray:
    """int32 [P]: the prompt's tokens, BOS first when the tokenizer has one."""
    if chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        bos = tokenizer.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]  # tokenizers without a post-processor (the tiny one) skip it
    return np.asarray(ids, dtype=np.int32)


def encode_target(tokenizer: Any, text: str) -> np.ndarray:
    """int32 [R]: a correct completion's tokens, EOS last."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; a completion cannot end")
    return np.asarray([*ids, tokenizer.eos_token_id], dtype=np.int32)


class IndexedTask:
    """Base of the built-in tasks; subclasses define `item(index) -> (text, answer)`."""

    default_reward = "exact"
    """The reward function used when the config leaves `reward` empty."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        seed: int = 0,
        num_items: int | None = None,
        shuffle: bool = True,
        reward: str = "",
        reward_options: dict[str, Any] | None = None,
        chat_template: bool = False,
    ) -> None:
        if num_items is not None and num_items < 1:
            raise ValueError(f"a task needs at least one prompt, got num_items={num_items}")
        self.tokenizer = tokenizer
        self.seed = int(seed)
        self.num_items = num_items
        self.shuffle = shuffle
        self.chat_template = chat_template
        self.reward_name = reward or self.default_reward
        self._reward = build_reward(self.reward_name, reward_options)
        self._perm: tuple[int, np.ndarray] | None = None

    @classmethod
    def configured(cls, cfg: Any, num_items: int | None = None) -> dict[str, Any]:
        """The constructor arguments a task config (TaskConfig fields) gives."""
        return dict(
            seed=cfg.seed,
            num_items=num_items if num_items is not None else (cfg.num_prompts or None),
            shuffle=cfg.shuffle,
            reward=cfg.reward,
            reward_options=dict(cfg.reward_options),
            chat_template=cfg.chat_template,
        )

    # ---- subclass hooks --------------------------------------------------------------

    def item(self, index: int) -> tuple[str, Any]:
        """(prompt text, answer) of item `index`."""
        raise NotImplementedError

    def reference(self, prompt: Prompt) -> str:
        """A correct completion's text (what warm-start SFT trains on)."""
        return str(prompt.answer)

    # ---- the Task protocol -----------------------------------------------------------

    def prompts(self, start: int = 0) -> Iterator[Prompt]:
        if start < 0:
            raise ValueError(f"prompts(start={start}): the cursor cannot be negative")
        pos = start
        while True:
            yield self.prompt(pos)
            pos += 1

    def prompt(self, pos: int) -> Prompt:
        """The prompt at stream position `pos`."""
        index = self.index_at(pos)
        text, answer = self.item(index)
        ids = encode_prompt(self.tokenizer, text, self.chat_template)
        return Prompt(pos, ids, answer=answer, text=text, meta={"item": index})

    def reward(self, prompt: Prompt, traj: Trajectory) -> Any:
        return self._reward(self.reward_input(prompt, traj))

    # ---- helpers ---------------------------------------------------------------------

    def reward_input(self, prompt: Prompt, traj: Trajectory) -> RewardInput:
        text, stopped = decode_response(self.tokenizer, traj)
        return RewardInput(text, prompt.answer, stopped, prompt, traj)

    def index_at(self, pos: int) -> int:
        """The item shown at stream position `pos`."""
        if self.num_items is None:
            return pos
        epoch, j = divmod(pos, self.num_items)
        if not self.shuffle:
            return j
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = (epoch, rng.permutation(self.num_items))
        return int(self._perm[1][j])

    def rng(self, index: int) -> np.random.Generator:
        """The generator a synthetic task draws item `index` from."""
        return np.random.default_rng([self.seed, index])
