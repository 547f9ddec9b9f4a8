"""Bring-your-own data: prompt/answer records from a local jsonl file.

Each non-blank line is a JSON object with a prompt field and an answer field (names set by
`prompt_key` / `answer_key`); other fields are kept in `Prompt.meta["record"]` for rewards
that need them. The reward is a built-in (`exact` by default, `numeric`, `prefix`,
`shaped`) or any `fn(RewardInput, **options) -> float` by import path:

    task=jsonl task.path=/data/gsm8k_train.jsonl task.reward=numeric
    task=jsonl task.path=mine.jsonl task.reward=mylab.rewards.judge +task.reward_options.k=3

The file is read once, at construction; a bad line fails with its line number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moerl.config.task import JsonlTaskConfig
from moerl.tasks.base import Prompt
from moerl.tasks.indexed import IndexedTask


def read_records(
    path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer"
) -> list[dict[str, Any]]:
    """The file's records, each checked for a string prompt and an answer."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task.path={str(path)!r} is not a file; give a local jsonl file")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {rec!r:.60}")
            for key in (prompt_key, answer_key):
                if key not in rec:
                    raise ValueError(
                        f"{path}:{lineno}: no field {key!r} (fields: {', '.join(rec)}); "
                        f"set task.prompt_key / task.answer_key to the file's names"
                    )
            if not isinstance(rec[prompt_key], str):
                raise ValueError(f"{path}:{lineno}: field {prompt_key!r} must be a string")
            records.append(rec)
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


class JsonlTask(IndexedTask):
    """Records of a jsonl file in epochs (reshuffled each epoch when `shuffle`)."""

    def __init__(self, tokenizer: Any, cfg: JsonlTaskConfig) -> None:
        cfg.validate("task")
        records = read_records(cfg.path, cfg.prompt_key, cfg.answer_key)
        if cfg.num_prompts:
            records = records[: cfg.num_prompts]
        super().__init__(tokenizer, **self.configured(cfg, num_items=len(records)))
        self.cfg = cfg
        self.records = records

    def item(self, index: int) -> tuple[str, Any]:
        rec = self.records[index]
        return rec[self.cfg.prompt_key], rec[self.cfg.answer_key]

    def prompt(self, pos: int) -> Prompt:
        p = super().prompt(pos)
        p.meta["record"] = self.records[p.meta["item"]]
        return p
