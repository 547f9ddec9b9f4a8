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

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from moerl.common.trajectory import Trajectory
from moerl.tasks.base import Prompt
from moerl.tasks.rewards import RewardInput, build_reward, decode_response

Messages = list[dict[str, Any]]
"""A chat prompt: [{"role": "user", "content": "..."}, ...], as apply_chat_template takes."""
log = logging.getLogger(__name__)
_UNK_WARNED: set[int] = set()  # tokenizers already warned about (by id)


def encode_prompt(
    tokenizer: Any,
    prompt: str | Messages,
    chat_template: bool = False,
    system_prompt: str = "",
) -> np.ndarray:
    """int32 [P]: the prompt's tokens, BOS first when the tokenizer has one.

    With `chat_template`, a text prompt is one user turn and a messages prompt goes in as
    given; `system_prompt` is put first unless the messages already start with a system
    message. Without it, `prompt` must be text.
    """
    if chat_template:
        ids = tokenizer.apply_chat_template(
            chat_messages(prompt, system_prompt), add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        if not isinstance(prompt, str):
            raise ValueError(
                "a chat-messages prompt needs the tokenizer's chat template: set "
                "task.chat_template=true"
            )
        ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        bos = tokenizer.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]  # tokenizers without a post-processor (the tiny one) skip it
        _warn_unknown(tokenizer, prompt, ids)
    return np.asarray(ids, dtype=np.int32)


def _warn_unknown(tokenizer: Any, text: str, ids: list[int]) -> None:
    """Say once per tokenizer when a prompt's characters became its unknown token (the
    tiny models' tokenizer knows only what the built-in tasks write)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or unk not in ids or id(tokenizer) in _UNK_WARNED:
        return
    _UNK_WARNED.add(id(tokenizer))
    lost = sorted({c for c in text if tokenizer.convert_tokens_to_ids(c) == unk})
    log.warning(
        "prompt characters the tokenizer does not know became %s: %s (e.g. in %r); the "
        "model cannot read them. Use a checkpoint whose tokenizer covers the data "
        "(model.path=...), or keep the data to what the tokenizer knows",
        tokenizer.unk_token, " ".join(repr(c) for c in lost[:20]) or "?", text[:60],
    )  # fmt: skip


def chat_messages(prompt: str | Messages, system_prompt: str = "") -> Messages:
    """The messages a chat-template prompt renders: a text prompt as one user turn, the
    system prompt first unless the messages already start with a system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return list(messages)


def check_chat_template(tokenizer: Any) -> None:
    """Raise ValueError when `task.chat_template=true` meets a tokenizer without one."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"task.chat_template=true but the tokenizer ({type(tokenizer).__name__}) has no "
            "chat template (a base checkpoint?); set task.chat_template=false for raw text "
            "prompts, or use an instruct checkpoint whose tokenizer_config.json has one"
        )


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
        system_prompt: str = "",
    ) -> None:
        if num_items is not None and num_items < 1:
            raise ValueError(f"a task needs at least one prompt, got num_items={num_items}")
        self.tokenizer = tokenizer
        self.seed = int(seed)
        self.num_items = num_items
        self.shuffle = shuffle
        if chat_template:
            check_chat_template(tokenizer)
        self.chat_template = chat_template
        self.system_prompt = system_prompt
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
            system_prompt=cfg.system_prompt,
        )

    # ---- subclass hooks --------------------------------------------------------------

    def item(self, index: int) -> tuple[str | Messages, Any]:
        """(prompt text or chat messages, answer) of item `index`."""
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
        prompt, answer = self.item(index)
        ids = encode_prompt(self.tokenizer, prompt, self.chat_template, self.system_prompt)
        text = prompt if isinstance(prompt, str) else self.render(prompt)
        return Prompt(pos, ids, answer=answer, text=text, meta={"item": index})

    def render(self, messages: Messages) -> str:
        """A messages prompt as the chat template writes it (Prompt.text, for logs)."""
        text = self.tokenizer.apply_chat_template(
            chat_messages(messages, self.system_prompt),
            add_generation_prompt=True,
            tokenize=False,
        )
        return str(text)

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
