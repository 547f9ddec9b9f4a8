"""Observation text → the token ids appended to a role's stream (env.renderer; docs/
architecture.md, "Episodes").

Only the new text is tokenised, never the stream decoded again: re-tokenising decoded
text can merge or split tokens differently (BPE), and the trainer must train on exactly
the ids the engine saw.

- ``raw``: the tokenizer's encoding of the text alone; the first observation of a role
  starts with the tokenizer's BOS when it has one (as the tasks' prompts do).
- ``chat``: the first observation is a user turn with the generation prompt; a later one
  closes the previous assistant turn (what the chat template writes after an assistant
  message, less the EOS the policy already sampled), then a user turn and the generation
  prompt. The pieces are cut from the template's own renderings of a placeholder
  conversation, so any template works that renders messages one after another.
"""

from __future__ import annotations

from typing import Any

from moerl.common.checks import one_of
from moerl.tasks.indexed import encode_prompt

_USER, _ASSISTANT = "\x00user\x00", "\x00assistant\x00"


class Renderer:
    """Tokenises observations for one tokenizer in one of the modes above."""

    def __init__(self, tokenizer: Any, mode: str = "raw") -> None:
        one_of("env.renderer", mode, ("raw", "chat"))
        self.tokenizer, self.mode = tokenizer, mode
        self._close = self._next = ""
        if mode == "chat":
            self._close, self._next = self._chat_pieces()

    def first(self, text: str) -> list[int]:
        """A role's first observation (its prompt)."""
        return [int(i) for i in encode_prompt(self.tokenizer, text, self.mode == "chat")]

    def next(self, text: str, after: list[int]) -> list[int]:
        """An observation that follows the role's action ``after`` (its token ids)."""
        if self.mode == "raw":
            return self._encode(text)
        close = self._close
        eos = self.tokenizer.eos_token
        if after and eos and after[-1] == self.tokenizer.eos_token_id and close.startswith(eos):
            close = close[len(eos) :]
        return self._encode(close + self._next.replace(_USER, text))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chat_pieces(self) -> tuple[str, str]:
        """(what the template writes after an assistant message's content, a user turn
        with the generation prompt, its content marked by _USER)."""

        def render(messages: list[dict[str, str]], prompt: bool) -> str:
            return str(
                self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=prompt
                )
            )

        one = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _ASSISTANT}]
        head = render(one, prompt=False)
        full = render([*one, {"role": "user", "content": _USER}], prompt=True)
        if not full.startswith(head) or _ASSISTANT not in head:
            raise ValueError(
                "env.renderer=chat needs a chat template that renders a conversation one "
                "message after another; this tokenizer's does not (use env.renderer=raw)"
            )
        close = head[head.index(_ASSISTANT) + len(_ASSISTANT) :]
        return close, full[len(head) :]
