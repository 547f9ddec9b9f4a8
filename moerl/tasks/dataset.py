"""Real data: prompts from local parquet, JSON Lines or Arrow files through HF `datasets`.

    task=dataset task.path=/data/gsm8k/train.parquet task.reward=numeric
    task=dataset task.path=/data/chat task.messages_key=messages task.chat_template=true \\
        task.system_prompt='answer with a number.' task.eval_split=test

`path` is a file (`format` from its suffix), a glob, a directory of data files named by
split (train.parquet, test.parquet: `datasets` infers the splits) or a directory written
by `datasets.save_to_disk` (a Dataset, or a DatasetDict of splits). Only local paths are
accepted and only `datasets`' packaged builders run, so nothing is fetched from the hub.

Rows map to prompts by column: `prompt_key` (text) or `messages_key` (chat messages, which
go through the tokenizer's chat template), `answer_key`, and `metadata_keys` copied into
`Prompt.meta`. The row order is the dataset's; `IndexedTask` visits the rows in a new
permutation each epoch, drawn from `task.seed`, so a resumed data cursor continues with the
same prompt. `eval_fraction` holds out a fixed random part of the split (drawn from
`split_seed`); the task trains on the rest, and `cfg.for_eval()` reads the held-out part.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import numpy as np

from moerl.config.task import DatasetTaskConfig
from moerl.tasks.base import Prompt
from moerl.tasks.indexed import IndexedTask, Messages

SUFFIX_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
INSTALL_HINT = "task=dataset needs HF datasets: pip install 'moerl[data]'"


def import_datasets() -> Any:
    """The `datasets` module, or an ImportError naming the extra that installs it."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return datasets


def load_rows(cfg: DatasetTaskConfig) -> Any:
    """The `datasets.Dataset` of the configured split (or its training / held-out part),
    its columns checked against the field mapping. Also the start-up check."""
    cfg.validate("task")
    splits = load_splits(cfg)
    if cfg.split not in splits:
        raise ValueError(
            f"task.split={cfg.split!r}: {cfg.path} has the splits {', '.join(splits)}; "
            "pick one of them"
        )
    if cfg.eval_split and cfg.eval_split not in splits:
        raise ValueError(
            f"task.eval_split={cfg.eval_split!r}: {cfg.path} has the splits "
            f"{', '.join(splits)}; pick one of them, or use task.eval_fraction"
        )
    rows = splits[cfg.split]
    check_columns(rows, cfg)
    if cfg.eval_fraction > 0:
        train, held = holdout(len(rows), cfg.eval_fraction, cfg.split_seed)
        rows = rows.select(held if cfg.heldout else train)
    if cfg.num_prompts:
        rows = rows.select(range(min(cfg.num_prompts, len(rows))))
    if len(rows) == 0:
        raise ValueError(f"task.path={cfg.path!r}: split {cfg.split!r} holds no rows")
    return rows


def load_splits(cfg: DatasetTaskConfig) -> dict[str, Any]:
    """Split name -> `datasets.Dataset`, from local files only."""
    datasets = import_datasets()
    path = Path(cfg.path).expanduser()
    files = sorted(glob.glob(str(path))) if glob.has_magic(str(path)) else []
    if not path.exists() and not files:
        raise ValueError(
            f"task.path={cfg.path!r} does not exist; give a local parquet, jsonl or arrow "
            "file (or a glob of them), or a directory written by datasets.save_to_disk"
        )
    cache_dir = cfg.cache_dir or None
    if path.is_dir() and (
        (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
    ):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.Dataset):
            return {"train": loaded}
        return dict(loaded)
    if path.is_dir():
        fmt = cfg.format or dir_format(path)
        loaded = datasets.load_dataset(fmt, data_dir=str(path), cache_dir=cache_dir)
    else:
        fmt = cfg.format or file_format(files[0] if files else path)
        data_files = files or [str(path)]
        loaded = datasets.load_dataset(fmt, data_files=data_files, cache_dir=cache_dir)
    return dict(loaded)


def file_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        raise ValueError(
            f"task.path={str(path)!r}: cannot tell the format from the suffix {suffix!r}; "
            f"set task.format to one of parquet, json, arrow"
        )
    return SUFFIX_FORMATS[suffix]


def dir_format(path: Path) -> str:
    found = {SUFFIX_FORMATS[f.suffix] for f in path.iterdir() if f.suffix in SUFFIX_FORMATS}
    if len(found) != 1:
        raise ValueError(
            f"task.path={str(path)!r} is a directory with "
            + (
                f"data files of several formats ({', '.join(sorted(found))})"
                if found
                else "no .parquet, .jsonl, .json or .arrow files"
            )
            + "; set task.format, or point task.path at a file or a save_to_disk directory"
        )
    return found.pop()


def check_columns(rows: Any, cfg: DatasetTaskConfig) -> None:
    """Raise ValueError naming a mapped column the data lacks, and the columns it has."""
    wanted = [
        ("messages_key", cfg.messages_key) if cfg.messages_key else ("prompt_key", cfg.prompt_key),
        ("answer_key", cfg.answer_key),
        *(("metadata_keys", key) for key in cfg.metadata_keys),
    ]
    columns = list(rows.column_names)
    for option, key in wanted:
        if key not in columns:
            raise ValueError(
                f"task.{option}={key!r}: {cfg.path} split {cfg.split!r} has no column {key!r} "
                f"(columns: {', '.join(columns)}); set task.{option} to one of them"
            )


def holdout(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows) of n rows, both ascending: a random ceil(n * fraction)
    rows held out, drawn from `seed` alone."""
    n_held = min(n - 1, int(np.ceil(n * fraction))) if n > 1 else 0
    held = np.sort(np.random.default_rng(seed).permutation(n)[:n_held])
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    return np.flatnonzero(keep), held


class DatasetTask(IndexedTask):
    """Rows of a local dataset in epochs (reshuffled each epoch when `shuffle`)."""

    def __init__(self, tokenizer: Any, cfg: DatasetTaskConfig) -> None:
        rows = load_rows(cfg)
        super().__init__(tokenizer, **self.configured(cfg, num_items=len(rows)))
        self.cfg = cfg
        self.rows = rows

    def item(self, index: int) -> tuple[str | Messages, Any]:
        row = self.rows[index]
        if self.cfg.messages_key:
            return check_messages(row[self.cfg.messages_key], index), row[self.cfg.answer_key]
        prompt = row[self.cfg.prompt_key]
        if not isinstance(prompt, str):
            raise ValueError(
                f"{self.cfg.path}: row {index} column {self.cfg.prompt_key!r} is "
                f"{type(prompt).__name__}, not text; chat messages go in task.messages_key"
            )
        return prompt, row[self.cfg.answer_key]

    def prompt(self, pos: int) -> Prompt:
        p = super().prompt(pos)
        row = self.rows[p.meta["item"]]
        p.meta.update({key: row[key] for key in self.cfg.metadata_keys})
        return p


def check_messages(messages: Any, index: int) -> Messages:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise ValueError(
            f"row {index}: task.messages_key must hold a list of {{role, content}} messages, "
            f"got {messages!r:.80}"
        )
    return messages
